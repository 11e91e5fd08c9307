"""``bubblespec bench`` as a user runs it, in its smallest configuration: a short story on the
terminal (what starts, a line per arm and step, the table, what the numbers mean), vLLM's output
(this process's and the engine process's) in the log file it names. Real subprocess, a real vLLM
CPU engine, the four arms of two steps of two short prompts.

``--model`` names a tiny model built here, so the workload model is not trained (its cache is
tested in tests/unit/test_rlvr_model_cache.py). HOME is a temporary directory: the log file is
written there. Run it through ``/work/tools/engine-slot`` like every engine test.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from bubblespec.bench.tiny_model import build_tiny_model

pytestmark = pytest.mark.vllm

TIMEOUT = 600.0  # one engine start (35-90 s on two loaded cores) and eight short steps
SMALLEST = ["--workers", "1", "--steps", "2", "--prompts", "2", "--samples", "1", "--max-tokens", "16",
            "--lookahead-steps", "1", "--train-seconds", "0", "--max-model-len", "512"]


def test_bench_tells_a_short_story_and_logs_vllm_to_a_file(tmp_path):
    model = build_tiny_model(tmp_path / "tiny")
    env = {**os.environ, "HOME": str(tmp_path), "VLLM_LOGGING_LEVEL": "INFO"}  # vLLM's default (the suite sets WARNING)
    env.pop("BUBBLESPEC_VERBOSE", None)
    report = tmp_path / "bench.json"
    done = subprocess.run([sys.executable, "-m", "bubblespec.cli.main", "bench", "--model", str(model), *SMALLEST,
                           "--json", str(report)], env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True,
                          timeout=TIMEOUT, check=False)
    terminal = done.stdout + done.stderr
    assert done.returncode == 0, terminal[-4000:]
    assert len(terminal.splitlines()) < 40, terminal
    found = re.search(r"vLLM's output goes to (\S+\.log)", terminal)
    assert found, terminal
    log = Path(found.group(1))
    assert log.parent == tmp_path / ".cache" / "bubblespec" / "logs" and log.name.startswith("bench-")
    text = log.read_text(errors="replace")
    for marker in ("(MainProcess pid=", "(EngineCore pid=", "Initializing a V1 LLM engine",
                   "Loading safetensors checkpoint shards"):
        assert marker in text, marker
    for noise in ("(EngineCore", "(MainProcess", "(Worker", "Triton", "NUMA", "RotaryEmbedding", "safetensors",
                  "force killing", "Traceback", " INFO "):
        assert noise not in terminal, (noise, terminal)
    steps = [f"{arm} step {s}:" for arm in ("baseline", "queue", "static+drafts", "bubblespec") for s in (1, 2)]
    for story in ("bubblespec bench: the same 2 RL steps (2 prompts x 1 samples", "the engines start in parallel",
                  "engine 1/1 ready after", "Cluster up in", *steps, "Stopped the cluster", "acceptance by source",
                  "What the numbers mean", "Here BubbleSpec ran the steps", "every arm's outputs equal the baseline's",
                  f"Wrote the report (every step, every worker) to {report}", "The bench took"):
        assert story in terminal, (story, terminal)
    rows = [line for line in terminal.splitlines() if re.match(r"\s*(baseline|queue|static\+drafts|bubblespec)\s+[\d.]+s ", line)]
    assert len(rows) == 4 and all(" True " in row for row in rows), rows  # the table: every arm exact
    assert "baseline step 1:" in text  # the story is in the log file too
    assert [t["arm"] for t in json.loads(report.read_text())["summary"]] == ["baseline", "queue", "static+drafts",
                                                                              "bubblespec"]
    print(terminal)  # the story, for the record (-s)
