"""Offline checks of deploy/: the Grafana dashboard, the Prometheus alert rules, the Dockerfiles.

Metric names are public API (STYLE habit 9): the dashboard and the alerts may use only the
names the scheduler exports. PromQL is parsed with promql-parser when it is installed.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any
from collections.abc import Iterator

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
DASHBOARD = DEPLOY / "grafana" / "bubblespec-dashboard.json"
ALERTS = DEPLOY / "prometheus" / "alerts.yaml"

COUNTERS_AND_GAUGES = {
    "bubblespec_requests_waiting",
    "bubblespec_requests_running",
    "bubblespec_completions_total",
    "bubblespec_worker_busy_seconds_total",
    "bubblespec_worker_idle_seconds_total",
    "bubblespec_worker_drafting_seconds_total",
    "bubblespec_workers_live",
    "bubblespec_policy_version",
    "bubblespec_spec_draft_tokens_total",
    "bubblespec_spec_accepted_tokens_total",
    "bubblespec_spec_acceptance_ratio",
    "bubblespec_forward_passes_total",
    "bubblespec_generated_tokens_total",
    "bubblespec_draft_store_errors_total",
    "bubblespec_draft_store_up",
    "bubblespec_grpc_requests_total",
    "bubblespec_stragglers_detected_total",
    "bubblespec_requests_moved_total",
    "bubblespec_step_running",
    "bubblespec_last_progress_timestamp_seconds",
}
HISTOGRAMS = {
    "bubblespec_step_makespan_seconds",
    "bubblespec_weight_load_seconds",
    "bubblespec_draft_store_op_seconds",
}
ALLOWED = COUNTERS_AND_GAUGES | {f"{h}{s}" for h in HISTOGRAMS for s in ("_bucket", "_sum", "_count")}
# Labels each metric carries (besides the scrape's own target labels).
METRIC_LABELS = {
    "bubblespec_worker_busy_seconds_total": {"worker"},
    "bubblespec_worker_idle_seconds_total": {"worker"},
    "bubblespec_worker_drafting_seconds_total": {"worker"},
    "bubblespec_policy_version": {"worker"},
    "bubblespec_spec_draft_tokens_total": {"source"},
    "bubblespec_spec_accepted_tokens_total": {"source"},
    "bubblespec_grpc_requests_total": {"method", "code"},
}
# Grafana's variables, replaced by plausible values before PromQL parsing.
GRAFANA_VARS = {"$__rate_interval": "1m", "$__interval": "1m", "$__range": "1h", "$namespace": ".*"}
METRIC_TOKEN = re.compile(r"\bbubblespec_[a-z0-9_]+\b")


def referenced_metrics(expr: str) -> set[str]:
    return set(METRIC_TOKEN.findall(expr))


def parse_promql(expr: str) -> set[str]:
    """Parse with promql-parser; return the metric names of every vector selector."""
    promql_parser = pytest.importorskip("promql_parser", reason="needs: pip install promql-parser")
    for var, value in GRAFANA_VARS.items():
        expr = expr.replace(var, value)
    names: set[str] = set()

    def visit(node: Any) -> None:
        if isinstance(node, promql_parser.VectorSelector):
            names.add(node.name)

    promql_parser.walk(promql_parser.parse(expr), visit)
    return names


# --------------------------------------------------------------------------- Grafana


@pytest.fixture(scope="module")
def dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())


def panels(dashboard: dict[str, Any]) -> Iterator[dict[str, Any]]:
    for panel in dashboard["panels"]:
        yield panel
        yield from panel.get("panels", [])


def targets(dashboard: dict[str, Any]) -> Iterator[tuple[str, str]]:
    for panel in panels(dashboard):
        for target in panel.get("targets", []):
            yield panel["title"], target["expr"]
    for var in dashboard["templating"]["list"]:
        if var["type"] == "query":
            yield f"variable {var['name']}", var["definition"]


def test_dashboard_is_a_grafana_dashboard(dashboard: dict[str, Any]) -> None:
    assert dashboard["uid"] and dashboard["title"]
    assert isinstance(dashboard["schemaVersion"], int) and dashboard["schemaVersion"] >= 36
    ids = [p["id"] for p in panels(dashboard)]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    for panel in panels(dashboard):
        grid = panel["gridPos"]
        assert 0 <= grid["x"] and grid["x"] + grid["w"] <= 24, panel["title"]
        if panel["type"] != "row":
            assert panel["targets"], panel["title"]
            assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["query"] == "prometheus"


def test_dashboard_uses_only_exported_metrics(dashboard: dict[str, Any]) -> None:
    used: set[str] = set()
    for title, expr in targets(dashboard):
        names = referenced_metrics(expr)
        assert names, f"{title}: {expr} references no bubblespec metric"
        assert names <= ALLOWED, f"{title}: unknown metrics {names - ALLOWED}"
        used |= names
    # Every exported metric is somewhere on the dashboard.
    bare = {re.sub(r"_(bucket|sum|count)$", "", n) if n.endswith(("_bucket", "_sum", "_count")) else n for n in used}
    assert (COUNTERS_AND_GAUGES | HISTOGRAMS) - bare == set()


def test_dashboard_promql_parses(dashboard: dict[str, Any]) -> None:
    for title, expr in targets(dashboard):
        if expr.startswith("label_values("):
            continue  # a Grafana function, not PromQL
        try:
            names = parse_promql(expr)
        except ValueError as exc:
            pytest.fail(f"{title}: {expr}: {exc}")
        assert names <= ALLOWED, title


def test_dashboard_groups_only_by_existing_labels(dashboard: dict[str, Any]) -> None:
    for title, expr in targets(dashboard):
        for labels in re.findall(r"\bby \(([^)]*)\)", expr):
            for label in (part.strip() for part in labels.split(",")):
                if label in ("le", "namespace"):
                    continue
                owners = [m for m in referenced_metrics(expr) if label in METRIC_LABELS.get(m, set())]
                assert owners, f"{title}: groups by {label!r}, which none of its metrics carries"


@pytest.mark.parametrize(
    ("title_part", "must_contain"),
    [
        ("Step makespan", ["histogram_quantile(0.5", "histogram_quantile(0.99", "bubblespec_step_makespan_seconds_bucket"]),
        ("Bubble share", ["bubblespec_worker_idle_seconds_total", "bubblespec_worker_busy_seconds_total",
                          "bubblespec_worker_drafting_seconds_total"]),
        ("Acceptance ratio by source", ["by (source)", "bubblespec_spec_accepted_tokens_total",
                                        "bubblespec_spec_draft_tokens_total"]),
        ("Forward passes per generated token", ["bubblespec_forward_passes_total", "bubblespec_generated_tokens_total"]),
        ("Workers live", ["bubblespec_workers_live"]),
        ("Policy version per worker", ["by (worker)", "bubblespec_policy_version"]),
        ("Draft store op latency", ["bubblespec_draft_store_op_seconds_bucket"]),
        ("Draft store errors", ["bubblespec_draft_store_errors_total", "bubblespec_draft_store_up"]),
        ("gRPC requests by code", ["by (code)", "bubblespec_grpc_requests_total"]),
        ("Worker time by state", ["bubblespec_worker_busy_seconds_total", "bubblespec_worker_idle_seconds_total",
                                  "bubblespec_worker_drafting_seconds_total"]),
    ],
)
def test_dashboard_has_panel(dashboard: dict[str, Any], title_part: str, must_contain: list[str]) -> None:
    matching = [p for p in panels(dashboard) if title_part in p["title"] and p["type"] != "row"]
    assert matching, f"no panel titled *{title_part}*"
    exprs = " ".join(t["expr"] for p in matching for t in p["targets"])
    for fragment in must_contain:
        assert fragment in exprs, f"{title_part}: {fragment} not queried"


def test_bubble_share_is_idle_over_all_worker_time(dashboard: dict[str, Any]) -> None:
    panel = next(p for p in panels(dashboard) if p["title"] == "Bubble share over time")
    expr = panel["targets"][0]["expr"]
    numerator, denominator = expr.split(" / ", 1)
    assert "idle" in numerator and "busy" not in numerator
    assert all(state in denominator for state in ("busy", "idle", "drafting"))


# --------------------------------------------------------------------------- alerts

EXPECTED_ALERTS = {
    "BubbleSpecWorkerDown",
    "BubbleSpecStepStalled",
    "BubbleSpecAcceptanceCollapsed",
    "BubbleSpecRedisUnreachable",
}


@pytest.fixture(scope="module")
def alert_rules() -> list[dict[str, Any]]:
    doc = yaml.safe_load(ALERTS.read_text())
    assert set(doc) == {"groups"}
    rules = []
    for group in doc["groups"]:
        assert group["name"] and group["rules"]
        rules.extend(group["rules"])
    return rules


def test_alerts_are_the_four_expected(alert_rules: list[dict[str, Any]]) -> None:
    names = [r["alert"] for r in alert_rules]
    assert sorted(names) == sorted(EXPECTED_ALERTS)


def test_alerts_are_documented(alert_rules: list[dict[str, Any]]) -> None:
    for rule in alert_rules:
        assert rule["labels"]["severity"] in {"info", "warning", "critical"}, rule["alert"]
        assert re.fullmatch(r"[0-9]+[smh]", rule["for"]), rule["alert"]
        for field in ("summary", "description", "runbook"):
            assert len(rule["annotations"][field].strip()) > 20 or field == "summary", (rule["alert"], field)


def test_alert_expressions_use_exported_metrics_and_parse(alert_rules: list[dict[str, Any]]) -> None:
    for rule in alert_rules:
        names = referenced_metrics(rule["expr"])
        assert names and names <= ALLOWED, (rule["alert"], names - ALLOWED)
        try:
            assert parse_promql(rule["expr"]) <= ALLOWED
        except ValueError as exc:
            pytest.fail(f"{rule['alert']}: {exc}")


def test_step_stalled_alert_matches_its_definition(alert_rules: list[dict[str, Any]]) -> None:
    rule = next(r for r in alert_rules if r["alert"] == "BubbleSpecStepStalled")
    expr = " ".join(rule["expr"].split())
    assert "bubblespec_step_running) == 1" in expr
    assert "time() - max by (namespace) (bubblespec_last_progress_timestamp_seconds)) > 300" in expr


# --------------------------------------------------------------------------- Dockerfiles


def instructions(name: str) -> list[tuple[str, str]]:
    text = (DEPLOY / name).read_text().replace("\\\n", " ")
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            op, _, rest = line.partition(" ")
            out.append((op.upper(), rest.strip()))
    return out


@pytest.mark.parametrize(
    ("name", "base", "extra"),
    [
        ("Dockerfile.scheduler", "python:3.11-slim", ".[scheduler]"),
        ("Dockerfile.worker-gpu", "vllm/vllm-openai:", ".[worker]"),
        ("Dockerfile.worker-cpu", "python:3.11-slim", ".[worker-cpu]"),
    ],
)
def test_dockerfiles(name: str, base: str, extra: str) -> None:
    steps = instructions(name)
    text = (DEPLOY / name).read_text()
    assert base in text
    assert any(op == "RUN" and "install" in arg and f'"{extra}"' in arg for op, arg in steps), extra
    users = [arg for op, arg in steps if op == "USER"]
    assert users and users[-1] == "1000:1000", "the image must end as non-root user 1000"
    assert ("ENTRYPOINT", '["bubblespec"]') in steps
    assert (DEPLOY / f"{name}.dockerignore").read_text().count(".venv") >= 1


def test_cpu_worker_drops_unused_torch_packages() -> None:
    runs = " ".join(arg for op, arg in instructions("Dockerfile.worker-cpu") if op == "RUN")
    assert "uninstall -y torchvision torchaudio torchcodec" in runs
