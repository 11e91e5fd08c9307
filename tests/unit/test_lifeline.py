"""The lifeline (``worker/lifeline.py``) on real processes, without vLLM: a child spawned with a
``Lifeline`` among its arguments (as vLLM's engine core gets one inside its config) dies when
its parent is SIGKILLed; a copy made in the same process arms nothing."""

from __future__ import annotations

import copy
import ctypes
import json
import os
import pickle
import subprocess
import sys
import time

import pytest

from bubblespec.worker.lifeline import Lifeline

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux only")

MIDDLE = """
import multiprocessing, sys, time
from bubblespec.worker.lifeline import Lifeline

def child(config):
    import ctypes, signal
    sig = ctypes.c_int()
    ctypes.CDLL(None).prctl(2, ctypes.byref(sig))  # PR_GET_PDEATHSIG
    print(f"child {multiprocessing.current_process().pid} {sig.value}", flush=True)
    time.sleep(600)

if __name__ == "__main__":
    ctx = multiprocessing.get_context("spawn")  # as vLLM starts its engine core
    p = ctx.Process(target=child, args=({"bubblespec_lifeline": Lifeline()},))
    p.start()
    time.sleep(600)
"""


def pdeathsig() -> int:
    sig = ctypes.c_int()
    ctypes.CDLL(None).prctl(2, ctypes.byref(sig))  # PR_GET_PDEATHSIG
    return sig.value


def gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"  # a zombie holds nothing
    except FileNotFoundError:
        return True


def test_a_copy_in_the_same_process_arms_nothing():
    before = pdeathsig()
    for clone in (pickle.loads(pickle.dumps(Lifeline())), copy.deepcopy(Lifeline())):
        assert type(clone) is Lifeline and clone == {} and json.dumps(clone) == "{}"
    assert pdeathsig() == before


def test_a_spawned_child_dies_with_its_parent(tmp_path):
    script = tmp_path / "middle.py"
    script.write_text(MIDDLE)
    middle = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    child = None
    try:
        line = middle.stdout.readline().split()
        assert line[:1] == ["child"], line
        child, armed = int(line[1]), int(line[2])
        assert armed == 9  # SIGKILL when the parent dies
        middle.kill()
        middle.wait(10)
        deadline = time.monotonic() + 10
        while not gone(child) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert gone(child), "the spawned child outlived its parent"
    finally:
        if middle.poll() is None:
            middle.kill()
        if child is not None and not gone(child):
            os.kill(child, 9)


def _child_environ(config, queue) -> None:
    queue.put(os.environ.get("BUBBLESPEC_LIFELINE_TEST"))


def test_a_spawned_child_gets_the_lifeline_environment_and_this_process_does_not():
    """Per-engine environment (vLLM's CPU core binding) set in the engine process only, so that
    engines with different values can start at the same time; the config hash stays the same."""
    import multiprocessing

    lifeline = Lifeline(environ={"BUBBLESPEC_LIFELINE_TEST": "3"})
    assert json.dumps(lifeline) == "{}" and lifeline == Lifeline()
    assert copy.deepcopy(lifeline).environ == {"BUBBLESPEC_LIFELINE_TEST": "3"}
    assert "BUBBLESPEC_LIFELINE_TEST" not in os.environ  # a copy here sets nothing
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    p = ctx.Process(target=_child_environ, args=({"bubblespec_lifeline": lifeline}, queue))
    p.start()
    try:
        assert queue.get(timeout=60) == "3"
    finally:
        p.join(30)
    assert "BUBBLESPEC_LIFELINE_TEST" not in os.environ


def _child_binding(config, queue) -> None:
    import torch

    queue.put((sorted(os.sched_getaffinity(0)), torch.get_num_threads()))


@pytest.mark.parametrize("cpus", [(0,), tuple(sorted(os.sched_getaffinity(0)))])
def test_a_spawned_child_runs_on_the_lifeline_cores_with_a_thread_per_core(cpus):
    """A CPU engine whose model runs in the engine core: that process is bound to the engine's
    cores, with one torch thread per core (what vLLM's model-worker process got from OpenMP's
    environment); this process is not."""
    import multiprocessing

    before = (os.sched_getaffinity(0), os.environ.copy())
    lifeline = Lifeline(cpus=cpus)
    assert json.dumps(lifeline) == "{}" and lifeline == Lifeline()  # the config hash is the same
    assert copy.deepcopy(lifeline).cpus == cpus
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    p = ctx.Process(target=_child_binding, args=({"bubblespec_lifeline": lifeline}, queue))
    p.start()
    try:
        assert queue.get(timeout=120) == (list(cpus), len(cpus))
    finally:
        p.join(30)
    assert (os.sched_getaffinity(0), os.environ.copy()) == before
