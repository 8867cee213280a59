"""Shared helpers for the tests of the observability assets (deploy/prometheus, deploy/grafana).

- ``promtool()`` / ``prometheus_binary()``: the path of Debian's binaries, or the calling test is
  skipped with the reason. The test session installs nothing: ``make test`` installs the package
  beforehand where it can (the Makefile's ``test-tools``).
- ``dashboard_queries(path)``: every panel target's PromQL with the dashboard variables substituted,
  ready to send to a real Prometheus.
- ``start_prometheus(...)`` / ``stop_prometheus(proc)``: a real Prometheus server on 127.0.0.1 with
  a free port, a temporary storage dir and a static scrape config; ``query(...)`` runs PromQL through
  its HTTP API with urllib.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any, Iterator

import pytest

REPO = Path(__file__).resolve().parents[1]
DEPLOY = REPO / "deploy"
PROMETHEUS_DIR = DEPLOY / "prometheus"
DASHBOARDS_DIR = DEPLOY / "grafana" / "dashboards"

def _binary(name: str) -> str:
    """Path of ``name`` (promtool or prometheus), or skip the calling test."""
    path = shutil.which(name)
    if path is None:
        pytest.skip(f"{name} is not installed: Debian package prometheus (`make test` installs it as root, "
                    "or apt-get install prometheus)")
    return path


def promtool() -> str:
    return _binary("promtool")


def prometheus_binary() -> str:
    return _binary("prometheus")


def run_promtool(*args: str, stdin: str | bytes | None = None, cwd: Path | None = None,
                 timeout: float = 60) -> subprocess.CompletedProcess[str]:
    """Run promtool; stdout and stderr are merged into ``.stdout`` (promtool prints findings to both)."""
    data = stdin.decode() if isinstance(stdin, bytes) else stdin
    return subprocess.run(
        [promtool(), *args], input=data, stdin=None if data is not None else subprocess.DEVNULL,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=cwd, timeout=timeout,
    )


# --- Grafana dashboards -----------------------------------------------------------------------

def iter_panels(dashboard: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """Every panel of a dashboard, rows included, descending into the panels of (collapsed) rows."""
    def walk(panels: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
        for panel in panels:
            yield panel
            yield from walk(panel.get("panels") or [])
    yield from walk(dashboard.get("panels") or [])


# Values for Grafana's macros when a query goes straight to Prometheus: every job and instance,
# and a rate window that covers several scrapes at the test's scrape interval.
MACRO_VALUES = {
    "job": ".*",
    "instance": ".*",
    "__rate_interval": "1m",
    "__interval": "15s",
    "__range": "1h",
    "__range_s": "3600",
    "__interval_ms": "15000",
    "__range_ms": "3600000",
}
_VARIABLE = re.compile(r"\$\{(\w+)(?::[^}]*)?\}|\[\[(\w+)(?::[^\]]*)?\]\]|\$([A-Za-z_]\w*)")


def substitute_variables(expr: str, values: dict[str, str] = MACRO_VALUES) -> str:
    """Replace ``$name``, ``${name}``, ``${name:fmt}`` and ``[[name]]`` by ``values[name]``.

    An unknown variable raises KeyError, so a dashboard cannot silently send Grafana syntax to
    Prometheus.
    """
    def replace(match: re.Match[str]) -> str:
        name = match.group(1) or match.group(2) or match.group(3)
        if name not in values:
            raise KeyError(f"no value for dashboard variable ${name} in {expr!r}")
        return values[name]
    return _VARIABLE.sub(replace, expr)


def dashboard_queries(path: str | os.PathLike[str]) -> list[tuple[str, str]]:
    """(panel title, PromQL) for every target of every panel, variables substituted."""
    dashboard = json.loads(Path(path).read_text())
    queries = []
    for panel in iter_panels(dashboard):
        for target in panel.get("targets") or []:
            expr = target.get("expr")
            if expr:
                queries.append((panel.get("title", ""), substitute_variables(expr)))
    return queries


# --- A real Prometheus server -----------------------------------------------------------------

def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(url: str, timeout: float = 5) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def start_prometheus(tmp_path: Path, scrape_targets: list[str], scrape_interval: str = "1s",
                     job: str = "lowcomm", ready_timeout_s: float = 30) -> tuple[subprocess.Popen[bytes], str]:
    """Start ``prometheus`` on 127.0.0.1:<free port> scraping ``scrape_targets`` ("host:port").

    A target written as ``"self"`` is the server's own address (it scrapes its own /metrics).
    Storage, config and log live under ``tmp_path``. Returns (process, base URL) once ``/-/ready``
    answers 200; always pair with ``stop_prometheus`` (a fixture finalizer).
    """
    binary = prometheus_binary()
    workdir = Path(tmp_path) / f"prometheus-{time.monotonic_ns()}"
    workdir.mkdir(parents=True)
    config_path = workdir / "prometheus.yml"
    last_log = ""
    for _attempt in range(3):  # the free port may be taken between probing and binding
        port = free_port()
        targets = [f"127.0.0.1:{port}" if t == "self" else t for t in scrape_targets]
        config = {
            "global": {"scrape_interval": scrape_interval, "scrape_timeout": scrape_interval,
                       "evaluation_interval": scrape_interval},
            "scrape_configs": [{"job_name": job, "static_configs": [{"targets": targets}]}],
        }
        config_path.write_text(json.dumps(config, indent=2))  # JSON is YAML
        log_path = workdir / f"prometheus-{port}.log"
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(
                [binary, f"--config.file={config_path}", f"--storage.tsdb.path={workdir / 'data'}",
                 f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn"],
                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, cwd=workdir,
            )
        base_url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + ready_timeout_s
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                status, _ = _get(f"{base_url}/-/ready", timeout=1)
                if status == 200:
                    return proc, base_url
            except OSError:
                pass
            time.sleep(0.1)  # polling interval, bounded by the deadline
        stop_prometheus(proc)
        last_log = log_path.read_text(errors="replace")[-2000:]
        if "address already in use" not in last_log:
            break
    raise RuntimeError(f"prometheus did not become ready within {ready_timeout_s} s; log:\n{last_log}")


def stop_prometheus(proc: subprocess.Popen[bytes], timeout_s: float = 10) -> None:
    """Stop a server from start_prometheus: SIGTERM, then SIGKILL; always reaps the process."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=timeout_s)


def query(base_url: str, expr: str, *, range_s: float | None = None, step: str = "1s") -> dict[str, Any]:
    """Run PromQL through the HTTP API (instant, or a range query over the last ``range_s`` s).

    Returns the decoded JSON body (``status``, ``data`` or ``error``); an invalid query gives
    ``status == "error"`` rather than an exception.
    """
    if range_s is None:
        url = f"{base_url}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
    else:
        end = time.time()
        url = f"{base_url}/api/v1/query_range?" + urllib.parse.urlencode(
            {"query": expr, "start": f"{end - range_s:.3f}", "end": f"{end:.3f}", "step": step})
    _, body = _get(url)
    return json.loads(body)


def wait_for_query(base_url: str, expr: str, predicate, timeout_s: float = 30) -> dict[str, Any]:
    """Poll an instant query until ``predicate(result_list)`` holds; raises TimeoutError after the deadline."""
    deadline = time.monotonic() + timeout_s
    last: dict[str, Any] = {}
    while time.monotonic() < deadline:
        last = query(base_url, expr)
        if last.get("status") == "success" and predicate(last["data"]["result"]):
            return last
        time.sleep(0.2)  # polling interval, bounded by the deadline
    raise TimeoutError(f"{expr!r} did not satisfy the condition within {timeout_s} s; last answer: {last}")
