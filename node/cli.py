"""``lowcomm-node join | status | healthcheck | export | init-config``.

User mistakes (bad config, unreachable peers, busy ports) end with one ``lowcomm-node: error:``
line on stderr and a non-zero exit code, never a traceback.
"""

from __future__ import annotations

import argparse
import asyncio
import errno
import json
import logging
import math
import os
import re
import sys
import time
from pathlib import Path
from typing import Any, Mapping, Sequence

from lowcomm import __version__

from . import peerbook
from .checkpoint_dir import first_missing, lock_checkpoint_dir, remove_if_never_used
from .config import (NODE_KEYS, Config, ConfigError, NodeSection, load_config, read_layers, validate_layers,
                     warn_ignored_settings)

# 2: what was given is wrong (a config key, a flag, --peers, --data, a port another process holds,
# a tokenizer or model file that cannot be used), as argparse's own errors;
# 1: the node could not do its work (an unreachable peer, a failed round).
EXIT_USAGE = 2
EXIT_FAILURE = 1
EXIT_BROKEN_PIPE = 128 + 13  # what a shell reports for a program that SIGPIPE ended, as `yes | head` does


class UsageError(RuntimeError):
    """A mistake in what was given (a malformed --peers multiaddr): exits with EXIT_USAGE. A
    RuntimeError, as every other start failure that lowcomm.Swarm turns into a SwarmError."""


def _fail(message: str, code: int = EXIT_FAILURE) -> int:
    print(f"lowcomm-node: error: {message}", file=sys.stderr)
    return code


# -- join ----------------------------------------------------------------------------------------


def _add_join_flags(parser: argparse.ArgumentParser) -> None:
    # Every flag defaults to None so that only flags actually given override the TOML and env.
    add = parser.add_argument
    add("--peers", "--initial-peers", dest="peers", nargs="+", action="extend", metavar="MADDR",
        help="multiaddr(s) of peers already in the swarm; none: start a new swarm")
    add("--config", type=Path, help="run config TOML (see `lowcomm-node init-config`)")
    add("--host", help="IP address of the interface to listen on (default 0.0.0.0: every interface)")
    add("--announce-host", help="host other peers use to reach this node's gRPC server")
    add("--grpc-port", type=int, metavar="P", help="gRPC port (default 7701; 0: any free port)")
    add("--dht-port", type=int, metavar="P", help="DHT (libp2p) port (default 7700; 0: any free port)")
    add("--metrics-port", type=int, metavar="P", help="Prometheus /metrics port (default 7702; 0: any free port)")
    add("--identity", type=Path, metavar="PATH", help="libp2p key file (default <checkpoint-dir>/identity.key)")
    add("--checkpoint-dir", type=Path, metavar="DIR", help="checkpoint directory (default ./lowcomm-checkpoints)")
    add("--run-secret-file", type=Path, metavar="F",
        help="file holding the run's shared secret: every RPC and DHT record is then authenticated")
    add("--tls-cert", type=Path, metavar="PEM",
        help="serve gRPC over TLS with this certificate (with --tls-key); peers' channels trust it as root, "
             "so a run shares one certificate or a CA appended to each peer's certificate")
    add("--tls-key", type=Path, metavar="PEM", help="private key of --tls-cert")
    add("--client-mode", action="store_const", const=True, default=None,
        help="no inbound connections: own no shard, serve no state (behind NAT; needs --peers)")
    add("--max-rounds", type=int, metavar="N", help="exit 0 after N completed outer rounds")
    add("--wait-for-peers", type=int, metavar="N",
        help="start training once N peers, this one included, are in the swarm (default 1: at once)")
    add("--max-clock-offset", type=float, metavar="S",
        help="largest offset (seconds) of this machine's clock from the swarm's that is corrected "
             "(default 86400); beyond it the node stops; 0: never correct")
    add("--data", metavar="PATH", help="[data] path: the training data instead of the default corpus (a glob of "
                                       "text files, or the file or folder of the [data] format)")
    add("--device", choices=["auto", "cpu", "cuda"], help="where inner steps run (default auto)")
    add("--torch-threads", type=int, metavar="N", help="torch threads of the training thread")
    add("--log-format", choices=["auto", "text", "json"], help="auto: text on a terminal, JSON otherwise")
    add("--log-level", choices=["debug", "info", "warning", "error"])
    add("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
        help="override one run-config key, e.g. --set train.inner_steps=20 (repeatable)")


def _join_flags(args: argparse.Namespace) -> dict[str, Any]:
    keys = set(NODE_KEYS) | {"data"}
    return {key: getattr(args, key) for key in keys if getattr(args, key, None) is not None}


def _validation_message(err: Exception) -> str:
    """One line for hivemind's refusal of a bootstrap peer (clock or reachability)."""
    from .clock import FIX, describe

    text = str(err)
    times = re.search(r"local: ([0-9.]+), peer: ([0-9.]+)", text)
    if times:
        offset = float(times.group(2)) - float(times.group(1))
        # Only when the node could not measure its offset before hivemind's check (node/clock.py).
        return (f"this machine's clock is {describe(offset)} a bootstrap peer's ({abs(offset):.1f} s; hivemind's "
                f"DHT allows 3 s and the offset could not be measured to correct it): {FIX}")
    if "can't access this node" in text:
        return (f"a bootstrap peer cannot connect back to this node's DHT port ({text.split('.')[0]}); open the "
                f"port in the firewall or NAT, or join with --client-mode")
    return f"a bootstrap peer was refused: {text.splitlines()[0] if text else type(err).__name__}"


# A bootstrap peer that accepted the connection but did not answer hivemind's DHT ping in time
# (3 s) is busy, not gone: 32 nodes starting at once on 2 cores made one of them exit here. The
# DHT start is tried again after these pauses (seconds) before the node gives up.
BOOTSTRAP_RETRY_PAUSES = (2.0, 4.0, 8.0)
_UNANSWERED_PINGS = "none of the initial_peers responded to a ping"


_sleep = time.sleep  # a seam for the tests


class NoPeerAnswered(RuntimeError):
    """None of the peers a DHT start was given answered (the message says which and how)."""


def start_dht(config: Config, sources: dict[tuple[str, str], str] | None = None):
    """Create the hivemind DHT before any event loop or gRPC object exists (it forks).

    On the way the DHT process measures this machine's clock offset from the bootstrap peers and
    adopts it (node/clock.py); a warning says so here. When the bootstrap peers are reachable
    but none answers the DHT's ping in time, the start is tried again (``BOOTSTRAP_RETRY_PAUSES``).
    The peers this node saw on its last run (node/peerbook.py) are its way in when it was given
    no ``--peers`` (else it starts alone, as the first peer) and when none of its ``--peers`` answers.
    ``sources``: where each config key came from (config.ConfigLayers), for the messages.
    """
    # Here, the first step of a node's start that follows the logging setup of both `join` and
    # lowcomm.Swarm (which prints the "lowcomm" logger's records): each key the config sets in
    # vain is said once, as the node starts.
    warn_ignored_settings(config, sources)
    node = config.node
    peers_source = (sources or {}).get(("node", "peers"), _PEERS_FLAG)
    _check_peer_multiaddrs(node.peers, peers_source)
    _check_identity_path(config.identity_path)
    _check_dht_address(node.host, node.dht_port)
    given = {peerbook.peer_id_of(m) for m in node.peers}
    book = peerbook.book_path(node.checkpoint_dir)
    remembered = [m for m in peerbook.load(book) if peerbook.peer_id_of(m) not in given]
    say = logging.getLogger("lowcomm.node")
    if not node.peers:
        if remembered:  # said first: an address that drops connections costs p2pd's start-up timeout
            say.info("looking for the swarm through the %d peer(s) this node saw on its last run (%s)",
                     len(remembered), book)
            try:
                dht = _start_dht_through(config, remembered, peers_source, retry=False)
                say.info("joined the swarm through the peers this node saw on its last run (%s)", book,
                         extra={"event": "joined_through_remembered_peers", "peers": len(remembered)})
                return dht
            except NoPeerAnswered:
                say.info("none of the %d peer(s) this node saw on its last run answered (%s); starting as the "
                         "first peer", len(remembered), book)
        return _start_dht_through(config, [], peers_source)
    try:
        return _start_dht_through(config, node.peers, peers_source)
    except NoPeerAnswered as err:
        if not remembered:
            raise
        say.warning("%s; trying the %d peer(s) this node saw on its last run (%s)", err, len(remembered), book,
                    extra={"event": "peers_did_not_answer"})
        try:
            return _start_dht_through(config, remembered, peers_source, retry=False)
        except NoPeerAnswered:
            raise RuntimeError(f"{err}; nor did any of the {len(remembered)} peer(s) this node saw on its last "
                               f"run ({book})") from None


def _start_dht_through(config: Config, peers: list[str], peers_source: str, retry: bool = True):
    """``start_dht`` with ``peers`` as the bootstrap peers; ``NoPeerAnswered`` when none answered
    (after the retries, with ``retry``), any other failure as the error the user reads."""
    from hivemind.dht.protocol import ValidationError
    from hivemind.p2p.p2p_daemon_bindings.utils import P2PDaemonError

    from .clock import ClockOffsetError
    from .dht import SupervisedDHT

    node = config.node
    host = node.host
    proto = "ip6" if ":" in host else "ip4"
    began = time.monotonic()
    pauses = BOOTSTRAP_RETRY_PAUSES if retry else ()
    try:
        for attempt, pause in enumerate((*pauses, None), start=1):
            try:
                dht = SupervisedDHT(
                    initial_peers=peers,
                    host_maddrs=[f"/{proto}/{host}/tcp/{node.dht_port}"],
                    identity_path=str(config.identity_path),
                    start=True,
                    max_clock_offset=node.max_clock_offset,
                )
                break
            except RuntimeError as err:
                if _UNANSWERED_PINGS not in str(err):
                    raise
                if pause is None:  # the DHT process has exited, and its p2pd with it
                    raise NoPeerAnswered(
                        f"none of the peers answered the DHT's ping in {attempt} tr{'y' if attempt == 1 else 'ies'} "
                        f"over {time.monotonic() - began:.0f} s: {' '.join(peers)}; they accept connections but "
                        f"may be overloaded, or run another DHT protocol: try again later or join through "
                        f"another peer") from None
                logging.getLogger("lowcomm.node").warning(
                    "none of the peers answered the DHT's ping (try %d of %d); trying again in %.0f s",
                    attempt, len(pauses) + 1, pause)
                _sleep(pause)
    except ClockOffsetError as err:
        raise RuntimeError(str(err)) from None
    except ValidationError as err:
        raise RuntimeError(_validation_message(err)) from None
    except P2PDaemonError as err:
        text = str(err)
        if "bootstrap" in text:
            raise NoPeerAnswered(
                f"none of the peers answered: {' '.join(peers)}; check the multiaddr "
                f"(it must end in /p2p/<peer id>) and that the peer is running and reachable"
            ) from None
        if "address already in use" in text:  # taken since _check_dht_address's probe
            raise UsageError(_busy_port_message("dht_port", host, node.dht_port)) from None
        if "is already taken by another peer" in text:  # hivemind found our peer id in the swarm
            raise RuntimeError(f"identity file {config.identity_path} is in use by another running node (a copied "
                               f"checkpoint folder?): every node needs its own peer id; give this one another "
                               f"--identity or --checkpoint-dir (a new path makes a new key)") from None
        # p2pd read a file that is not a key: "proto: cannot parse ...", or for an empty file
        # "proto: required field crypto.pb.PrivateKey.Type not set".
        if "proto:" in text and config.identity_path.exists():
            said = re.sub(r"^.*\d\d:\d\d:\d\d ", "", text.splitlines()[0])  # drop p2pd's log time stamp
            raise RuntimeError(f"identity file {config.identity_path} is not a peer key (p2pd: {said}); point --identity at the key a node wrote, or at a "
                               f"new path to make one") from None
        raise RuntimeError(f"the DHT daemon failed to start: {text.splitlines()[0] if text else err}") from None
    except ValueError as err:  # malformed multiaddrs
        raise UsageError(f"{_invalid_multiaddr(peers_source)}: {err}") from None
    except OSError as err:  # the DHT process could not write the identity file (a race with the checks above)
        raise RuntimeError(f"cannot use identity file {config.identity_path}: {err}; choose another with "
                           f"--identity or --checkpoint-dir") from None
    dht.clock.log_offset()
    return dht


_PEERS_FLAG = "flag --peers"  # config.ConfigLayers' name of the flag as a source


def _invalid_multiaddr(source: str) -> str:
    """The start of a bad-multiaddr message, naming where the peers came from: ``--peers``, or
    the config file (variable, --set) and its key, which a ``--peers`` would send the user
    looking for on a command line that has none."""
    return "invalid --peers multiaddr" if source == _PEERS_FLAG else f"{source}: [node] peers: invalid multiaddr"


def _check_peer_multiaddrs(peers: list[str], source: str = _PEERS_FLAG) -> None:
    """Each ``--peers`` address parsed before p2pd starts: p2pd's refusal comes as "the DHT daemon
    failed to start" with its log time stamp, or as "invalid p2p multiaddr", naming neither the
    address nor the fix. ``source``: where the peers came from (config.ConfigLayers.sources)."""
    if not peers:
        return
    from hivemind.utils.multiaddr import Multiaddr
    from hivemind.utils.multiaddr.exceptions import Error as MultiaddrError

    fix = "copy the whole address the first peer printed after `--peers`"
    invalid = _invalid_multiaddr(source)
    for maddr in peers:
        if not maddr.strip():  # `--peers ""` (an unset shell variable): the message showed no address at all
            raise UsageError(f"{invalid}: an empty address; {fix}, or leave it out to start a new swarm")
        if "/p2p/" not in maddr:
            raise UsageError(f"{invalid} {maddr}: it must end in /p2p/<peer id>; {fix}")
        try:
            Multiaddr(maddr)
        except (MultiaddrError, ValueError) as err:
            # "Invalid MultiAddr '<maddr>' protocol ip4: base address '1.2.3' is not IPv4": keep the why.
            why = str(err).split(f"{maddr}' ", 1)[-1]
            if why.startswith("protocol p2p"):  # "Inconsistent multihash length ...": say what it means
                why = f"{maddr.split('/p2p/')[1].split('/')[0]!r} is not a peer id ({why})"
            raise UsageError(f"{invalid} {maddr}: {why}; {fix}") from None


def _check_identity_path(path: Path) -> None:
    """Refuse an identity path hivemind could not read or create, before its DHT process forks
    (there its OSError would reach the user as a traceback)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise RuntimeError(f"cannot create the folder of identity file {path}: {err.strerror}; choose another "
                           f"with --identity or --checkpoint-dir") from None
    if path.exists() and not path.is_file():
        raise RuntimeError(f"identity file {path} is not a file; choose another with --identity")
    if not path.exists() and not os.access(path.parent, os.W_OK):
        raise RuntimeError(f"cannot create identity file {path}: its folder is not writable; choose another "
                           f"with --identity or --checkpoint-dir")


def _check_dht_address(host: str, port: int) -> None:
    """Refuse a --host that is not this machine's and a DHT port another process listens on.

    p2pd listens with SO_REUSEPORT, so a second node on the port of a running one (or of any
    listener that set it) does not fail: both p2pd share the port, and a peer dialling its
    multiaddr reaches either at random. A plain bind fails on a port anyone listens on
    (SO_REUSEADDR only lets it reuse connections in TIME_WAIT that a stopped node left). A
    foreign address would fail in p2pd too, but its message is a Go log line.
    """
    from lowcomm.protocol.bindprobe import bind_probe_error

    err = bind_probe_error(host, port)
    if err is None:
        return
    if err.errno == errno.EADDRNOTAVAIL:
        raise UsageError(_foreign_host_message(host, err))
    if err.errno == errno.EADDRINUSE and port != 0:
        raise UsageError(_busy_port_message("dht_port", host, port))
    # Another problem: p2pd's own message names it.


# The node's listening ports (config keys) and the servers they belong to, for the messages.
_PORT_SERVERS = {"dht_port": "DHT", "grpc_port": "gRPC", "metrics_port": "metrics"}


def _port_flag(key: str) -> str:
    """How to set the port ``key``: ``--grpc-port (or LOWCOMM_GRPC_PORT)``."""
    return f"--{key.replace('_', '-')} (or LOWCOMM_{key.upper()})"


def _foreign_host_message(host: str, err: OSError) -> str:
    return (f"--host {host} is not an address of this machine ({err.strerror}): give one of its own, or 0.0.0.0 "
            f"for every interface (--announce-host sets the address peers are told)")


def _busy_port_message(key: str, host: str, port: int) -> str:
    return (f"{_PORT_SERVERS[key]} port {port} on {host} is already in use by another process; choose another "
            f"with {_port_flag(key)}, or 0 for any free port")


def check_ports(node: NodeSection) -> None:
    """Refuse, before anything starts, a port of the node's servers (DHT, gRPC, metrics) that another
    process listens on: gRPC's and the metrics server's own binds came only after the DHT's start
    (12 s on a loaded machine). A UsageError: the port is the user's to change. The probe binds as
    the servers do (protocol/bindprobe.py: address reuse, no port sharing; prometheus_client's HTTP
    server reuses addresses too), so what it refuses they would; a port taken between the probe and
    the server's bind is still named there (node/daemon.py). One port given to two servers is a
    config error already (NodeSection). A --host that is not this machine's is refused here too,
    whatever the ports (it was exit 1, after the checkpoint folder was locked). start_dht checks the
    host and DHT port again for lowcomm.Swarm, which starts its DHT without this check."""
    from lowcomm.protocol.bindprobe import bind_probe_error

    _check_dht_address(node.host, node.dht_port)  # the host, and the DHT's port as p2pd would take it
    for key in ("grpc_port", "metrics_port"):
        port = getattr(node, key)
        if port == 0:  # any free port: never busy
            continue
        err = bind_probe_error(node.host, port)
        if err is not None and err.errno == errno.EADDRINUSE:
            raise UsageError(_busy_port_message(key, node.host, port))


def check_run_files(config: Config) -> None:
    """Read what the run config names in files before anything starts (the checkpoint folder, the
    DHT): a tokenizer.json the tokenizers library cannot read, or a Hugging Face model whose
    positions are fewer than [data] seq_len, were found only as the node built its fingerprint and
    model after the DHT's start, and ended it with code 1 as if the node had failed. Raises
    FormatError or ModelError. The model is not built here (node/models/hf.py check_seq_len): that
    would start torch's threads before the DHT process is forked."""
    if config.data.tokenizer != "bytes":
        from .formats import tokenizer_definition

        tokenizer_definition(config.data.tokenizer)  # cached: the fingerprint reads it again for free
    if config.model.kind in ("hf_config", "hf_pretrained"):
        from .models.hf import check_seq_len

        check_seq_len(config.model, config.data.seq_len)


def _read_file(path: Path, what: str) -> bytes:
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise RuntimeError(f"{what} {path} does not exist") from None
    except OSError as err:
        raise RuntimeError(f"{what} {path} is not readable: {err.strerror}") from None
    if not data.strip():
        raise RuntimeError(f"{what} {path} is empty")
    return data


def _read_tls(cert: Path | None, key: Path | None):
    from lowcomm.protocol.auth import TLSConfig

    try:
        return TLSConfig.from_pem(_read_file(cert, "TLS certificate"), key and _read_file(key, "TLS key"))
    except ValueError as err:
        raise RuntimeError(f"{err} ({cert}{f', {key}' if key else ''})") from None


def read_credentials(node: NodeSection):
    """(run secret or None, TLSConfig or None) from the files the config names; RuntimeError with one line."""
    from lowcomm.protocol.auth import parse_secret

    secret = None
    if node.run_secret_file is not None:
        data = _read_file(node.run_secret_file, "run secret file")
        try:
            secret = parse_secret(data)
        except ValueError as err:
            raise RuntimeError(f"run secret file {node.run_secret_file} {err}") from None
    if (node.tls_cert is None) != (node.tls_key is None):
        raise RuntimeError("--tls-cert and --tls-key go together (LOWCOMM_TLS_CERT, LOWCOMM_TLS_KEY)")
    tls = _read_tls(node.tls_cert, node.tls_key) if node.tls_cert is not None else None
    return secret, tls


def _client_tls(args: argparse.Namespace):
    """TLS of `status`/`healthcheck`: trust --tls-cert (or LOWCOMM_TLS_CERT) when given."""
    cert = args.tls_cert or os.environ.get("LOWCOMM_TLS_CERT")
    return _read_tls(Path(cert), None) if cert else None


def cmd_join(args: argparse.Namespace) -> int:
    # gRPC's C core writes INFO lines of its own ("Got goaway ... ping_timeout" when a peer's link
    # stalls) into the node's output, between its JSON lines; its errors still show. It reads the
    # variable when grpc is first imported, below. A GRPC_VERBOSITY of the user's is kept.
    os.environ.setdefault("GRPC_VERBOSITY", "ERROR")
    try:
        layers = read_layers(args.config, _join_flags(args), args.overrides)
        config = validate_layers(layers)
        # Before anything starts: a malformed multiaddr is a usage error like a bad key.
        _check_peer_multiaddrs(config.node.peers, layers.sources.get(("node", "peers"), _PEERS_FLAG))
    except (ConfigError, UsageError) as err:
        return _fail(str(err), EXIT_USAGE)
    try:
        run_secret, tls = read_credentials(config.node)
        check_ports(config.node)  # before the checkpoint folder is made and the DHT starts
    except RuntimeError as err:
        return _fail(str(err), EXIT_USAGE)

    from .errors import FatalError, SettingError

    if config.node.device == "cuda":  # before the DHT starts and the checkpoint folder is made
        from .trainer import pick_device

        try:
            pick_device("cuda")
        except FatalError as err:
            return _fail(str(err))
    from .logs import setup_logging

    human = setup_logging(config.node.log_format, config.node.log_level)
    from .data import DataError
    from .formats import FormatError
    from .models import ModelError

    try:
        check_run_files(config)  # before the checkpoint folder is made and the DHT starts
    except (FormatError, ModelError) as err:
        return _fail(str(err), EXIT_USAGE)

    directory = config.node.checkpoint_dir
    made_from = first_missing(directory)  # the folder this start makes (None: it exists)
    try:
        lock = lock_checkpoint_dir(directory)
    except RuntimeError as err:
        remove_if_never_used(directory, made_from)
        return _fail(str(err))
    from .memory import freeze_before_fork, limit_malloc_arenas, share_tensors_by_descriptor

    limit_malloc_arenas()  # before the DHT forks and any thread allocates (node/memory.py)
    share_tensors_by_descriptor()  # before hivemind's first future: no torch_shm_manager process
    freeze_before_fork()
    try:
        dht = start_dht(config, layers.sources)
    except RuntimeError as err:
        lock.close()
        remove_if_never_used(directory, made_from)
        return _fail(str(err), EXIT_USAGE if isinstance(err, UsageError) else EXIT_FAILURE)
    failed = True
    try:
        import uvloop

        from .daemon import Node

        try:
            code = uvloop.run(Node(config, dht, human, run_secret, tls).run())
            failed = code != 0
            return code
        # The config names what cannot be used (--data, a model that does not build, a port taken
        # since check_ports): the user's to change, a usage error.
        except (DataError, FormatError, ModelError, SettingError) as err:
            return _fail(str(err), EXIT_USAGE)
        except FatalError as err:
            return _fail(str(err))
        except (MemoryError, RuntimeError) as err:
            # A batch, a sequence or a model larger than this machine's memory (numpy's or torch's
            # allocation, on the CPU or the GPU) ended the node with a traceback: the settings to lower.
            if not _out_of_memory(err):
                raise
            return _fail(_out_of_memory_message(err, config), EXIT_USAGE)
    finally:
        dht.shutdown()
        lock.close()
        if failed:
            remove_if_never_used(directory, made_from)


def _out_of_memory(err: BaseException) -> bool:
    """Whether ``err`` is an allocation that failed: numpy's MemoryError, torch's OutOfMemoryError
    (CUDA), or the RuntimeError of torch's CPU allocator ("DefaultCPUAllocator: can't allocate memory")."""
    if isinstance(err, MemoryError):
        return True
    import torch

    return isinstance(err, torch.OutOfMemoryError) or "DefaultCPUAllocator: can't allocate memory" in str(err)


def _out_of_memory_message(err: BaseException, config: Config) -> str:
    said = str(err).splitlines()[0] if str(err) else type(err).__name__
    if "DefaultCPUAllocator" in said:  # after torch's C++ location and assertion, before errno's words
        said = said[said.index("DefaultCPUAllocator"):].split(". Error code")[0]
    train, data = config.train, config.data
    return (f"out of memory with [train] batch_size = {train.batch_size}, micro_batches = {train.micro_batches} "
            f"and [data] seq_len = {data.seq_len} ({said.rstrip('.')}): lower batch_size (and raise micro_batches "
            f"to keep batch_size × micro_batches sequences per inner step), lower seq_len, or choose a smaller model")


# -- status and healthcheck ------------------------------------------------------------------------


def status_dict(status) -> dict[str, Any]:
    """A NodeStatus message as the JSON dict `lowcomm-node status` prints (and lowcomm.Swarm.status returns)."""
    def number(value: float) -> float | None:
        return None if math.isnan(value) else value

    return {
        "peer_id": status.peer_id,
        "outer_step": status.outer_step,
        "params_sha256": status.params_sha256,
        "swarm_peers": status.swarm_peers,
        "swarm_outer_step_max": status.swarm_outer_step_max,
        "phase": status.phase,
        "loss": number(status.loss),
        "eval_loss": number(status.eval_loss),
        "tokens_total": status.tokens_total,
        "tokens_per_second": status.tokens_per_second,
        "rounds_completed": status.rounds_completed,
        "codec": status.codec,
        "mode": status.mode,
        "version": status.version,
        "multiaddrs": list(status.multiaddrs),
        "checkpoint_failure": ({"outer_step": status.checkpoint_failed_step, "reason": status.checkpoint_failure}
                               if status.checkpoint_failure else None),
        "unreachable": status.unreachable or None,
        "swarm": [
            {"peer_id": p.peer_id, "address": p.address, "outer_step": p.outer_step,
             "params_sha256": p.params_sha256, "tokens_per_second": p.tokens_per_second,
             "client_mode": p.client_mode, "bandwidth_bps": p.bandwidth_bps}
            for p in status.swarm
        ],
    }


def _print_status(info: dict[str, Any]) -> None:
    def fmt(value: float | None) -> str:
        return "-" if value is None else f"{value:.3f}"

    print(f"node      {info['peer_id']}  ({info['phase']}, lowcomm {info['version']}, {info['mode']}/{info['codec']})")
    print(f"step      {info['outer_step']}  (swarm max {info['swarm_outer_step_max']})  params {info['params_sha256'][:16]}")
    print(f"loss      train {fmt(info['loss'])}  eval {fmt(info['eval_loss'])}  "
          f"tokens {info['tokens_total']:,}  {info['tokens_per_second']:,.0f} tok/s")
    failure = info["checkpoint_failure"]
    if failure is not None:
        print(f"checkpoint NOT WRITTEN at step {failure['outer_step']}: {failure['reason']}")
    if info["unreachable"]:
        print(f"gRPC      NOT REACHABLE by peers at {info['unreachable']}")
    print(f"swarm     {info['swarm_peers']} peer(s)")
    top = info["swarm_outer_step_max"]
    for peer in info["swarm"]:
        kind = "client" if peer["client_mode"] else peer["address"]
        lag = top - peer["outer_step"]
        print(f"  {peer['peer_id'][-12:]}  step {peer['outer_step']:>5} (lag {lag})  "
              f"{peer['tokens_per_second']:>9,.0f} tok/s  {kind}")


def cmd_status(args: argparse.Namespace) -> int:
    from .grpc_hints import quiet_grpc, unreachable_hint

    quiet_grpc()
    import grpc

    from lowcomm.protocol.channels import fetch_status

    try:
        tls = _client_tls(args)
        status = asyncio.run(fetch_status(args.target, args.timeout, tls))
    except RuntimeError as err:
        return _fail(str(err), EXIT_USAGE)
    except grpc.aio.AioRpcError as err:
        failure = f"{err.code().name} {err.details() or ''}".rstrip()
        hint = unreachable_hint(err, args.target, tls, args.timeout)
        return _fail(f"no node answered at {args.target}: {hint} ({failure})" if hint
                     else f"no node answered at {args.target}: {failure}")
    info = status_dict(status)
    if args.json:
        print(json.dumps(info, indent=2))
    else:
        _print_status(info)
    return 0


def cmd_healthcheck(args: argparse.Namespace) -> int:
    from .grpc_hints import quiet_grpc, unreachable_hint

    quiet_grpc()
    import grpc

    from lowcomm.protocol.channels import check_health

    try:
        tls = _client_tls(args)
        state = asyncio.run(check_health(args.target, args.timeout, tls))
    except RuntimeError as err:
        return _fail(str(err), EXIT_USAGE)
    except grpc.aio.AioRpcError as err:
        hint = unreachable_hint(err, args.target, tls, args.timeout)
        return _fail(f"unhealthy: no node answered at {args.target}{f': {hint}' if hint else ''} "
                     f"({err.code().name})")
    if state != "SERVING":
        return _fail(f"unhealthy: {args.target} reports {state}")
    print(f"{args.target}: {state}")
    return 0


# -- init-config ---------------------------------------------------------------------------------


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    if isinstance(value, dict):  # an inline table, e.g. [sync] state_sync
        return "{" + ", ".join(f"{k} = {_toml_value(v)}" for k, v in value.items()) + "}"
    return json.dumps(str(value))


def render_default_config() -> str:
    """The default config as commented TOML; [node] keys are commented out (usually flags)."""
    lines = [
        "# lowcomm run config. Every peer of a run must use the same [run], [model], [data] seq_len and",
        "# tokenizer, [train] and [sync] values (peers compare a fingerprint of them before averaging).",
        "# Precedence: defaults < this file < LOWCOMM_* environment variables < command-line flags.",
    ]
    defaults = Config()
    for section, field in Config.model_fields.items():
        model = getattr(defaults, section)
        lines.append("")
        if section == "node":
            lines.append("# Node-local settings: each is also a `join` flag and a LOWCOMM_<KEY> variable.")
        lines.append(f"[{section}]")
        for key, info in type(model).model_fields.items():
            if info.description:
                lines.append(f"# {info.description}".replace("\n", "\n# "))
            value = getattr(model, key)
            prefix = "# " if section == "node" else ""
            if value is None:
                lines.append(f"# {key} = ...")
            else:
                lines.append(f"{prefix}{key} = {_toml_value(value)}")
    return "\n".join(lines) + "\n"


def cmd_init_config(args: argparse.Namespace) -> int:
    try:
        print(render_default_config(), end="")
        sys.stdout.flush()
    except BrokenPipeError:
        raise  # a reader that stopped early: main ends quietly
    except OSError as err:
        # `init-config > run.toml` on a full disk was a traceback, and another at exit (the flush).
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return _fail(f"could not write the config to standard output: {err.strerror or err}; the file it went "
                     f"to is incomplete: free space there, or write it elsewhere")
    return 0


# -- entry point ---------------------------------------------------------------------------------


def default_target(environ: Mapping[str, str]) -> str:
    """Where `status` and `healthcheck` look by default: the node that ``LOWCOMM_HOST`` and
    ``LOWCOMM_GRPC_PORT`` configure in this environment (a container's health check, a shell that
    exported them), on loopback where it listens on every interface."""
    host = environ.get("LOWCOMM_HOST", "").strip() or "127.0.0.1"
    host = {"0.0.0.0": "127.0.0.1", "::": "::1"}.get(host, host)
    port = environ.get("LOWCOMM_GRPC_PORT", "").strip()
    if not (port.isdigit() and 1 <= int(port) <= 65535):  # unset, or 0 (any free port): not knowable here
        port = "7701"
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def grpc_target(value: str) -> str:
    """``--target`` as HOST:PORT (an IPv6 host in brackets). gRPC would take a missing port as
    443 and a port above 65535 modulo 65536, and then report a refused connection elsewhere."""
    if "://" in value:  # http://127.0.0.1:7701 passed the check below and then failed to resolve
        raise argparse.ArgumentTypeError(f"{value!r}: give HOST:PORT without a scheme (e.g. 127.0.0.1:7701); "
                                         "the port is the node's --grpc-port")
    host, sep, port = value.rpartition(":")
    if not sep or not host or host.endswith(":") and not host.startswith("["):
        raise argparse.ArgumentTypeError(f"{value!r} is not HOST:PORT (e.g. 127.0.0.1:7701, [::1]:7701); "
                                         "the port is the node's --grpc-port")
    if not port.isdigit() or not 1 <= int(port) <= 65535:
        raise argparse.ArgumentTypeError(f"{value!r}: the port must be a number from 1 to 65535 (the node's "
                                         "--grpc-port)")
    if ":" in host and not (host.startswith("[") and host.endswith("]")):
        # ::1:7701 reached gRPC as host "::1" and failed as "Misformatted domain name".
        raise argparse.ArgumentTypeError(f"{value!r}: write an IPv6 address in brackets, as [{host.strip('[]')}]:"
                                         f"{port}")
    return value


def seconds(value: str) -> float:
    """``--timeout``: a finite number of seconds above 0 (a negative one failed at once with a
    misleading "no node answered")."""
    try:
        number = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is not a number of seconds") from None
    if not (0 < number < float("inf")):
        raise argparse.ArgumentTypeError(f"must be a number of seconds above 0, got {value}")
    return number


def _describes_the_model(args: argparse.Namespace) -> bool:
    """Whether export's --config or --set say which model to build; otherwise a preset model is
    read from the checkpoint's own run config (node/export.py checkpoint_preset)."""
    return args.config is not None or any(
        item.partition("=")[0].strip().startswith(("model.", "data.")) for item in args.overrides)


def cmd_export(args: argparse.Namespace) -> int:
    flags = {"checkpoint_dir": args.checkpoint_dir} if args.checkpoint_dir is not None else {}
    try:
        config = load_config(args.config, flags, args.overrides)
    except ConfigError as err:
        return _fail(str(err), EXIT_USAGE)
    from .export import ExportError, export
    from .logs import setup_logging
    from .models import ModelError

    setup_logging(config.node.log_format, config.node.log_level, sys.stderr)  # a damaged checkpoint skipped: a warning
    try:
        done = export(config, args.out, model_given=_describes_the_model(args))
    except (ExportError, ModelError) as err:
        return _fail(str(err))
    print(f"exported outer step {done.outer_step} (params {done.params_sha256[:12]}) from {done.checkpoint} "
          f"to {done.out}; load {done.weights}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="lowcomm-node", description="Peer-to-peer low-communication training node.")
    parser.add_argument("--version", action="version", version=f"lowcomm {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    join = sub.add_parser("join", help="join (or start) a swarm and train")
    _add_join_flags(join)
    join.set_defaults(func=cmd_join)
    for name, func, help_text in (("status", cmd_status, "show a running node and its swarm"),
                                  ("healthcheck", cmd_healthcheck, "exit 0 if the node at --target is serving")):
        p = sub.add_parser(name, help=help_text)
        p.add_argument("--target", type=grpc_target, default=default_target(os.environ), metavar="HOST:PORT",
                       help="the node's gRPC address: its --grpc-port (default: %(default)s, from LOWCOMM_HOST and "
                            "LOWCOMM_GRPC_PORT where they are set, as for the node)")
        p.add_argument("--timeout", type=seconds, default=5.0, help="seconds to wait for an answer")
        p.add_argument("--tls-cert", metavar="PEM", help="the node serves TLS: trust this certificate "
                                                         "(default: LOWCOMM_TLS_CERT if set)")
        if name == "status":
            p.add_argument("--json", action="store_true", help="machine-readable output")
        p.set_defaults(func=func)
    export = sub.add_parser("export", help="write the newest checkpoint's model as a Hugging Face folder or state_dict",
                            description="Write θ_global of the newest checkpoint in --checkpoint-dir as the run's model: "
                                        "a save_pretrained folder for Hugging Face models, model.pt (a state_dict) "
                                        "otherwise, with lowcomm.json (step, params hash). Give the run config the "
                                        "node ran with (a preset model with the byte tokenizer is read from the "
                                        "checkpoint); a running node's checkpoints can be exported.")
    export.add_argument("--out", type=Path, required=True, metavar="DIR", help="new folder to write (must not exist, or be empty)")
    export.add_argument("--config", type=Path, metavar="FILE", help="the run config TOML the node ran with")
    export.add_argument("--checkpoint-dir", type=Path, metavar="DIR",
                        help="the node's checkpoint directory (default: the config's [node] checkpoint_dir, "
                             "LOWCOMM_CHECKPOINT_DIR, or ./lowcomm-checkpoints)")
    export.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                        help="a run-config key the node was given with --set (repeatable)")
    export.set_defaults(func=cmd_export)
    init = sub.add_parser("init-config", help="print a commented default run config")
    init.set_defaults(func=cmd_init_config)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        code = args.func(args)
        sys.stdout.flush()  # here, where a reader that stopped early is caught, not at exit
        return code
    except BrokenPipeError:
        # The reader of our output stopped early (`lowcomm-node status | head -2`): end quietly as
        # Unix tools do (a traceback said so before). stdout goes to /dev/null so that the
        # interpreter's own flush at exit does not raise again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_BROKEN_PIPE
    except KeyboardInterrupt:
        # A Ctrl-C before the node takes its signals (while torch imports, the first second)
        # ends the program as Unix programs do, without the INFO lines that libraries log at
        # exit: torch's "FakeTensor cache stats", whose log levels an import cut short left unset.
        logging.disable(logging.INFO)
        return 130


if __name__ == "__main__":
    sys.exit(main())
