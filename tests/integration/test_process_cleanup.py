"""Nothing outlives its parent: vLLM engine processes die with the process that owns them.

Real processes: ``bubblespec up --workers 1`` and ``bubblespec worker``, each with a real vLLM
CPU engine (an engine-core process that runs the model itself: ``worker/engine.py``,
``_model_in_engine_core``). The test collects
every descendant pid while the owner runs, kills the owner only (never its group), and waits
until each descendant is gone (a zombie counts as gone: it holds no memory). Before the
lifeline (``worker/lifeline.py``) the engine core (and the model-worker process it then had)
stayed alive under init after the owner's SIGKILL, about 1 GB each.

Whatever happens, the test kills everything it started (owner and collected descendants).
Run it through ``/work/tools/engine-slot`` like every engine test.
"""

from __future__ import annotations

import contextlib
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

pytestmark = pytest.mark.vllm

START_TIMEOUT = 300.0  # an engine start takes 35-90 s on two loaded cores
GONE_TIMEOUT = 30.0  # descendants gone after the owner died
SHUTDOWN_SECONDS = 60  # the owner's own bound on a SIGTERM drain (--shutdown-seconds)
ENGINE = ["--max-model-len", "256", "--max-num-seqs", "8", "--num-speculative-tokens", "4",
          "--kv-cache-memory-bytes", str(64 * 2**20)]


class Owner:
    """A ``bubblespec`` subprocess, its log, and the descendants seen while it ran."""

    def __init__(self, args: list[str], log: Path):
        self.log = log
        self._out = log.open("wb")
        self.proc = subprocess.Popen([sys.executable, "-m", "bubblespec.cli.main", *args],
                                     stdout=self._out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        self.seen: dict[int, psutil.Process] = {}

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def wait_for(self, marker: str) -> None:
        deadline = time.monotonic() + START_TIMEOUT
        while marker not in self.text():
            assert self.proc.poll() is None, f"exited ({self.proc.returncode}) before {marker!r}:\n{self.text()[-4000:]}"
            assert time.monotonic() < deadline, f"no {marker!r} after {START_TIMEOUT:.0f}s:\n{self.text()[-4000:]}"
            time.sleep(0.5)

    def descendants(self) -> list[psutil.Process]:
        """Every live descendant now (also remembered for the final clean-up)."""
        with contextlib.suppress(psutil.NoSuchProcess):
            for p in psutil.Process(self.proc.pid).children(recursive=True):
                self.seen.setdefault(p.pid, p)
        return list(self.seen.values())

    def kill_all(self) -> None:
        self.descendants()
        for p in [*self.seen.values()]:
            with contextlib.suppress(psutil.Error):
                p.kill()
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)
        self._out.close()


@contextlib.contextmanager
def owner(args: list[str], log: Path) -> Iterator[Owner]:
    o = Owner(args, log)
    try:
        yield o
    finally:
        o.kill_all()


def alive(procs: list[psutil.Process]) -> list[str]:
    out = []
    for p in procs:
        with contextlib.suppress(psutil.NoSuchProcess):
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                out.append(f"{p.pid} {' '.join(p.cmdline())[:80] or p.name()}")
    return out


def assert_all_gone(procs: list[psutil.Process]) -> None:
    deadline = time.monotonic() + GONE_TIMEOUT
    while (left := alive(procs)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not left, f"still running {GONE_TIMEOUT:.0f}s after their owner died: {left}"


def engine_descendants(o: Owner, cores: list[int] | None = None) -> list[psutil.Process]:
    """The owner's descendants: one vLLM engine core, running the model itself (no model-worker
    process), on ``cores`` where given."""
    procs = o.descendants()
    names = " | ".join(" ".join(p.cmdline()) for p in procs if p.is_running())
    cores_of = [p.cpu_affinity() for p in procs if "EngineCore" in " ".join(p.cmdline())]
    assert len(cores_of) == 1 and "Worker" not in names, f"expected one vLLM engine core and no model worker, saw: {names}"
    if cores is not None:
        assert cores_of == [cores], f"engine core on cores {cores_of[0]}, expected {cores}"
    return procs


def up_args(model: str) -> list[str]:
    return ["up", "--workers", "1", "--grpc-port", "0", "--http-port", "0", "--model", model,
            "--shutdown-seconds", str(SHUTDOWN_SECONDS), *ENGINE]


def test_up_killed_soon_after_sigterm_leaves_no_engine_process(tiny_model, tmp_path):
    """The reported case: SIGTERM, then SIGKILL a second later, before the engines shut down."""
    with owner(up_args(tiny_model), tmp_path / "up.log") as o:
        o.wait_for("BubbleSpec up:")
        procs = engine_descendants(o, cores=[0])  # `up` puts engine i on core i
        o.proc.send_signal(signal.SIGTERM)
        time.sleep(1.0)  # the scenario, not a synchronisation: the drain has begun, not ended
        o.proc.kill()
        o.proc.wait(10)
        assert_all_gone(procs)


def test_worker_killed_leaves_no_engine_process(tiny_model, tmp_path):
    """``bubblespec worker`` (no scheduler listening: it keeps redialling) killed with SIGKILL."""
    args = ["worker", "--scheduler", "127.0.0.1:9", "--metrics-port", "-1", "--worker-id", "cleanup-w",
            "--model", tiny_model, *ENGINE]
    with owner(args, tmp_path / "worker.log") as o:
        o.wait_for("vLLM engine ready")
        procs = engine_descendants(o)
        o.proc.kill()
        o.proc.wait(10)
        assert_all_gone(procs)


def test_up_sigterm_drains_and_exits_within_its_bound(tiny_model, tmp_path):
    """SIGTERM: the process stops its workers and engines and exits cleanly (status 0, so the
    drain finished before ``--shutdown-seconds`` forced it), leaving nothing behind."""
    with owner([*up_args(tiny_model), "--verbose"], tmp_path / "up-term.log") as o:
        o.wait_for("BubbleSpec up:")
        procs = engine_descendants(o)
        o.proc.send_signal(signal.SIGTERM)
        try:
            rc = o.proc.wait(SHUTDOWN_SECONDS + 30)
        except subprocess.TimeoutExpired:
            pytest.fail(f"still running {SHUTDOWN_SECONDS + 30}s after SIGTERM:\n{o.text()[-4000:]}")
        assert rc == 0, f"exit status {rc}:\n{o.text()[-4000:]}"
        assert_all_gone(procs)
    # a normal shutdown logs no error (vLLM's output is shown: --verbose; its lines name the engine core)
    text = o.text()
    assert "EngineCore" in text and "ERROR" not in text, text[-4000:]
