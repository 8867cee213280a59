"""The Prometheus side of issue #4, checked with Debian's promtool and a real Prometheus server:

- deploy/prometheus/prometheus.yml passes ``promtool check config``, in the repository and laid out
  as the compose file mounts it (/etc/prometheus/);
- the rule files pass ``promtool check rules`` and their unit tests (``promtool test rules``), which
  cover every alert with a firing and a silent case;
- the exposition of a NodeMetrics passes ``promtool check metrics`` with no finding at all;
- tests/promtool_util.py can start and stop a real server and query it; every dashboard query is
  valid PromQL for that server.

Without Debian's prometheus package (``make test`` installs it as root) these tests skip and say so.
"""

from __future__ import annotations

import json
import shutil
import socket
import sys
from pathlib import Path

import pytest
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from promtool_util import (  # noqa: E402
    DASHBOARDS_DIR, PROMETHEUS_DIR, dashboard_queries, query, run_promtool, start_prometheus,
    stop_prometheus, substitute_variables, wait_for_query,
)

from prometheus_client import generate_latest  # noqa: E402

from lowcomm.node.config import NodeSection  # noqa: E402
from lowcomm.node.metrics import FAILURE_REASONS, NodeMetrics, serve_metrics  # noqa: E402

CONFIG = PROMETHEUS_DIR / "prometheus.yml"
RULES = PROMETHEUS_DIR / "rules" / "lowcomm-alerts.yml"
RULE_TESTS = PROMETHEUS_DIR / "rules" / "lowcomm-alerts.test.yml"


def _ok(result, *expected: str) -> None:
    assert result.returncode == 0, result.stdout
    for text in expected:
        assert text in result.stdout, result.stdout
    for marker in ("FAILED", "WARNING", "error"):
        assert marker not in result.stdout, result.stdout


# --- prometheus.yml -----------------------------------------------------------------------------

def test_config_is_valid_in_the_repository():
    _ok(run_promtool("check", "config", str(CONFIG)), "SUCCESS: 1 rule files found")


def test_config_is_valid_where_compose_mounts_it(tmp_path):
    etc = tmp_path / "etc" / "prometheus"          # ./prometheus:/etc/prometheus:ro
    shutil.copytree(PROMETHEUS_DIR, etc)
    # Run from elsewhere: rule_files must resolve relative to the config file, not the cwd.
    _ok(run_promtool("check", "config", str(etc / "prometheus.yml"), cwd=tmp_path), "SUCCESS: 1 rule files found")


def test_config_check_fails_when_a_rule_file_is_missing(tmp_path):
    etc = tmp_path / "prometheus"
    shutil.copytree(PROMETHEUS_DIR, etc)
    (etc / "rules" / "lowcomm-alerts.yml").unlink()
    result = run_promtool("check", "config", str(etc / "prometheus.yml"))
    assert result.returncode != 0 and "lowcomm-alerts.yml" in result.stdout, result.stdout


def test_config_scrapes_the_compose_services():
    config = yaml.safe_load(CONFIG.read_text())
    assert config["global"]["scrape_interval"] == "5s"
    assert config["rule_files"] == ["rules/lowcomm-alerts.yml"]   # relative: valid in both layouts
    [job] = config["scrape_configs"]
    assert job["job_name"] == "lowcomm"
    [sd] = job["dns_sd_configs"]
    assert sorted(sd["names"]) == ["bootstrap", "peer"] and sd["type"] == "A"
    assert sd["port"] == NodeSection().metrics_port == 7702


# --- rules ----------------------------------------------------------------------------------------

def test_rules_are_valid():
    _ok(run_promtool("check", "rules", str(RULES)), "SUCCESS")


def test_rule_unit_tests_pass():
    _ok(run_promtool("test", "rules", str(RULE_TESTS), timeout=120), "SUCCESS")


def test_rule_unit_tests_can_fail(tmp_path):
    """The same tests against rules whose lag threshold moved must fail."""
    shutil.copytree(PROMETHEUS_DIR / "rules", tmp_path / "rules")
    rules = tmp_path / "rules" / "lowcomm-alerts.yml"
    text = rules.read_text()
    assert "lowcomm_swarm_outer_step_max - lowcomm_outer_step > 5" in text
    rules.write_text(text.replace("lowcomm_swarm_outer_step_max - lowcomm_outer_step > 5", "lowcomm_swarm_outer_step_max - lowcomm_outer_step > 50"))
    result = run_promtool("test", "rules", str(tmp_path / "rules" / "lowcomm-alerts.test.yml"), timeout=120)
    assert result.returncode != 0 and "LowcommPeerLagging" in result.stdout, result.stdout


def _alerts() -> dict[str, dict]:
    groups = yaml.safe_load(RULES.read_text())["groups"]
    return {r["alert"]: r for g in groups for r in g["rules"] if "alert" in r}


def test_every_alert_has_severity_summary_and_description():
    alerts = _alerts()
    assert {"LowcommNoRecentSync", "LowcommPeerLagging", "LowcommRoundFailureRatioHigh", "LowcommSwarmShrank",
            "LowcommRejectedContributions", "LowcommNodeDown"} <= set(alerts)
    for name, rule in alerts.items():
        assert rule["labels"]["severity"] in ("warning", "critical"), name
        assert rule["annotations"]["summary"].strip() and rule["annotations"]["description"].strip(), name


def test_every_alert_is_unit_tested_firing_and_silent():
    tests = yaml.safe_load(RULE_TESTS.read_text())["tests"]
    firing, silent = set(), set()
    for case in tests:
        for check in case.get("alert_rule_test", []):
            (firing if check.get("exp_alerts") else silent).add(check["alertname"])
    assert set(_alerts()) - firing == set(), "alerts without a firing test"
    assert set(_alerts()) - silent == set(), "alerts without a non-firing test"


# --- promtool check metrics -----------------------------------------------------------------------

def _busy_metrics() -> NodeMetrics:
    m = NodeMetrics()
    m.set_build_info(codec="int8", mode="allreduce")
    m.outer_step.set(12)
    m.swarm_outer_step_max.set(13)
    m.swarm_peers.set(3)
    m.round_group_size.set(3)
    m.rounds.inc(12)
    m.checkpoint_failures.inc()
    m.round_failures.labels(reason=FAILURE_REASONS[0]).inc()
    for seconds in (0.04, 0.3, 7, 700):
        m.round_duration.observe(seconds)
        m.matchmaking_duration.observe(seconds / 10)
        m.allreduce_duration.observe(seconds / 2)
    m.last_sync_timestamp.set(1.7e9)
    m.bytes_sent.inc(1 << 20)
    m.bytes_received.inc(1 << 20)
    m.compression_ratio.set(4.0)
    m.inner_steps.inc(1200)
    m.tokens.inc(1200 * 4096)
    m.train_loss.set(3.2)
    m.eval_loss.set(3.4)
    m.compute_utilization.set(0.93)
    m.rejected_contributions.labels(reason="norm").inc()
    m.state_downloads.inc()
    m.state_download_bytes.inc(123456)
    m.missed_rounds_applied.inc()
    m.missed_rounds_bytes.inc(4096)
    m.consensus_distance.set(0.01)
    m.grpc_handled.labels(grpc_service="lowcomm.v1.Averaging", grpc_method="Reduce", grpc_code="OK").inc()
    return m


@pytest.mark.parametrize("busy", [False, True], ids=["fresh", "busy"])
def test_node_metrics_pass_promtool_check_metrics(busy):
    text = generate_latest(_busy_metrics().registry if busy else NodeMetrics().registry).decode()
    assert "_created" not in text
    result = run_promtool("check", "metrics", stdin=text)
    # promtool prints one line per finding and exits non-zero; both must be clean.
    assert (result.returncode, result.stdout.strip()) == (0, "")


def test_promtool_check_metrics_catches_a_lint_finding():
    bad = "# HELP lowcomm_rounds Rounds.\n# TYPE lowcomm_rounds counter\nlowcomm_rounds 1\n"
    result = run_promtool("check", "metrics", stdin=bad)
    assert result.returncode != 0 and '"_total" suffix' in result.stdout, result.stdout


# --- A real Prometheus ----------------------------------------------------------------------------

@pytest.fixture
def prometheus_self(tmp_path):
    proc, base_url = start_prometheus(tmp_path, ["self"], scrape_interval="1s")
    yield proc, base_url
    stop_prometheus(proc)


def test_start_query_and_stop_prometheus(prometheus_self):
    proc, base_url = prometheus_self
    port = int(base_url.rsplit(":", 1)[1])
    answer = wait_for_query(base_url, 'up{job="lowcomm"}', lambda r: [s["value"][1] for s in r] == ["1"])
    assert answer["data"]["result"][0]["metric"]["instance"] == f"127.0.0.1:{port}"
    bad = query(base_url, "rate(up[")
    assert bad["status"] == "error" and bad["errorType"] == "bad_data"
    stop_prometheus(proc)
    assert proc.returncode is not None
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", port), timeout=1).close()


@pytest.fixture
def prometheus_scraping_a_node(tmp_path):
    metrics = _busy_metrics()
    server, port = serve_metrics(metrics, "127.0.0.1", 0)
    proc, base_url = start_prometheus(tmp_path, [f"127.0.0.1:{port}"], scrape_interval="1s")
    yield proc, base_url
    stop_prometheus(proc)
    server.shutdown()
    server.server_close()


def test_every_dashboard_query_is_valid_promql(prometheus_scraping_a_node):
    _, base_url = prometheus_scraping_a_node
    wait_for_query(base_url, 'lowcomm_build_info{job="lowcomm"}', lambda r: len(r) == 1)
    queries = [q for path in sorted(DASHBOARDS_DIR.glob("*.json")) for q in dashboard_queries(path)]
    assert len(queries) >= 20
    invalid = [(title, expr, answer.get("error")) for title, expr in queries
               if (answer := query(base_url, expr, range_s=60, step="5s"))["status"] != "success"]
    assert invalid == []


def test_dashboard_queries_substitute_every_variable():
    queries = [q for path in sorted(DASHBOARDS_DIR.glob("*.json")) for q in dashboard_queries(path)]
    assert queries and all("$" not in expr for _, expr in queries)
    assert 'lowcomm_outer_step{job=~".*", instance=~".*"}' in [expr for _, expr in queries]
    assert substitute_variables("rate(x{job=~\"${job}\"}[$__rate_interval])") == 'rate(x{job=~".*"}[1m])'
    with pytest.raises(KeyError):
        substitute_variables("x{node=~\"$node\"}")
    json.dumps(queries)  # plain strings, ready for a report
