"""Session fixtures with real parts: redis-server, vLLM CPU engines, gRPC on loopback.

Engines start once per session (20-90 s each on 2 cores) and are shared by every test.
"""

from __future__ import annotations

import shutil

import pytest

from bubblespec.client import AsyncRolloutClient
from bubblespec.cli.commands import Cluster
from bubblespec.scheduler.settings import SchedulerSettings
from bubblespec.store import StoreSettings
from bubblespec.worker.engine import EngineSettings, VllmEngine
from bubblespec.bench.tiny_model import build_tiny_model
from tests.support.redis_server import RedisServer

MAX_LEN = 512


def engine_settings(model: str, **over) -> EngineSettings:
    """The test engines' settings. Draft lengths by acceptance alone (no measured draft token
    cost): the exactness checks must see every kind of draft proposed, garbage included, and a
    figure measured during earlier tests would hold low-acceptance drafts back (as it should in
    service) depending on what ran before. The measuring default has its own engine
    (test_paying_drafts_engine.py) and runs in the demo's subprocess (test_demo_output.py)."""
    base = dict(model=model, max_model_len=MAX_LEN, max_num_seqs=32, num_speculative_tokens=4,
                kv_cache_memory_bytes=128 * 2**20, measure_draft_cost=False)
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


@pytest.fixture(autouse=True)
def _shared_engines_survive(request):
    """Fail the test during which a shared engine died (its captured output holds the engine's
    traceback), instead of the tests after it failing one by one for no visible reason."""
    yield
    if "cluster" in request.fixturenames:
        dead = [i for i, engine in enumerate(request.getfixturevalue("cluster").engines) if engine.dead]
        assert not dead, f"shared engine(s) {dead} died during this test"
