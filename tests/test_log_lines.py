"""What a node's log lines say when a number is missing: strict JSON for tools, "-" for people."""

from __future__ import annotations

import json
import logging
import math

import pytest

from lowcomm.node.commit import eval_text
from lowcomm.node.logs import JsonFormatter


def strict_loads(line: str) -> dict:
    """json.loads as jq, Loki or Vector read a line: NaN and Infinity are not JSON."""
    def refuse(constant: str) -> None:
        raise ValueError(f"{constant} is not JSON")
    return json.loads(line, parse_constant=refuse)


def test_numbers_that_are_not_finite_are_null_in_json_lines() -> None:
    # A round without an eval logged "eval_loss": NaN, which only Python's json reads.
    record = logging.LogRecord("lowcomm.node", logging.INFO, __file__, 1, "step %d", (3,), None)
    record.__dict__.update({"event": "round_done", "eval_loss": math.nan, "loss": math.inf, "tokens": 7,
                            "shards": [1.5, -math.inf, {"share": math.nan}], "owned_share": 0.25})
    entry = strict_loads(JsonFormatter().format(record))
    assert entry["msg"] == "step 3" and entry["event"] == "round_done" and entry["tokens"] == 7
    assert entry["eval_loss"] is None and entry["loss"] is None
    assert entry["shards"] == [1.5, None, {"share": None}] and entry["owned_share"] == 0.25


@pytest.mark.parametrize("eval_loss, skipped, shown", [(2.5, False, "2.500"), (math.nan, False, "-"),
                                                       (2.5, True, "skipped"), (math.nan, True, "skipped")])
def test_the_round_lines_eval_is_a_dash_when_there_is_none(eval_loss: float, skipped: bool, shown: str) -> None:
    # A Swarm without eval_fn printed "eval nan" in every round line; `status` shows "-".
    assert eval_text(eval_loss, skipped) == shown
