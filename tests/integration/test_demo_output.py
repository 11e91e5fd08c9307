"""``bubblespec demo`` as README's first command runs it (no flags, no model: it builds the tiny
one): a short story on the terminal, vLLM's output (this process's and the engine processes')
in the log file it names. Real subprocess, two real vLLM CPU engines started in parallel.

HOME is a temporary directory, so the tiny model and the log file are written there.
Run it through ``/work/tools/engine-slot`` like every engine test.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.vllm

TIMEOUT = 600.0  # two engine starts (35-90 s each on two loaded cores) and two short steps


def test_demo_tells_a_short_story_and_logs_vllm_to_a_file(tmp_path):
    env = {**os.environ, "HOME": str(tmp_path), "VLLM_LOGGING_LEVEL": "INFO"}  # vLLM's default (the suite sets WARNING)
    env.pop("BUBBLESPEC_VERBOSE", None)
    env.pop("BUBBLESPEC_ENFORCE_EAGER", None)  # the README's command as it is: engines compile (tests/conftest.py)
    done = subprocess.run([sys.executable, "-m", "bubblespec.cli.main", "demo", "--prompts", "8"], env=env,
                          stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=TIMEOUT, check=False)
    terminal = done.stdout + done.stderr
    assert done.returncode == 0, terminal[-4000:]
    lines = terminal.splitlines()
    assert len(lines) < 40, terminal
    found = re.search(r"vLLM's output goes to (\S+\.log)", terminal)
    assert found, terminal
    log = Path(found.group(1))
    assert log.parent == tmp_path / ".cache" / "bubblespec" / "logs"
    text = log.read_text(errors="replace")
    # vLLM's loggers in this process and in both engine processes; C++/tqdm output of the engines
    for marker in ("(MainProcess pid=", "(EngineCore pid=", "Initializing a V1 LLM engine",
                   "the model runs in the engine-core process, on cores [0]",  # each engine its own core
                   "the model runs in the engine-core process, on cores [1]",
                   "Loading safetensors checkpoint shards", "[shutdown]"):
        assert marker in text, marker
    for noise in ("(EngineCore", "(MainProcess", "(Worker", "Triton", "NUMA", "RotaryEmbedding", "safetensors",
                  "force killing", "Traceback"):
        assert noise not in terminal, (noise, terminal)
    for story in ("the engines start in parallel", "engine 1/2 ready after", "engine 2/2 ready after", "Cluster up in",
                  "randomly initialised", "step 1: 16 completions", "step 2: 16 completions", "fwd/tok",
                  "What the numbers mean", "Stopped the cluster"):
        assert story in terminal, (story, terminal)
    assert "step 1: 16 completions" in text  # the story is in the log file too
    print(terminal)  # the story, for the record (-s)
