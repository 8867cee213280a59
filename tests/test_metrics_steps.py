"""node/metrics.py: the swarm's highest outer step is never below this node's own.

The DHT is read at heartbeats only; a commit between two reads set lowcomm_outer_step above
lowcomm_swarm_outer_step_max, and the dashboards' lag (max - own) went negative.
"""

from __future__ import annotations

from lowcomm.node.metrics import NodeMetrics


def sample(metrics: NodeMetrics, name: str) -> float:
    value = metrics.registry.get_sample_value(name)
    assert value is not None, name
    return value


def test_a_commit_raises_the_swarm_max_at_once_and_a_read_may_lower_it_to_our_own() -> None:
    metrics = NodeMetrics()
    metrics.set_swarm_outer_step_max(4)  # a heartbeat's read: another peer is at 4
    metrics.set_outer_step(3)
    assert sample(metrics, "lowcomm_swarm_outer_step_max") == 4
    metrics.set_outer_step(5)  # our commit, before the next read
    assert sample(metrics, "lowcomm_outer_step") == 5
    assert sample(metrics, "lowcomm_swarm_outer_step_max") == 5
    metrics.set_swarm_outer_step_max(9)  # a peer ahead of us
    assert sample(metrics, "lowcomm_swarm_outer_step_max") == 9
    metrics.set_swarm_outer_step_max(2)  # it left; the DHT's others lag: we are the highest
    assert sample(metrics, "lowcomm_swarm_outer_step_max") == 5
