"""Who may speak: the run secret (HMAC tokens on RPCs, signed DHT records) and optional TLS.

Two keys are derived from the shared secret (RPC tokens, DHT records), so that a value signed
for one purpose never verifies for the other.

**RPC tokens.** Every call carries metadata ``lowcomm-auth: v1:<peer>:<step>:<ms>:<nonce>:<mac>``,
``mac = HMAC-SHA256(rpc key, method, peer id, outer step, wall-clock ms, 16 random bytes)``. The
server answers ``UNAUTHENTICATED`` to a call without a token, with a bad MAC (no or another
secret), with a timestamp more than ``skew`` seconds off its clock, or with a nonce it accepted
before (remembered until the token would fail the clock check anyway: bounded memory). Where a
request names its sender (a ``Hello``, a Reduce header), it must be the token's peer id. Health
and ``NodeInfo/GetStatus`` stay open for ``healthcheck`` and ``status``. A token is not bound to
the server it is sent to: within the window, one seen by a server could be replayed once to
another, for the same method; with TLS nobody outside the run sees tokens.

**DHT records.** Stored values carry ``_exp`` (wall-clock expiry, ms) and ``_mac`` (over key,
subkey, expiry and the canonical JSON of the value); readers drop values without a valid MAC or
past expiry plus skew: a stranger can neither register in a round nor pose as a peer, and a
copied record stops verifying soon after its owner stops refreshing it.

**TLS** (optional, independent of the secret). The server presents ``--tls-cert``/``--tls-key``;
client channels trust the same PEM file as root. So a run shares one self-signed certificate, or
each peer's PEM file holds its own certificate followed by the run's CA. Peers dial IP addresses,
so the name checked is the certificate's first DNS name (else IP, else common name): all
certificates of a run carry that name. All peers of a run use TLS, or none does.
"""

from __future__ import annotations

import hashlib
import heapq
import hmac
import json
import logging
import os
import time
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, Iterable

import grpc

log = logging.getLogger(__name__)

TOKEN_KEY = "lowcomm-auth"  # gRPC metadata key of the token
TOKEN_VERSION = "v1"
DEFAULT_SKEW = 60.0  # seconds a token's timestamp may differ from the server's clock
MIN_SECRET_BYTES = 16
# Reachable without the secret: liveness and status probes reveal nothing the open DHT does not.
OPEN_METHODS = frozenset({
    "/grpc.health.v1.Health/Check", "/grpc.health.v1.Health/Watch", "/lowcomm.v1.NodeInfo/GetStatus",
})
RejectCallback = Callable[[str, str, str], None]  # (reason, claimed sender, detail), as ReduceRegistry's


class AuthError(Exception):
    """A token or record that does not prove knowledge of the run secret."""

    def __init__(self, message: str, sender: str = "?") -> None:
        super().__init__(message)
        self.sender = sender  # the peer id the token claims (unverified), "?" if none


def parse_secret(data: bytes) -> bytes:
    """The run secret held in a file's bytes (surrounding whitespace removed); ValueError if unusable."""
    secret = data.strip()
    if not secret:
        raise ValueError("is empty")
    if len(secret) < MIN_SECRET_BYTES:
        raise ValueError(f"holds {len(secret)} bytes, fewer than {MIN_SECRET_BYTES}; "
                         f"make one with: head -c 32 /dev/urandom | base64 > run.secret")
    return secret


@dataclass(frozen=True)
class Claims:
    """What a verified token says about its caller."""

    peer_id: str
    step: int
    timestamp: float


class ReplayCache:
    """Nonces of accepted tokens, each kept until its token would fail the clock check anyway.

    At most ``max_entries`` nonces (a dict and a heap entry each, ~200 bytes). When it is full the
    nonce closest to expiring is forgotten early, and from then on every token that expires no
    later than it is refused too: a forgotten nonce can never be replayed, at the price of
    refusing a few genuine tokens near the end of their window while the run's own load exceeds
    what the cache holds (only authentic tokens get here).
    """

    def __init__(self, max_entries: int = 100_000) -> None:
        if max_entries < 1:
            raise ValueError("a replay cache needs room for at least one nonce")
        self.max_entries = max_entries
        self._expiry: dict[str, float] = {}
        self._heap: list[tuple[float, str]] = []
        self.floor = -float("inf")  # tokens expiring at or before it are refused (see above)
        self._warned = False

    def __len__(self) -> int:
        return len(self._expiry)

    def __bool__(self) -> bool:
        return True  # an empty cache is still a cache (``replay_cache or ReplayCache()`` must keep it)

    def add(self, nonce: str, expires: float, now: float) -> bool:
        """Remember ``nonce`` until ``expires``; False when it was seen (and is still remembered),
        or could have been seen and forgotten early (it expires no later than ``floor``)."""
        while self._heap and self._heap[0][0] < now:
            _, old = heapq.heappop(self._heap)
            self._expiry.pop(old, None)
        if nonce in self._expiry or expires <= self.floor:
            return False
        if len(self._expiry) < self.max_entries // 2:
            self._warned = False
        if len(self._expiry) >= self.max_entries:
            old_expiry, old = heapq.heappop(self._heap)
            self._expiry.pop(old, None)
            self.floor = max(self.floor, old_expiry)
            if not self._warned:  # once per overload, not once per token
                self._warned = True
                log.warning("replay cache full (%d nonces): forgetting the oldest early and refusing tokens "
                            "that expire before them", self.max_entries)
        self._expiry[nonce] = expires
        heapq.heappush(self._heap, (expires, nonce))
        return True


def _canonical(value: Any) -> bytes:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), default=str).encode()


class RunAuth:
    """The run secret's keys: mints and checks RPC tokens, signs and checks DHT record values.

    ``clock``: wall-clock seconds as every peer of the run reads them. The node passes its swarm
    time (its clock corrected by the offset measured from its bootstrap peers, node/clock.py), so
    a volunteer whose clock is minutes off still mints tokens inside ``skew``.
    """

    def __init__(self, secret: bytes, skew: float = DEFAULT_SKEW, clock: Callable[[], float] = time.time,
                 replay_cache: ReplayCache | None = None) -> None:
        if not secret:
            raise ValueError("the run secret is empty")
        self._rpc_key = hmac.new(secret, b"lowcomm rpc token v1", hashlib.sha256).digest()
        self._dht_key = hmac.new(secret, b"lowcomm dht record v1", hashlib.sha256).digest()
        self.skew = skew
        self.clock = clock
        self.replays = replay_cache or ReplayCache()

    # -- RPC tokens -----------------------------------------------------------------------------

    def _token_mac(self, method: str, peer_id: str, step: int, millis: int, nonce: str) -> str:
        message = "\0".join((method, peer_id, str(step), str(millis), nonce)).encode()
        return hmac.new(self._rpc_key, message, hashlib.sha256).hexdigest()

    def mint(self, method: str, peer_id: str, step: int) -> str:
        millis = int(self.clock() * 1000)
        nonce = os.urandom(16).hex()
        mac = self._token_mac(method, peer_id, step, millis, nonce)
        return f"{TOKEN_VERSION}:{peer_id}:{step}:{millis}:{nonce}:{mac}"

    def verify(self, token: str | bytes | None, method: str) -> Claims:
        """The claims of a valid, fresh, never-seen token for ``method``; AuthError otherwise."""
        if not token:
            raise AuthError("no run-secret token (this run requires --run-secret-file)")
        if isinstance(token, bytes):
            token = token.decode("ascii", "replace")
        version, _, rest = token.partition(":")
        fields = rest.rsplit(":", 4)  # a peer id may contain ':' (never the other fields)
        if version != TOKEN_VERSION or len(fields) != 5:
            raise AuthError("malformed run-secret token")
        peer_id, step_text, millis_text, nonce, mac = fields
        try:
            step, millis = int(step_text), int(millis_text)
        except ValueError:
            raise AuthError("malformed run-secret token", peer_id or "?") from None
        if len(nonce) != 32 or not hmac.compare_digest(mac, self._token_mac(method, peer_id, step, millis, nonce)):
            raise AuthError("token not signed with this run's secret (no or another --run-secret-file)", peer_id or "?")
        now = self.clock()
        timestamp = millis / 1000
        if abs(now - timestamp) > self.skew:
            raise AuthError(f"token timestamp {now - timestamp:+.0f}s off this node's clock "
                            f"(allowed: {self.skew:.0f}s); check the clocks", peer_id)
        if not self.replays.add(nonce, timestamp + self.skew, now):
            raise AuthError("replayed token (nonce already used)", peer_id)
        return Claims(peer_id, step, timestamp)

    # -- DHT records ----------------------------------------------------------------------------

    def _record_mac(self, key: str, subkey: str, expires_ms: int, value: dict) -> str:
        message = b"\0".join((key.encode(), subkey.encode(), str(expires_ms).encode(), _canonical(value)))
        return hmac.new(self._dht_key, message, hashlib.sha256).hexdigest()

    def sign_record(self, key: str, subkey: str, value: dict, ttl: float) -> dict:
        """``value`` with ``_exp`` and ``_mac`` added, for storing under ``key``/``subkey``."""
        plain = {k: v for k, v in value.items() if k not in ("_exp", "_mac")}
        expires_ms = int((self.clock() + ttl) * 1000)
        return {**plain, "_exp": expires_ms, "_mac": self._record_mac(key, subkey, expires_ms, plain)}

    @staticmethod
    def carries_signature(value: Any) -> bool:
        """Whether a stored value was signed by some run (rightly or not): an open run's are not."""
        return isinstance(value, dict) and "_mac" in value

    def verify_record(self, key: str, subkey: str, value: Any) -> dict | None:
        """The value without its signature fields if signed by this run and not expired, else None."""
        if not isinstance(value, dict):
            return None
        mac, expires_ms = value.get("_mac"), value.get("_exp")
        if not isinstance(mac, str) or not isinstance(expires_ms, int) or isinstance(expires_ms, bool):
            return None
        plain = {k: v for k, v in value.items() if k not in ("_exp", "_mac")}
        if not hmac.compare_digest(mac, self._record_mac(key, subkey, expires_ms, plain)):
            return None
        if expires_ms / 1000 + self.skew < self.clock():
            return None  # an old record replayed past its lifetime
        return plain


# -- server side ----------------------------------------------------------------------------------


def _metadata_value(metadata: Iterable[Any] | None, key: str) -> str | bytes | None:
    for item in metadata or ():
        k, v = item[0], item[1]
        if k == key:
            return v
    return None


def claimed_sender(message: Any) -> str | None:
    """The peer id a request names as its sender (``hello.peer_id``, a Reduce header or team
    header, or a ShardReport's ``sender_peer_id``), if any."""
    fields = getattr(getattr(message, "DESCRIPTOR", None), "fields_by_name", {})
    if "hello" in fields and message.HasField("hello"):
        return message.hello.peer_id
    if "sender_peer_id" in fields:  # a ShardReport
        return message.sender_peer_id
    for name in ("header", "team_header"):  # the first message of a Reduce stream
        if name in fields and message.HasField(name):
            header = getattr(message, name)
            if "sender_peer_id" in header.DESCRIPTOR.fields_by_name:
                return header.sender_peer_id
    return None


class _RateLimitedLog:
    """One warning per claimed sender at most every ``interval`` seconds, with the count in between."""

    def __init__(self, interval: float = 10.0) -> None:
        self.interval = interval
        self._last: dict[str, tuple[float, int]] = {}

    def __call__(self, sender: str, method: str, detail: str) -> None:
        now = time.monotonic()
        last, suppressed = self._last.get(sender, (-float("inf"), 0))
        if now - last < self.interval:
            self._last[sender] = (last, suppressed + 1)
            return
        if len(self._last) > 1024:  # bounded: forget everybody, at worst a few more lines
            self._last.clear()
        self._last[sender] = (now, 0)
        more = f" (+{suppressed} more refused since the last warning)" if suppressed else ""
        log.warning("refused an unauthenticated %s from claimed peer %s: %s%s", method, sender, detail, more,
                    extra={"event": "rpc_unauthenticated", "sender": sender, "method": method, "detail": detail})


class ServerAuthInterceptor(grpc.aio.ServerInterceptor):
    """Refuses every call outside ``open_methods`` that carries no valid token (``UNAUTHENTICATED``).

    ``on_reject(reason, claimed sender, detail)`` is called once per refused call (the node counts
    them); warnings are logged here, rate-limited per claimed sender.
    """

    reads_messages = True  # it checks the sender named in requests: they must arrive parsed (rpc.py)

    def __init__(self, auth: RunAuth, on_reject: RejectCallback | None = None,
                 open_methods: frozenset[str] = OPEN_METHODS) -> None:
        self.auth = auth
        self.on_reject = on_reject
        self.open_methods = open_methods
        self._log = _RateLimitedLog()

    def _reject(self, sender: str, method: str, detail: str) -> None:
        if self.on_reject is not None:
            self.on_reject("unauthenticated", sender, detail)
        self._log(sender, method, detail)

    async def intercept_service(
        self, continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        if handler is None or details.method in self.open_methods:
            return handler
        try:
            claims = self.auth.verify(_metadata_value(details.invocation_metadata, TOKEN_KEY), details.method)
        except AuthError as err:
            self._reject(err.sender, details.method, str(err))
            return _refusing(handler, str(err))
        return _bound_to_sender(handler, claims.peer_id, lambda s, d: self._reject(s, details.method, d))


async def _abort(context: grpc.aio.ServicerContext, detail: str) -> None:
    await context.abort(grpc.StatusCode.UNAUTHENTICATED, detail)


_KINDS = (  # (attribute, builder, streaming request, streaming response)
    ("unary_unary", grpc.unary_unary_rpc_method_handler, False, False),
    ("unary_stream", grpc.unary_stream_rpc_method_handler, False, True),
    ("stream_unary", grpc.stream_unary_rpc_method_handler, True, False),
    ("stream_stream", grpc.stream_stream_rpc_method_handler, True, True),
)


def _rebuild(handler: grpc.RpcMethodHandler, wrap: Callable[[Any, bool, bool], Any],
             request_deserializer: Any) -> grpc.RpcMethodHandler:
    for attr, build, stream_request, stream_response in _KINDS:
        behavior = getattr(handler, attr)
        if behavior:
            return build(wrap(behavior, stream_request, stream_response), request_deserializer=request_deserializer,
                         response_serializer=handler.response_serializer)
    return handler


def _refusing(handler: grpc.RpcMethodHandler, detail: str) -> grpc.RpcMethodHandler:
    """A handler of ``handler``'s kind that aborts at once (the request is never parsed)."""

    def wrap(_behavior: Any, _stream_request: bool, stream_response: bool) -> Any:
        if stream_response:  # streaming handlers must be async generators
            async def gen(request: Any, context: grpc.aio.ServicerContext) -> Any:
                await _abort(context, detail)
                yield  # pragma: no cover
            return gen

        async def call(request: Any, context: grpc.aio.ServicerContext) -> Any:
            await _abort(context, detail)
        return call

    return _rebuild(handler, wrap, None)


def _bound_to_sender(handler: grpc.RpcMethodHandler, peer_id: str,
                     reject: Callable[[str, str], None]) -> grpc.RpcMethodHandler:
    """``handler``, refusing requests that name another sender than the token's peer id."""

    async def check(message: Any, context: grpc.aio.ServicerContext) -> None:
        claimed = claimed_sender(message)
        if claimed is not None and claimed != peer_id:
            detail = f"request names sender {claimed!r} but the token is {peer_id!r}'s"
            reject(peer_id, detail)
            await _abort(context, detail)

    async def checked(request: Any, context: grpc.aio.ServicerContext, stream_request: bool) -> Any:
        if not stream_request:
            await check(request, context)
            return request

        async def iterate() -> Any:
            async for message in request:
                await check(message, context)
                yield message
        return iterate()

    def wrap(behavior: Any, stream_request: bool, stream_response: bool) -> Any:
        if stream_response:
            async def gen(request: Any, context: grpc.aio.ServicerContext) -> Any:
                async for item in behavior(await checked(request, context, stream_request), context):
                    yield item
            return gen

        async def call(request: Any, context: grpc.aio.ServicerContext) -> Any:
            return await behavior(await checked(request, context, stream_request), context)
        return call

    return _rebuild(handler, wrap, handler.request_deserializer)


# -- client side ----------------------------------------------------------------------------------


class _TokenInterceptor:
    def __init__(self, auth: RunAuth, peer_id: str, step: Callable[[], int]) -> None:
        self.auth = auth
        self.peer_id = peer_id
        self.step = step

    def _with_token(self, details: grpc.aio.ClientCallDetails) -> grpc.aio.ClientCallDetails:
        method = details.method.decode() if isinstance(details.method, bytes) else details.method
        token = self.auth.mint(method, self.peer_id, int(self.step()))
        metadata = grpc.aio.Metadata.from_tuple(tuple(details.metadata or ()) + ((TOKEN_KEY, token),))
        return details._replace(metadata=metadata)


class _UnaryUnary(_TokenInterceptor, grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(self, continuation, details, request):
        return await continuation(self._with_token(details), request)


class _UnaryStream(_TokenInterceptor, grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(self, continuation, details, request):
        return await continuation(self._with_token(details), request)


class _StreamUnary(_TokenInterceptor, grpc.aio.StreamUnaryClientInterceptor):
    async def intercept_stream_unary(self, continuation, details, request_iterator):
        return await continuation(self._with_token(details), request_iterator)


class _StreamStream(_TokenInterceptor, grpc.aio.StreamStreamClientInterceptor):
    async def intercept_stream_stream(self, continuation, details, request_iterator):
        return await continuation(self._with_token(details), request_iterator)


def client_interceptors(auth: RunAuth, peer_id: str, step: Callable[[], int]) -> list[grpc.aio.ClientInterceptor]:
    """Interceptors that add a fresh token (``step()`` read per call) to every call of a channel."""
    return [cls(auth, peer_id, step) for cls in (_UnaryUnary, _UnaryStream, _StreamUnary, _StreamStream)]


# -- TLS ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TLSConfig:
    """PEM certificate (chain) and, on a node that serves, its private key; see the module doc."""

    cert_chain: bytes
    private_key: bytes | None = None
    target_name: str | None = None  # the name client channels check (from the certificate)

    @classmethod
    def from_pem(cls, cert_chain: bytes, private_key: bytes | None = None) -> "TLSConfig":
        """Validated TLS material; ValueError with a readable message when it is not usable."""
        from cryptography import x509
        from cryptography.hazmat.primitives import serialization

        try:
            cert = x509.load_pem_x509_certificate(cert_chain)
        except ValueError:
            raise ValueError("the TLS certificate is not a PEM X.509 certificate") from None
        if private_key is not None:
            try:
                key = serialization.load_pem_private_key(private_key, password=None)
            except (ValueError, TypeError):
                raise ValueError("the TLS key is not an unencrypted PEM private key") from None
            public = serialization.PublicFormat.SubjectPublicKeyInfo
            if (key.public_key().public_bytes(serialization.Encoding.PEM, public)
                    != cert.public_key().public_bytes(serialization.Encoding.PEM, public)):
                raise ValueError("the TLS key does not belong to the certificate (the first one in the file)")
        return cls(cert_chain, private_key, _certificate_name(cert))

    def server_credentials(self) -> grpc.ServerCredentials:
        if self.private_key is None:
            raise ValueError("a TLS server needs the private key (--tls-key)")
        return grpc.ssl_server_credentials([(self.private_key, self.cert_chain)])

    def channel_credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(root_certificates=self.cert_chain)

    def channel_options(self) -> list[tuple[str, str]]:
        return [("grpc.ssl_target_name_override", self.target_name)] if self.target_name else []


def _certificate_name(cert: Any) -> str | None:
    from cryptography import x509

    try:
        names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        dns, ips = names.get_values_for_type(x509.DNSName), names.get_values_for_type(x509.IPAddress)
        if dns:
            return dns[0]
        if ips:
            return str(ips[0])
    except x509.ExtensionNotFound:
        pass
    common = cert.subject.get_attributes_for_oid(x509.NameOID.COMMON_NAME)
    return str(common[0].value) if common else None
