"""Session fixtures with real parts: redis-server, vLLM CPU engines, gRPC on loopback.

Engines start once per session (20-90 s each on 2 cores) and are shared by every test.
A plain vLLM server on the tiny model (``vllm_reference``, ``servers``) is the reference that
BubbleSpec's vLLM routes are compared with (test_vllm_reference.py, test_verifiers_client.py).
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from bubblespec.client import AsyncRolloutClient
from bubblespec.cli.commands import Cluster
from bubblespec.scheduler.settings import SchedulerSettings
from bubblespec.store import StoreSettings
from bubblespec.worker.engine import EngineSettings, VllmEngine
from bubblespec.bench.tiny_model import build_tiny_model
from tests.support.redis_server import RedisServer

MAX_LEN = 512
START_SECONDS = 600  # two loaded cores, the cluster's engines starting beside it: 35-120 s seen, often more


def engine_settings(model: str, **over) -> EngineSettings:
    """The test engines' settings. Draft lengths by acceptance alone (no measured draft token
    cost): the exactness checks must see every kind of draft proposed, garbage included, and a
    figure measured during earlier tests would hold low-acceptance drafts back (as it should in
    service) depending on what ran before. The measuring default has its own engine
    (test_paying_drafts_engine.py) and runs in the demo's subprocess (test_demo_output.py)."""
    base = dict(model=model, max_model_len=MAX_LEN, max_num_seqs=32, num_speculative_tokens=4,
                kv_cache_memory_bytes=128 * 2**20, measure_draft_cost=False, enforce_eager=True)
    base.update(over)
    return EngineSettings(**base)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> str:
    return str(build_tiny_model(tmp_path_factory.mktemp("models") / "tiny"))


@pytest.fixture(scope="session")
def redis_server():
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed")
    with RedisServer() as server:
        yield server


@pytest.fixture(scope="session")
async def cluster(tiny_model, redis_server):
    """Scheduler + 2 speculative vLLM workers + the Redis draft store, in this process."""
    settings = SchedulerSettings(host="127.0.0.1", grpc_port=0, http_port=0, tokenizer=tiny_model)
    # 2 s per Redis operation: three engines on two loaded cores once timed out a healthy write
    # at 0.5 s, and the breaker then dropped drafts a test counted on; a killed Redis still fails at once
    c = Cluster(settings, engine_settings(tiny_model), workers=2,
                store_settings=StoreSettings(url=redis_server.url, op_timeout_seconds=2.0, retry_after_seconds=1.0))
    await c.start()
    yield c
    await c.stop()


@pytest.fixture(scope="session")
async def client(cluster):
    async with AsyncRolloutClient(cluster.target) as c:
        yield c


@pytest.fixture(scope="session")
async def reference_engine(tiny_model):
    """A vLLM engine without any speculation: the ground truth for exactness."""
    engine = VllmEngine(engine_settings(tiny_model, num_speculative_tokens=0))
    await engine.start()
    yield engine
    await engine.shutdown()


class Reference:
    """The plain vLLM server: its base URL, process and log."""

    def __init__(self, port: int, process: subprocess.Popen, log: Path):
        self.url, self.process, self.log = f"http://127.0.0.1:{port}", process, log
        self.deadline = time.monotonic() + START_SECONDS

    def tail(self, lines: int = 40) -> str:
        text = self.log.read_text(errors="replace") if self.log.exists() else ""
        return "\n".join(text.splitlines()[-lines:])

    async def wait_ready(self) -> None:
        async with httpx.AsyncClient(timeout=5) as http:
            while time.monotonic() < self.deadline:
                if self.process.poll() is not None:
                    pytest.fail(f"plain vLLM exited with {self.process.returncode}; {self.log}:\n{self.tail()}")
                try:
                    if (await http.get(f"{self.url}/health")).status_code == 200:
                        return
                except httpx.TransportError:
                    pass
                await asyncio.sleep(1.0)
        pytest.fail(f"plain vLLM did not answer /health within {START_SECONDS} s; {self.log}:\n{self.tail()}")

    def stop(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait(10)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
async def vllm_reference(tiny_model, tmp_path_factory):
    """Plain vLLM on the tiny model, started before the cluster is asked for (their start-ups overlap)."""
    port, log = _free_port(), tmp_path_factory.mktemp("vllm-reference") / "server.log"
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", tiny_model, "--enable-scale-out",
           "--kv-cache-memory-bytes", str(256 * 2**20), "--host", "127.0.0.1", "--port", str(port),
           "--max-model-len", "512", "--dtype", "float32", "--logprobs-mode", "processed_logprobs", "--seed", "0",
           "--enforce-eager"]
    with log.open("wb") as out:
        process = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                   start_new_session=True)
    reference = Reference(port, process, log)
    try:
        yield reference
    finally:
        reference.stop()


@pytest.fixture
async def servers(vllm_reference, cluster, tiny_model):
    """(ours, theirs): HTTP clients of the cluster's scheduler and of plain vLLM, the cluster on the
    weights plain vLLM serves (earlier tests of the session may have loaded others)."""
    await vllm_reference.wait_ready()
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{cluster.scheduler.http_port}", timeout=300) as ours, \
            httpx.AsyncClient(base_url=vllm_reference.url, timeout=300) as theirs:
        if cluster.scheduler.core.weights_path not in ("", tiny_model):
            r = await ours.post("/update_weights", json={"weight_dir": tiny_model})
            assert r.status_code == 200, r.text
        yield ours, theirs


@pytest.fixture(autouse=True)
def _shared_engines_survive(request):
    """Fail the test during which a shared engine died (its captured output holds the engine's
    traceback), instead of the tests after it failing one by one for no visible reason."""
    yield
    if "cluster" in request.fixturenames:
        dead = [i for i, engine in enumerate(request.getfixturevalue("cluster").engines) if engine.dead]
        assert not dead, f"shared engine(s) {dead} died during this test"
