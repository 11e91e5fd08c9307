"""``Cluster`` (``up``, ``demo``, ``bench``) imports vLLM in a thread, not on its event loop: the
import takes 5-15 s on a two-core CPU, and on the loop it would stop the scheduler that the
cluster has already started (gRPC, HTTP, ticks) for that long.

A fresh interpreter (vLLM not imported yet) imports the real vLLM; an import hook records on
which thread vLLM's import began. The engine is a stand-in that imports vLLM in ``start``
where ``VllmEngine.start`` does, so an import left to the engine would begin on the loop.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent("""
    import asyncio, sys, threading

    first = []

    class Spy:
        def find_spec(self, name, path=None, target=None):
            if name == "vllm" and not first:
                first.append("main thread" if threading.current_thread() is threading.main_thread() else "other thread")
            return None

    sys.meta_path.insert(0, Spy())
    import bubblespec.worker.engine as engine_module
    from bubblespec.cli.commands import Cluster
    from bubblespec.scheduler.settings import SchedulerSettings
    from bubblespec.worker.engine import EngineSettings

    class LikeVllmEngine:
        def __init__(self, settings):
            self.settings = settings

        async def start(self):
            import vllm  # noqa: F401  (where VllmEngine.start imports it)

    engine_module.VllmEngine = LikeVllmEngine
    assert "vllm" not in sys.modules
    cluster = Cluster(SchedulerSettings(), EngineSettings(model="unused", self_checks=False), 1)
    asyncio.run(cluster._start_engines())
    print("vllm import began on the", first[0])
""")


def test_the_cluster_imports_vllm_off_its_event_loop():
    done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "vllm import began on the other thread" in done.stdout, done.stdout + done.stderr[-3000:]
