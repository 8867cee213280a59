"""A real Prometheus scraping a real 3-peer swarm: metrics lint-clean, every dashboard query works."""

from __future__ import annotations

import urllib.request

import pytest

from .promtool_util import DASHBOARDS_DIR, dashboard_queries, query, run_promtool, start_prometheus, stop_prometheus
from .promtool_util import wait_for_query

pytestmark = pytest.mark.multiprocess

FAILURE_PANELS = ("failure", "rejected")  # panels that are empty in a healthy swarm, by design


@pytest.fixture
def prometheus_for(tmp_path):
    procs = []

    def start(targets):
        proc, url = start_prometheus(tmp_path, targets, scrape_interval="1s")
        procs.append(proc)
        return url

    yield start
    for proc in procs:
        stop_prometheus(proc)


def test_live_swarm_metrics_and_dashboards(swarm, prometheus_for):
    first = swarm.start(0)
    nodes = [first, swarm.start(1, [first.multiaddr]), swarm.start(2, [first.multiaddr])]
    targets = [f"127.0.0.1:{node.ready()['metrics_port']}" for node in nodes]
    base_url = prometheus_for(targets)

    # Two rounds in which all three peers averaged, seen by Prometheus on every node.
    for node in nodes:
        node.wait_for(lambda e, node=node: len([r for r in node.rounds() if r["group_size"] == 3]) >= 2, 300)
    wait_for_query(base_url, 'lowcomm_rounds_total{job="lowcomm"} >= 2', lambda result: len(result) == 3, 60)
    # rate() needs two samples after the rounds; wait for the scrape after the next one.
    wait_for_query(base_url, 'rate(lowcomm_bytes_sent_total[1m]) > 0', lambda result: len(result) >= 1, 60)

    # The exposition of a live node passes promtool's linter without a single finding.
    with urllib.request.urlopen(f"http://{targets[0]}/metrics", timeout=10) as response:
        exposition = response.read()
    lint = run_promtool("check", "metrics", stdin=exposition)
    assert lint.returncode == 0 and not lint.stdout.strip(), lint.stdout

    problems = []
    for dashboard in sorted(DASHBOARDS_DIR.glob("*.json")):
        for title, expr in dashboard_queries(dashboard):
            answer = query(base_url, expr)
            if answer.get("status") != "success":
                problems.append(f"{dashboard.name} / {title}: invalid: {answer.get('error')}")
            elif not answer["data"]["result"] and not any(word in title.lower() for word in FAILURE_PANELS):
                problems.append(f"{dashboard.name} / {title}: no data for {expr}")
    assert not problems, "\n".join(problems)
