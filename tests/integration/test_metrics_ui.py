"""/metrics and /ui against a real embedded cluster: scheduler + 2 vLLM CPU workers, in process.

One module-scoped cluster runs two real steps through the SDK (the second after a policy
update, on the same prompts, so that it verifies ``history`` drafts); the tests then read the
scheduler's and a worker's /metrics and render /ui in headless Chromium.
"""

from __future__ import annotations

import asyncio
import re
import shutil
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest
import pytest_asyncio
from prometheus_client.parser import text_string_to_metric_families

from bubblespec.cli.commands import Cluster  # noqa: F401 (type of Ran.cluster)
from bubblespec.client import SamplingParams, StepResult
from bubblespec.bench.tiny_model import perturb_weights

pytestmark = [pytest.mark.vllm, pytest.mark.asyncio(loop_scope="session"), pytest.mark.timeout(1200)]

ROOT = Path(__file__).resolve().parents[2]
ARTIFACTS = ROOT / "artifacts"
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
PROMPTS = [[10 + i, 20 + 3 * i, 30 + (i * 7) % 50, 40, 41 + i] for i in range(8)]
LOOKAHEAD = [[60 + i, 61, 62 + i] for i in range(4)]
GREEDY = SamplingParams(temperature=0.0, max_tokens=48)
REQUIRED = [
    "bubblespec_requests_waiting", "bubblespec_requests_running", "bubblespec_completions_total",
    "bubblespec_step_makespan_seconds", "bubblespec_worker_busy_seconds_total",
    "bubblespec_worker_idle_seconds_total", "bubblespec_worker_drafting_seconds_total",
    "bubblespec_workers_live", "bubblespec_policy_version", "bubblespec_spec_draft_tokens_total",
    "bubblespec_spec_accepted_tokens_total", "bubblespec_spec_acceptance_ratio", "bubblespec_forward_passes_total",
    "bubblespec_generated_tokens_total", "bubblespec_weight_load_seconds", "bubblespec_grpc_requests_total",
    "bubblespec_stragglers_detected_total", "bubblespec_requests_moved_total", "bubblespec_step_running",
    "bubblespec_last_progress_timestamp_seconds",
]
WORKER_REQUIRED = ["bubblespec_draft_store_op_seconds", "bubblespec_draft_store_errors_total",
                   "bubblespec_draft_store_up"]


@dataclass
class Ran:
    cluster: Cluster
    steps: list[StepResult]
    started_wall: float
    version: int
    before: dict  # scheduler metric samples before the two steps (the cluster is shared)


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def ran(cluster, client, tiny_model, tmp_path_factory):
    """Two real steps through the SDK on the session cluster (the second after a policy update)."""
    started = time.time()
    v = cluster.scheduler.core.version
    _, before = parse((await http_get(f"http://127.0.0.1:{cluster.scheduler.http_port}/metrics"))[2])
    first = await asyncio.wait_for(
        client.generate("metrics-1", PROMPTS, GREEDY, policy_version=v, lookahead=LOOKAHEAD), 300)
    weights = perturb_weights(tiny_model, tmp_path_factory.mktemp("metrics") / "v1", scale=0.002, seed=1)
    try:
        await asyncio.wait_for(client.update_policy(v + 1, str(weights)), 300)
        second = await asyncio.wait_for(client.generate("metrics-2", PROMPTS, GREEDY, policy_version=v + 1), 300)
        yield Ran(cluster, [first, second], started, v + 1, before)
    finally:
        await client.update_policy(cluster.scheduler.core.version + 1, tiny_model)


async def http_get(url: str) -> tuple[int, str, bytes]:
    def get() -> tuple[int, str, bytes]:
        with urllib.request.urlopen(url, timeout=30) as resp:
            return resp.status, resp.headers.get("Content-Type", ""), resp.read()

    return await asyncio.to_thread(get)  # the servers run on this loop: never block it


def parse(body: bytes) -> tuple[dict, dict[tuple[str, tuple], float]]:
    families = {f.name: f for f in text_string_to_metric_families(body.decode())}
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value for f in families.values() for s in f.samples}
    return families, samples


def family_names(families: dict) -> set[str]:
    return {name + "_total" if f.type == "counter" else name for name, f in families.items()}


async def test_scheduler_metrics_after_real_steps(ran):
    url = f"http://127.0.0.1:{ran.cluster.scheduler.http_port}/metrics"
    status, content_type, body = await http_get(url)
    assert status == 200 and content_type.startswith("text/plain")
    families, samples = parse(body)
    assert set(REQUIRED) <= family_names(families), sorted(set(REQUIRED) - family_names(families))

    def value(name: str, **labels) -> float:
        return samples[(name, tuple(sorted(labels.items())))]

    def delta(name: str, **labels) -> float:
        key = (name, tuple(sorted(labels.items())))
        return samples[key] - ran.before.get(key, 0.0)

    comps = [c for r in ran.steps for c in r.completions]
    assert delta("bubblespec_completions_total") == len(comps) == 2 * len(PROMPTS)
    assert delta("bubblespec_generated_tokens_total") == sum(len(c.token_ids) for c in comps) > 0
    assert delta("bubblespec_forward_passes_total") == sum(c.provenance.forward_passes for c in comps) > 0
    assert delta("bubblespec_step_makespan_seconds_count") == 2
    assert delta("bubblespec_step_makespan_seconds_sum") == pytest.approx(
        sum(r.summary.makespan_seconds for r in ran.steps))
    assert delta("bubblespec_weight_load_seconds_count") == 2  # one load per worker
    assert value("bubblespec_workers_live") == 2
    assert value("bubblespec_step_running") == 0
    assert value("bubblespec_requests_waiting") == value("bubblespec_requests_running") == 0
    assert ran.started_wall <= value("bubblespec_last_progress_timestamp_seconds") <= time.time()
    assert value("bubblespec_grpc_requests_total", method="bubblespec.v1.Rollout/Generate", code="OK") >= 2
    assert value("bubblespec_grpc_requests_total", method="bubblespec.v1.Rollout/UpdatePolicy", code="OK") >= 1

    # speculation by source: step 2 verifies step 1's responses (history drafts) under v1
    drafted = {s.source: s.drafted_tokens for s in ran.steps[1].summary.provenance.sources}
    assert drafted.get("history", 0) > 0
    for source in drafted:
        expected = sum(r.summary.provenance.drafted(source) for r in ran.steps)
        assert delta("bubblespec_spec_draft_tokens_total", source=source) == expected
        accepted = sum(r.summary.provenance.accepted(source) for r in ran.steps)
        assert delta("bubblespec_spec_accepted_tokens_total", source=source) == accepted
    prov = ran.steps[1].summary.provenance
    assert value("bubblespec_spec_acceptance_ratio") == pytest.approx(prov.accepted() / prov.drafted())

    # per-worker series
    for worker in ("worker-0", "worker-1"):
        assert value("bubblespec_policy_version", worker=worker) == ran.version
        assert value("bubblespec_worker_busy_seconds_total", worker=worker) > 0
        assert value("bubblespec_worker_idle_seconds_total", worker=worker) >= 0
        assert value("bubblespec_worker_drafting_seconds_total", worker=worker) >= 0
    time_total = sum(v for (name, _), v in samples.items() if re.fullmatch(
        r"bubblespec_worker_(busy|idle|drafting)_seconds_total", name))
    assert time_total > 0


async def test_worker_metrics(ran):
    from bubblespec.worker.http import start_http

    agent = ran.cluster.agents[0]
    server = await start_http(agent, 0)
    try:
        while not server.started:
            await asyncio.sleep(0.02)
        port = server.servers[0].sockets[0].getsockname()[1]
        status, _, body = await http_get(f"http://127.0.0.1:{port}/metrics")
    finally:
        server.should_exit = True
    assert status == 200
    families, samples = parse(body)
    assert set(WORKER_REQUIRED) <= family_names(families)
    assert samples[("bubblespec_worker_info", (("worker", "worker-0"),))] == 1
    assert samples[("bubblespec_worker_policy_version", ())] == ran.version
    assert samples[("bubblespec_worker_connected", ())] == 1
    assert samples[("bubblespec_draft_store_up", ())] == 1
    ops = samples[("bubblespec_draft_store_ops_total", ())]
    assert ops > 0  # drafts were read and history written
    assert samples[("bubblespec_draft_store_op_seconds_count", ())] == ops


async def chromium(*args: str, timeout: float = 180.0) -> bytes:
    profile = tempfile.mkdtemp(prefix="bubblespec-chromium-")
    try:
        proc = await asyncio.create_subprocess_exec(
            CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
            "--disable-background-networking", "--disable-component-update", "--disable-sync",
            f"--user-data-dir={profile}", "--virtual-time-budget=5000", "--window-size=1400,900", *args,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.DEVNULL)
        try:
            out, _ = await asyncio.wait_for(proc.communicate(), timeout)
        except TimeoutError:
            proc.kill()
            await proc.wait()
            raise
        assert proc.returncode == 0, f"chromium exited with {proc.returncode}"
        return out
    finally:
        shutil.rmtree(profile, ignore_errors=True)


@pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed")
async def test_ui_renders_workers_and_timelines(ran):
    url = f"http://127.0.0.1:{ran.cluster.scheduler.http_port}/ui"
    status, content_type, page = await http_get(url)
    assert status == 200 and content_type.startswith("text/html")
    assert not re.search(rb'(src|href)\s*=\s*["\']?(https?:)?//', page), "the page must not load remote assets"
    assert b"<script src" not in page and b"<link" not in page

    dom = (await chromium("--dump-dom", url)).decode()
    rows = re.findall(r'<tr class="worker" data-worker="([^"]+)"', dom)
    assert sorted(rows) == ["worker-0", "worker-1"], "the page did not render the workers table"
    timeline = re.search(r'<div class="timeline finished" data-step="metrics-2">(.*?)</div>', dom, re.S)
    assert timeline, "no timeline for the finished step"
    for worker in ("worker-0", "worker-1"):
        lane = re.search(rf'<g class="lane" data-worker="{worker}">(.*?)</g>', timeline.group(1), re.S)
        assert lane and re.search(r'class="segment busy"', lane.group(1)), f"no busy segment for {worker}"
    assert re.search(r'<tr class="step" data-step="metrics-2">', dom)
    assert re.search(r'<span class="source" data-source="history">', dom), "no acceptance by source"
    assert 'id="conn" class="ok"' in dom

    ARTIFACTS.mkdir(exist_ok=True)
    shot = ARTIFACTS / "ui.png"
    shot.unlink(missing_ok=True)
    await chromium(f"--screenshot={shot}", url)
    data = shot.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    assert len(data) > 20_000, f"screenshot of {len(data)} bytes looks blank"
