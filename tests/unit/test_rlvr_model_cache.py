"""The trained workload model's cache (``bench.rlvr.is_trained`` / ``ensure_trained``, used by
``bubblespec bench``): a finished training run of the same recipe is reused, anything else is
trained again, and an interrupted training leaves nothing a later run would take for trained.

Real training (two optimizer steps of a small configuration, seconds on a CPU)."""

from __future__ import annotations

import asyncio
import json
from dataclasses import replace

import pytest

from bubblespec.bench import rlvr
from bubblespec.bench.tiny_model import build_tiny_model
from bubblespec.cli.bench import FIRST_TRAINING, workload_model

SMALL = rlvr.TrainSettings(steps=2, batch_tokens=512, pool_size=64, warmup_steps=2, log_every=0)


def test_a_finished_run_of_the_same_recipe_is_a_hit_and_is_not_trained_again(tmp_path):
    path = tmp_path / "rlvr-model"
    stats = rlvr.ensure_trained(path, settings=SMALL)
    assert stats is not None and stats["path"] == str(path)
    weights = (path / "model.safetensors").read_bytes()
    mtime = (path / "model.safetensors").stat().st_mtime_ns
    assert rlvr.is_trained(path, settings=SMALL)
    assert rlvr.is_trained(path, settings=replace(SMALL, log_every=50))  # logging is not part of the recipe
    assert rlvr.ensure_trained(path, settings=SMALL) is None  # the hit: nothing trained
    assert (path / "model.safetensors").stat().st_mtime_ns == mtime
    assert (path / "model.safetensors").read_bytes() == weights
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rlvr-model"]  # no work directories left


def test_another_recipe_is_a_miss_and_is_trained_in_place_of_the_old_one(tmp_path):
    path = tmp_path / "rlvr-model"
    rlvr.ensure_trained(path, settings=SMALL)
    for other in (replace(SMALL, steps=3), replace(SMALL, lr=1e-3)):
        assert not rlvr.is_trained(path, settings=other)
    assert not rlvr.is_trained(path, seed=1, settings=SMALL)
    assert not rlvr.is_trained(path, settings=SMALL, task=rlvr.TaskSettings(max_terms=20))
    stats = rlvr.ensure_trained(path, settings=replace(SMALL, steps=3))
    assert stats is not None and stats["settings"]["steps"] == 3
    assert rlvr.is_trained(path, settings=replace(SMALL, steps=3)) and not rlvr.is_trained(path, settings=SMALL)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rlvr-model"]


def test_a_built_but_untrained_model_and_broken_records_are_misses(tmp_path):
    build_tiny_model(tmp_path / "built")  # model.safetensors with random weights: what training starts from
    assert (tmp_path / "built" / "model.safetensors").is_file()
    assert not rlvr.is_trained(tmp_path / "built", settings=SMALL)
    assert not rlvr.is_trained(tmp_path / "absent", settings=SMALL)
    path = tmp_path / "rlvr-model"
    rlvr.ensure_trained(path, settings=SMALL)
    record = path / "rlvr_training.json"
    good = record.read_text()
    for broken in ("{not json", "[]", json.dumps({**json.loads(good), "task": None})):
        record.write_text(broken)
        assert not rlvr.is_trained(path, settings=SMALL), broken
    record.write_text(good)
    (path / "model.safetensors").unlink()
    assert not rlvr.is_trained(path, settings=SMALL)


def test_an_interrupted_training_leaves_the_cache_as_it_was(tmp_path, monkeypatch):
    path = tmp_path / "rlvr-model"

    def interrupted(work, seed, **kw):
        build_tiny_model(work)  # the random weights are written, then the user presses Ctrl-C
        raise KeyboardInterrupt

    monkeypatch.setattr(rlvr, "train_rlvr_model", interrupted)
    with pytest.raises(KeyboardInterrupt):
        rlvr.ensure_trained(path, settings=SMALL)
    assert list(tmp_path.iterdir()) == []
    assert not rlvr.is_trained(path, settings=SMALL)


def test_bench_says_it_trains_first_and_how_long_that_takes_then_reuses_the_model(tmp_path):
    path = tmp_path / "rlvr-model"
    lines: list[str] = []
    assert asyncio.run(workload_model(lines.append, path, settings=SMALL)) == str(path)
    assert lines[0] == f"Training the workload model into {path} ({FIRST_TRAINING})..."
    assert "minutes" in FIRST_TRAINING and lines[-1].startswith("  trained in ")
    lines.clear()
    assert asyncio.run(workload_model(lines.append, path, settings=SMALL)) == str(path)
    assert lines == [f"Workload model: {path} (trained by an earlier run)."]
