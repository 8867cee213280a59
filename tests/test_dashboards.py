"""Lint of the Grafana dashboards in deploy/grafana/dashboards (issue #4), and a check that every
metric name a dashboard or an alert rule uses is defined in lowcomm.node.metrics.

Dashboard rules:
- a fixed ``uid``, ``"id": null``, no export-for-sharing artefacts (``__inputs``, ``${DS_...}``);
- templating variables ``datasource`` (type datasource, query prometheus), ``job`` and ``instance``
  (query variables on ``label_values(lowcomm_build_info, ...)``; instance multi-select with All);
- every panel has a ``description``, ``fieldConfig.defaults.unit`` and the datasource
  ``{"type": "prometheus", "uid": "${datasource}"}``;
- every metric selector in every target carries ``job=~"$job"`` and ``instance=~"$instance"``;
- every range is ``[$__rate_interval]``;
- counters (``*_total``, ``*_bucket``, ``*_count``, ``*_sum``) appear only as the direct argument
  of ``rate()`` or ``increase()``.
PromQL is read by a small regex tokenizer: enough for selectors, ranges and function calls.
"""

from __future__ import annotations

import copy
import json
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from promtool_util import DASHBOARDS_DIR, DEPLOY, PROMETHEUS_DIR, iter_panels  # noqa: E402

from lowcomm.node.metrics import FAILURE_REASONS, REJECTION_REASONS, NodeMetrics  # noqa: E402

DATASOURCE_REF = {"type": "prometheus", "uid": "${datasource}"}
DATASOURCE_UID = "lowcomm-prometheus"
COUNTER_SUFFIXES = ("_total", "_bucket", "_count", "_sum")
RATE_FUNCTIONS = {"rate", "increase"}
RATE_INTERVAL_RANGE = "[$__rate_interval]"
EXPORT_KEYS = ("__inputs", "__requires", "__elements")
# Series Prometheus itself adds to every scrape; alert rules may use them, dashboards may not.
SCRAPE_SERIES = {"up", "scrape_duration_seconds", "scrape_samples_scraped",
                 "scrape_samples_post_metric_relabeling", "scrape_series_added"}

DASHBOARD_FILES = sorted(DASHBOARDS_DIR.glob("*.json"))
RULE_FILES = [PROMETHEUS_DIR / "rules" / "lowcomm-alerts.yml"]


# --- A small PromQL tokenizer ------------------------------------------------------------------

_STR = r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`'
_TOKEN = re.compile(
    rf"""
    (?P<ws>\s+)
   |(?P<string>{_STR})
   |(?P<matchers>\{{(?:[^{{}}"'`]|{_STR})*\}})
   |(?P<range>\[[^\]]*\])
   |(?P<number>(?:0[xX][0-9a-fA-F]+|\d*\.?\d+(?:[eE][+-]?\d+)?)(?:[a-zA-Z]+\d*)*)
   |(?P<ident>[A-Za-z_:][A-Za-z0-9_:]*)
   |(?P<op>==|!=|>=|<=|=~|!~|[-+*/%^<>(),@=])
    """,
    re.VERBOSE,
)
_MATCHER = re.compile(rf"\s*([A-Za-z_]\w*)\s*(=~|!~|!=|=)\s*({_STR})\s*(?:,|$)")
# Followed by "(", these are the label lists of an aggregation or a vector match, not selectors.
GROUPING_KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right"}
KEYWORDS = GROUPING_KEYWORDS | {"bool", "and", "or", "unless", "offset", "atan2", "inf", "nan"}


@dataclass
class Token:
    kind: str
    text: str


@dataclass
class Selector:
    name: str | None                                           # None: a bare {...} selector
    matchers: list[tuple[str, str, str]] = field(default_factory=list)  # (label, op, value unquoted)
    range: str | None = None                                   # "[...]" right after the selector
    function: str | None = None                                # f in "f(<selector>[range])"


def tokenize(expr: str) -> list[Token]:
    tokens, pos = [], 0
    while pos < len(expr):
        m = _TOKEN.match(expr, pos)
        if m is None:
            raise ValueError(f"cannot read PromQL at {expr[pos:pos + 20]!r}")
        if m.lastgroup != "ws":
            tokens.append(Token(m.lastgroup, m.group()))
        pos = m.end()
    return tokens


def _parse_matchers(block: str) -> list[tuple[str, str, str]]:
    body, matchers, pos = block[1:-1].strip(), [], 0
    while pos < len(body):
        m = _MATCHER.match(body, pos)
        if m is None:
            raise ValueError(f"cannot read label matchers {block!r}")
        matchers.append((m.group(1), m.group(2), m.group(3)[1:-1]))
        pos = m.end()
    return matchers


def selectors(expr: str) -> list[Selector]:
    """The metric selectors of a PromQL expression, each with its matchers, range and function."""
    toks = tokenize(expr)
    found: list[Selector] = []
    i = 0
    while i < len(toks):
        tok = toks[i]
        nxt = toks[i + 1] if i + 1 < len(toks) else None
        if tok.kind == "ident" and tok.text in GROUPING_KEYWORDS and nxt is not None and nxt.text == "(":
            depth, i = 0, i + 1                                # skip "(label, ...)"
            while i < len(toks):
                depth += {"(": 1, ")": -1}.get(toks[i].text, 0)
                if depth == 0:
                    break
                i += 1
            i += 1
            continue
        is_call = nxt is not None and (nxt.text == "(" or nxt.text in ("by", "without"))
        if tok.kind == "ident" and (tok.text in KEYWORDS or is_call):
            i += 1
            continue
        if tok.kind not in ("ident", "matchers"):
            i += 1
            continue
        start = i
        sel = Selector(name=tok.text if tok.kind == "ident" else None)
        if tok.kind == "matchers":
            sel.matchers = _parse_matchers(tok.text)
        elif nxt is not None and nxt.kind == "matchers":
            sel.matchers = _parse_matchers(nxt.text)
            i += 1
        i += 1
        if i < len(toks) and toks[i].kind == "range":
            sel.range = toks[i].text
            i += 1
        if sel.name is None:                                   # {__name__="x", ...}
            sel.name = next((v for label, op, v in sel.matchers if label == "__name__" and op == "="), None)
        closes_call = i < len(toks) and toks[i].text == ")"
        if start >= 2 and toks[start - 1].text == "(" and toks[start - 2].kind == "ident" and closes_call:
            sel.function = toks[start - 2].text
        found.append(sel)
    return found


def _is_variable(value: str, name: str) -> bool:
    return value in (f"${name}", f"${{{name}}}")


def lint_expr(expr: str) -> list[str]:
    """Problems of one panel query; [] when it follows the rules."""
    try:
        sels = selectors(expr)
        ranges = [t.text for t in tokenize(expr) if t.kind == "range"]
    except ValueError as exc:
        return [str(exc)]
    problems = []
    if not sels:
        problems.append("queries no metric")
    for sel in sels:
        name = sel.name or "{...}"
        if sel.name is None:
            problems.append("selector without a metric name")
        for label in ("job", "instance"):
            if not any(lab == label and op == "=~" and _is_variable(val, label) for lab, op, val in sel.matchers):
                problems.append(f'{name} lacks the matcher {label}=~"${label}"')
        if name.endswith(COUNTER_SUFFIXES) and not (sel.function in RATE_FUNCTIONS and sel.range):
            problems.append(f"counter {name} is used outside rate()/increase()")
    for rng in ranges:
        if rng.replace(" ", "") not in (RATE_INTERVAL_RANGE, "[${__rate_interval}]"):
            problems.append(f"range {rng} is not {RATE_INTERVAL_RANGE}")
    return problems


def _variable_query(var: dict[str, Any]) -> str:
    q = var.get("query")
    return q.get("query", "") if isinstance(q, dict) else (q or "")


def lint_dashboard(dash: dict[str, Any]) -> list[str]:
    """Every rule violation of one dashboard, as readable strings; [] when it is clean."""
    problems: list[str] = []
    if "id" not in dash or dash["id"] is not None:
        problems.append('dashboard: "id" must be null')
    if not isinstance(dash.get("uid"), str) or not re.fullmatch(r"[A-Za-z0-9_-]{1,40}", dash["uid"]):
        problems.append("dashboard: needs a fixed uid of 1-40 letters, digits, '-' or '_'")
    for key in EXPORT_KEYS:
        if key in dash:
            problems.append(f"dashboard: export artefact {key} (save the dashboard JSON, not 'export for sharing')")
    if "${DS_" in json.dumps(dash):
        problems.append("dashboard: ${DS_...} placeholder from an export; use ${datasource}")

    variables = {v.get("name"): v for v in (dash.get("templating") or {}).get("list", [])}
    ds = variables.get("datasource")
    if not ds or ds.get("type") != "datasource" or ds.get("query") != "prometheus":
        problems.append("templating: needs variable 'datasource' of type datasource, query prometheus")
    for name in ("job", "instance"):
        var = variables.get(name)
        pattern = rf"label_values\(\s*lowcomm_build_info\s*(\{{[^}}]*\}})?\s*,\s*{name}\s*\)"
        if not var or var.get("type") != "query" or not re.fullmatch(pattern, _variable_query(var).strip()):
            problems.append(f"templating: needs query variable '{name}' = label_values(lowcomm_build_info, {name})")
        elif var.get("datasource") != DATASOURCE_REF:
            problems.append(f"templating: variable '{name}' must use datasource {DATASOURCE_REF}")
    inst = variables.get("instance") or {}
    if not (inst.get("multi") is True and inst.get("includeAll") is True):
        problems.append("templating: variable 'instance' must be multi-select with All")

    ids: set[Any] = set()
    for panel in iter_panels(dash):
        where = f"panel {panel.get('title')!r}"
        if panel.get("id") in ids:
            problems.append(f"{where}: duplicate panel id {panel.get('id')}")
        ids.add(panel.get("id"))
        if panel.get("type") == "row":
            continue
        if not str(panel.get("description") or "").strip():
            problems.append(f"{where}: no description")
        unit = ((panel.get("fieldConfig") or {}).get("defaults") or {}).get("unit")
        if not isinstance(unit, str) or not unit.strip():
            problems.append(f"{where}: no fieldConfig.defaults.unit")
        if panel.get("datasource") != DATASOURCE_REF:
            problems.append(f"{where}: datasource must be {DATASOURCE_REF}")
        targets = panel.get("targets") or []
        if not targets:
            problems.append(f"{where}: no targets")
        for target in targets:
            twhere = f"{where} target {target.get('refId')}"
            if "datasource" in target and target["datasource"] != DATASOURCE_REF:
                problems.append(f"{twhere}: datasource must be {DATASOURCE_REF}")
            expr = target.get("expr")
            if not isinstance(expr, str) or not expr.strip():
                problems.append(f"{twhere}: no expr")
                continue
            problems.extend(f"{twhere}: {p}" for p in lint_expr(expr))
    return problems


# --- Metric names against the code ---------------------------------------------------------------

def registry_series() -> dict[str, str]:
    """Every series name a fresh NodeMetrics exposes -> its metric type."""
    series: dict[str, str] = {}
    for family in NodeMetrics().registry.collect():
        suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"),
                    "summary": ("", "_sum", "_count"), "info": ("_info",)}.get(family.type, ("",))
        for suffix in suffixes:
            series[family.name + suffix] = family.type
        for sample in family.samples:
            series.setdefault(sample.name, family.type)
    return series


def dashboard_exprs(dash: dict[str, Any]) -> list[tuple[str, str]]:
    """(where, PromQL) of every panel target and every query variable."""
    out = [(f"panel {p.get('title')!r}", t["expr"]) for p in iter_panels(dash)
           for t in p.get("targets") or [] if t.get("expr")]
    for var in (dash.get("templating") or {}).get("list", []):
        if var.get("type") == "query":
            m = re.fullmatch(r"\s*label_values\((.*),\s*\w+\s*\)\s*", _variable_query(var))
            out.append((f"variable {var.get('name')!r}", m.group(1) if m else _variable_query(var)))
    return out


def rule_exprs() -> tuple[list[tuple[str, str]], set[str]]:
    """(where, PromQL) of every rule, and the names the recording rules define."""
    exprs, recorded = [], set()
    for path in RULE_FILES:
        for group in yaml.safe_load(path.read_text())["groups"]:
            for rule in group["rules"]:
                name = rule.get("record") or rule.get("alert")
                exprs.append((f"{path.name}: {name}", rule["expr"]))
                if "record" in rule:
                    recorded.add(rule["record"])
    return exprs, recorded


def check_metric_names(exprs: list[tuple[str, str]], known: dict[str, str]) -> list[str]:
    """Names not in ``known``, and rate()/increase() over series that are not counters."""
    problems = []
    for where, expr in exprs:
        for sel in selectors(expr):
            if sel.name not in known:
                problems.append(f"{where}: {sel.name} is not a metric of lowcomm.node.metrics")
            elif sel.function in RATE_FUNCTIONS and known[sel.name] not in ("counter", "histogram", "summary"):
                problems.append(f"{where}: {sel.function}() over {sel.name}, a {known[sel.name]}")
    return problems


# --- Tests ---------------------------------------------------------------------------------------

def _load(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text())


def test_the_expected_dashboards_exist():
    assert {p.name for p in DASHBOARD_FILES} >= {"swarm-overview.json", "sync-health.json"}


@pytest.mark.parametrize("path", DASHBOARD_FILES, ids=lambda p: p.name)
def test_dashboard_follows_the_rules(path):
    assert lint_dashboard(_load(path)) == []


def test_dashboard_uids_are_unique():
    uids = [_load(p)["uid"] for p in DASHBOARD_FILES]
    assert len(uids) == len(set(uids)), uids


@pytest.mark.parametrize("path", DASHBOARD_FILES, ids=lambda p: p.name)
def test_dashboard_metrics_exist_in_the_code(path):
    assert check_metric_names(dashboard_exprs(_load(path)), registry_series()) == []


def test_alert_rule_metrics_exist_in_the_code():
    exprs, recorded = rule_exprs()
    assert exprs, "no rules read"
    known = registry_series() | {name: "gauge" for name in SCRAPE_SERIES | recorded}
    assert check_metric_names(exprs, known) == []
    counters_outside_rate = [
        (where, sel.name) for where, expr in exprs for sel in selectors(expr)
        if sel.name.endswith(COUNTER_SUFFIXES) and sel.function not in RATE_FUNCTIONS
    ]
    assert counters_outside_rate == []


# Each dashboard shows at least what issue #4 asks of it.
REQUIRED_SERIES = {
    "swarm-overview.json": {
        "lowcomm_swarm_peers", "lowcomm_outer_step", "lowcomm_swarm_outer_step_max",
        "lowcomm_last_sync_timestamp_seconds", "lowcomm_tokens_total", "lowcomm_train_loss", "lowcomm_eval_loss",
    },
    "sync-health.json": {
        "lowcomm_rounds_total", "lowcomm_round_duration_seconds_bucket", "lowcomm_matchmaking_duration_seconds_bucket",
        "lowcomm_allreduce_duration_seconds_bucket", "lowcomm_round_failures_total", "lowcomm_bytes_sent_total",
        "lowcomm_bytes_received_total", "lowcomm_compression_ratio", "lowcomm_compute_utilization_ratio",
        "lowcomm_rejected_contributions_total", "lowcomm_state_downloads_total", "grpc_server_handled_total",
        "lowcomm_checkpoint_failures_total",
    },
}


@pytest.mark.parametrize("name", sorted(REQUIRED_SERIES))
def test_dashboard_shows_what_the_issue_asks(name):
    dash = _load(DASHBOARDS_DIR / name)
    used = {sel.name for _, expr in dashboard_exprs(dash) for sel in selectors(expr)}
    assert REQUIRED_SERIES[name] - used == set()
    if name == "sync-health.json":
        exprs = [e for _, e in dashboard_exprs(dash)]
        for quantile in ("0.5", "0.95"):
            assert any(f"histogram_quantile({quantile}," in e and "lowcomm_round_duration_seconds_bucket" in e
                       for e in exprs), quantile


# The label values a reason-labelled counter can take, as node/metrics.py fixes them. Every place
# that lists them for a reader (a panel description, the README) must list exactly these: a
# renamed or added reason otherwise leaves a series nobody can look up.
REASON_LISTS = {"lowcomm_round_failures_total": set(FAILURE_REASONS),
                "lowcomm_rejected_contributions_total": set(REJECTION_REASONS)}
_BY_REASON = re.compile(r"by reason \(([^)]*)\)")


def _listed(text: str) -> set[str]:
    return {item.strip().strip("`") for item in text.split(",") if item.strip()}


@pytest.mark.parametrize("path", DASHBOARD_FILES, ids=lambda p: p.name)
def test_panel_descriptions_list_the_reasons_of_the_code(path):
    checked = 0
    for panel in iter_panels(_load(path)):
        exprs = [t.get("expr") or "" for t in panel.get("targets") or []]
        for metric, reasons in REASON_LISTS.items():
            if not any(metric in e and re.search(r"by \(\s*reason\s*\)", e) for e in exprs):
                continue
            lists = _BY_REASON.findall(panel.get("description") or "")
            assert len(lists) == 1, f"{panel['title']!r}: describe the reasons as 'by reason (a, b, ...)'"
            assert _listed(lists[0]) == reasons, (panel["title"], sorted(_listed(lists[0]) ^ reasons))
            checked += 1
    if path.name == "sync-health.json":
        assert checked == 2


def test_readme_lists_the_reasons_of_the_code():
    text = (DEPLOY.parent / "README.md").read_text()
    found = {what: _listed(items) for what, items in
             re.findall(r"(round failures|rejected contributions)[^()]*?by reason \(([^)]*)\)", text, re.S)}
    assert found == {"round failures": REASON_LISTS["lowcomm_round_failures_total"],
                     "rejected contributions": REASON_LISTS["lowcomm_rejected_contributions_total"]}


def test_grafana_provisioning_matches_the_dashboards():
    prov = DEPLOY / "grafana" / "provisioning"
    datasources = yaml.safe_load((prov / "datasources" / "prometheus.yml").read_text())["datasources"]
    assert [(d["uid"], d["type"], d["url"]) for d in datasources] == [
        (DATASOURCE_UID, "prometheus", "http://prometheus:9090")]
    providers = yaml.safe_load((prov / "dashboards" / "lowcomm.yml").read_text())["providers"]
    assert [(p["type"], p["options"]["path"]) for p in providers] == [("file", "/var/lib/grafana/dashboards")]
    for path in DASHBOARD_FILES:
        ds = next(v for v in _load(path)["templating"]["list"] if v["name"] == "datasource")
        assert ds["current"].get("value") == DATASOURCE_UID, path.name


# --- The lint must catch violations --------------------------------------------------------------

M = '{job=~"$job", instance=~"$instance"}'
GOOD_EXPRS = [
    f"sum by (instance) (rate(lowcomm_rounds_total{M}[$__rate_interval])) * 60",
    f"histogram_quantile(0.95, sum by (le) (rate(lowcomm_round_duration_seconds_bucket{M}[$__rate_interval])))",
    f"(time() - lowcomm_last_sync_timestamp_seconds{M}) and (lowcomm_last_sync_timestamp_seconds{M} > 0)",
    'increase(lowcomm_rejected_contributions_total{job=~"${job}", instance=~"${instance}", reason="norm"}[$__rate_interval])',
    f"lowcomm_swarm_outer_step_max{M} - on (job, instance) lowcomm_outer_step{M} offset 1m",
]
BAD_EXPRS = {
    "no matchers": ("lowcomm_outer_step", 'lowcomm_outer_step lacks the matcher job=~"$job"'),
    "no instance matcher": ('lowcomm_outer_step{job=~"$job"}', 'lacks the matcher instance=~"$instance"'),
    "equality instead of regex": ('lowcomm_outer_step{job="$job", instance=~"$instance"}', "lacks the matcher job"),
    "second selector unmatched": (f"lowcomm_swarm_outer_step_max{M} - lowcomm_outer_step",
                                  'lowcomm_outer_step lacks the matcher job'),
    "counter outside rate": (f"sum(lowcomm_rounds_total{M})", "counter lowcomm_rounds_total is used outside"),
    "bucket outside rate": (f"histogram_quantile(0.9, lowcomm_round_duration_seconds_bucket{M})",
                            "counter lowcomm_round_duration_seconds_bucket is used outside"),
    "counter in a ratio": (f"rate(lowcomm_rounds_total{M}[$__rate_interval]) / lowcomm_rounds_total{M}",
                           "counter lowcomm_rounds_total is used outside"),
    "counter in another function": (f"delta(lowcomm_bytes_sent_total{M}[$__rate_interval])",
                                    "counter lowcomm_bytes_sent_total is used outside"),
    "fixed rate window": (f"rate(lowcomm_rounds_total{M}[5m])", "range [5m] is not [$__rate_interval]"),
    "nameless selector": ('{__name__=~"lowcomm_.*", job=~"$job", instance=~"$instance"}', "selector without a metric name"),
    "no metric at all": ("vector(1)", "queries no metric"),
}


@pytest.mark.parametrize("expr", GOOD_EXPRS)
def test_lint_accepts_good_queries(expr):
    assert lint_expr(expr) == []


@pytest.mark.parametrize("case", sorted(BAD_EXPRS))
def test_lint_catches_bad_queries(case):
    expr, expected = BAD_EXPRS[case]
    problems = lint_expr(expr)
    assert any(expected in p for p in problems), problems


def _bad_panel() -> dict[str, Any]:
    return {
        "type": "timeseries", "title": "Bad panel", "id": 999, "gridPos": {"h": 8, "w": 12, "x": 0, "y": 99},
        "datasource": {"type": "prometheus", "uid": DATASOURCE_UID},        # hard-coded uid
        "fieldConfig": {"defaults": {}, "overrides": []},                     # no unit
        "targets": [{"refId": "A", "expr": "sum(lowcomm_rounds_total)"}],     # no matchers, bare counter
    }                                                                         # and no description


def test_lint_catches_a_deliberately_bad_panel():
    dash = _load(DASHBOARDS_DIR / "sync-health.json")
    assert lint_dashboard(dash) == []
    dash["panels"].append(_bad_panel())
    problems = lint_dashboard(dash)
    for expected in ("'Bad panel': no description", "'Bad panel': no fieldConfig.defaults.unit",
                     "'Bad panel': datasource must be", 'lacks the matcher job=~"$job"',
                     'lacks the matcher instance=~"$instance"', "counter lowcomm_rounds_total is used outside"):
        assert any(expected in p for p in problems), (expected, problems)


def test_lint_catches_a_bad_panel_inside_a_collapsed_row():
    dash = _load(DASHBOARDS_DIR / "swarm-overview.json")
    dash["panels"].append({"type": "row", "title": "Collapsed", "id": 998, "collapsed": True,
                           "gridPos": {"h": 1, "w": 24, "x": 0, "y": 98}, "panels": [_bad_panel()]})
    assert any("'Bad panel': no description" in p for p in lint_dashboard(dash))


def _mutations():
    def drop_var(name):
        return lambda d: d["templating"].__setitem__("list", [v for v in d["templating"]["list"] if v["name"] != name])

    def set_var(name, key, value):
        return lambda d: next(v for v in d["templating"]["list"] if v["name"] == name).__setitem__(key, value)

    def first_panel(d):
        return next(p for p in iter_panels(d) if p["type"] != "row")

    return {
        "id not null": (lambda d: d.__setitem__("id", 7), '"id" must be null'),
        "no uid": (lambda d: d.pop("uid"), "fixed uid"),
        "__inputs": (lambda d: d.__setitem__("__inputs", [{"name": "DS_PROMETHEUS"}]), "export artefact __inputs"),
        "DS placeholder": (lambda d: first_panel(d).__setitem__("datasource", {"type": "prometheus", "uid": "${DS_PROMETHEUS}"}),
                           "${DS_...} placeholder"),
        "no datasource variable": (drop_var("datasource"), "variable 'datasource'"),
        "no job variable": (drop_var("job"), "query variable 'job'"),
        "job variable on another metric": (set_var("job", "query", "label_values(up, job)"), "query variable 'job'"),
        "instance not multi": (set_var("instance", "multi", False), "multi-select with All"),
        "instance without All": (set_var("instance", "includeAll", False), "multi-select with All"),
        "empty description": (lambda d: first_panel(d).__setitem__("description", " "), "no description"),
        "no unit": (lambda d: first_panel(d)["fieldConfig"]["defaults"].pop("unit"), "no fieldConfig.defaults.unit"),
        "target datasource": (lambda d: first_panel(d)["targets"][0].__setitem__("datasource", {"type": "prometheus", "uid": "x"}),
                              "target A: datasource must be"),
        "no targets": (lambda d: first_panel(d).__setitem__("targets", []), "no targets"),
        "duplicate panel id": (lambda d: d["panels"].append(copy.deepcopy(first_panel(d))), "duplicate panel id"),
    }


@pytest.mark.parametrize("case", sorted(_mutations()))
def test_lint_catches_dashboard_level_violations(case):
    mutate, expected = _mutations()[case]
    dash = _load(DASHBOARDS_DIR / "swarm-overview.json")
    mutate(dash)
    problems = lint_dashboard(dash)
    assert any(expected in p for p in problems), problems


def test_metric_name_check_catches_drift():
    known = registry_series()
    assert known["lowcomm_rounds_total"] == "counter"
    assert known["lowcomm_round_duration_seconds_bucket"] == "histogram"
    assert known["lowcomm_build_info"] == "info"
    assert known["grpc_server_handled_total"] == "counter"   # no child yet, still known by its type
    problems = check_metric_names([
        ("renamed", f"rate(lowcomm_round_total{M}[$__rate_interval])"),
        ("gauge rated", f"rate(lowcomm_outer_step{M}[$__rate_interval])"),
        ("fine", f"rate(lowcomm_rounds_total{M}[$__rate_interval])"),
    ], known)
    assert problems == ["renamed: lowcomm_round_total is not a metric of lowcomm.node.metrics",
                        "gauge rated: rate() over lowcomm_outer_step, a gauge"]
