"""Engine processes die with the process that owns them, whatever kills it.

vLLM 0.32 starts its engine core with multiprocessing ``spawn`` (a fresh interpreter), and the
engine core starts its model-worker processes, where it has any, the same way (a CPU engine with
one worker has none: the model runs in the engine core, ``worker/engine.py``). The model workers watch the engine
core (a death pipe), but nothing makes the engine core watch *its* parent: a worker or
``bubblespec up`` process killed by SIGKILL or the OOM killer, or one that exits before its
engines finished shutting down, left the engine core and its model workers running under
init (about 1 GB each).

The lifeline: ``Lifeline()`` goes into the engine's vLLM config (``additional_config``). Spawn
pickles that config into every child; unpickling it in the child (before vLLM builds anything)
calls ``_arm(parent_pid)``, which asks the kernel to SIGKILL the child when its parent dies
(``prctl(PR_SET_PDEATHSIG, SIGKILL)``) and exits at once if the parent is already gone. The
engine core re-pickles the config for its model workers, so they get the same guarantee with
respect to the engine core: killing the owner takes the whole tree down, within milliseconds,
and needs nothing from the owner when it dies.

One caveat: Linux delivers the parent-death signal when the *thread* that started the child
exits, not the process. Engines are therefore started from ``STARTER``, a pool whose threads
live as long as the process (asyncio's default executor would do today, but its threads are
not promised to live that long); several engines start at once, each from its own thread.
On other systems ``_arm`` does nothing.

A ``Lifeline`` also carries environment variables for the child (``Lifeline(environ=...)``),
set there at the same early moment: per-engine settings that vLLM reads from the engine
process's environment (the CPU cores it binds to) without changing this process's
environment, so engines with different settings can start concurrently. And, for a CPU engine
whose model runs in the engine core itself (``Lifeline(cpus=...)``, ``worker/engine.py``), the
cores that process runs on, with one model thread per core: vLLM sets that up only for a
model-worker process, through OpenMP's environment before it starts; in the engine core OpenMP
is loaded already (with torch, before the config is unpickled), so ``_bind`` makes the calls.

``exit_after(seconds)`` bounds a graceful shutdown: if draining has not finished by then, the
process exits, and the lifeline takes its engines with it.
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import logging
import os
import signal
import sys
import threading
from typing import Any

__all__ = ["STARTER", "Lifeline", "exit_after"]

logger = logging.getLogger(__name__)
_PR_SET_PDEATHSIG = 1

STARTER = concurrent.futures.ThreadPoolExecutor(max_workers=32, thread_name_prefix="bubblespec-engine-start")
"""The threads that start engine processes (one per engine starting at the same time): an idle
pool thread waits for the next start and only exits with the interpreter."""


def _set_parent_death_signal(sig: int) -> bool:
    if not sys.platform.startswith("linux"):
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
        logger.warning("prctl(PR_SET_PDEATHSIG) failed: errno %d", ctypes.get_errno())
        return False
    return True


def _bind(cpus: tuple[int, ...]) -> None:
    """This process's threads from now on run on ``cpus``, and torch's intra-op pool has one
    thread per core (vLLM's CPU worker blocks ``torch.set_num_threads`` once it starts)."""
    import torch

    os.sched_setaffinity(0, cpus)  # the calling thread; threads it starts later inherit it
    torch.set_num_threads(len(cpus))


def _arm(parent_pid: int, items: dict, environ: dict[str, str] | None = None, cpus: tuple[int, ...] = ()) -> Lifeline:
    """Runs where a ``Lifeline`` is unpickled: in a child process, tie its life to the parent,
    set the environment variables it carries and bind it to its cores."""
    if os.getpid() != parent_pid:
        if _set_parent_death_signal(signal.SIGKILL) and os.getppid() != parent_pid:
            os.kill(os.getpid(), signal.SIGKILL)  # the parent died before the signal was armed
        os.environ.update(environ or {})
        if cpus:
            _bind(cpus)
    return Lifeline(items, environ=environ, cpus=cpus)


class Lifeline(dict):
    """A marker for vLLM's ``additional_config``: an (empty) dict, so the config still hashes
    and serializes as before; unpickled in another process, it arms the parent-death signal
    there and sets ``environ`` in that process's environment (``_arm``). A copy made in the
    same process (deepcopy) arms and sets nothing."""

    def __init__(self, *args: Any, environ: dict[str, str] | None = None, cpus: tuple[int, ...] = (), **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.environ = dict(environ or {})
        """Environment variables for the child processes (not part of the dict: the config
        hash stays the same whatever they are)."""
        self.cpus = tuple(cpus)
        """Cores the child processes run on, one torch thread per core; () = left as they are."""

    def __reduce__(self) -> tuple[Any, tuple]:
        return _arm, (os.getpid(), dict(self), self.environ, self.cpus)


def exit_after(seconds: float, what: str = "shutdown") -> threading.Timer:
    """Force the process out ``seconds`` from now (a daemon timer: it does not wait for the
    event loop, which may be the thing that is stuck). Cancel it when the shutdown finished."""

    def expire() -> None:
        logger.error("%s did not finish within %.0fs: exiting now (engine processes die with this one)", what, seconds)
        logging.shutdown()
        os._exit(1)

    timer = threading.Timer(seconds, expire)
    timer.daemon = True
    timer.start()
    return timer
