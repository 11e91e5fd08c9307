"""prime-rl's own server routes (``scheduler/prime_rl_routes.py``): ``/liveness`` answers as
prime-rl's server does; ``/init_broadcaster`` is refused by name, with the status prime-rl's NCCL
set-up reports, and changes nothing; ``/load_lora_adapter`` checks the token and its fields
(its loads run on real engines in ``tests/integration/test_lora.py``)."""

from __future__ import annotations

import logging
from types import SimpleNamespace

from fastapi import FastAPI
from fastapi.testclient import TestClient

from bubblespec.scheduler.prime_rl_routes import INIT_BROADCASTER_REFUSAL, create_router
from bubblespec.scheduler.settings import SchedulerSettings

# the body prime-rl's orchestrator sends (prime_rl.utils.client.init_nccl_broadcast)
NCCL_INIT = {"host": "10.0.0.1", "port": 29501, "rank_offset": 0, "inference_world_size": 2, "timeout": 1200,
             "quantize_in_weight_transfer": False}


def _http(token: str = "") -> tuple[TestClient, SimpleNamespace]:
    scheduler = SimpleNamespace(settings=SchedulerSettings(trainer_token=token), service=SimpleNamespace(), ready=True)
    app = FastAPI()
    app.include_router(create_router(scheduler))  # type: ignore[arg-type]
    return TestClient(app), scheduler


def test_liveness_answers_as_prime_rls_server_without_a_token():
    http, _ = _http(token="secret")
    r = http.get("/liveness")
    assert (r.status_code, r.json()) == (200, {"status": "ok"})


def test_init_broadcaster_is_refused_by_name_with_prime_rls_404(caplog):
    http, scheduler = _http()
    before = vars(scheduler).copy()
    with caplog.at_level(logging.WARNING, logger="bubblespec.scheduler.prime_rl_routes"):
        r = http.post("/init_broadcaster", json=NCCL_INIT)
    assert r.status_code == 404  # the one status prime-rl's NCCL set-up reports (it drops others silently)
    err = r.json()["error"]
    assert err == {"message": INIT_BROADCASTER_REFUSAL, "type": "NotFoundError", "param": "init_broadcaster",
                   "code": 404}
    assert "/init_broadcaster" in err["message"] and "/update_weights" in err["message"]
    assert any("init_broadcaster" in rec.getMessage() for rec in caplog.records)
    assert vars(scheduler) == before


def test_init_broadcaster_takes_the_trainer_token():
    http, _ = _http(token="secret")
    assert http.post("/init_broadcaster", json=NCCL_INIT).status_code == 401
    r = http.post("/init_broadcaster", json=NCCL_INIT, headers={"Authorization": "Bearer secret"})
    assert r.status_code == 404 and r.json()["error"]["param"] == "init_broadcaster"


def test_served_model_name_flag_names_the_model_prime_rl_asks_for(monkeypatch):
    """prime-rl checks ``/v1/models`` for its ``model.name`` (a hub id such as ``Qwen/Qwen3-0.6B``)
    and sends it as every call's ``model``: ``--served-model-name`` (or its variable) sets it."""
    import argparse

    from bubblespec.cli.commands import _scheduler_settings
    from bubblespec.cli.main import _scheduler_flags

    def settings(*argv: str) -> SchedulerSettings:
        parser = argparse.ArgumentParser()
        _scheduler_flags(parser)
        return _scheduler_settings(parser.parse_args(list(argv)))

    assert settings("--tokenizer", "/models/Qwen3-0.6B").model_name() == "Qwen3-0.6B"
    assert settings("--tokenizer", "/models/Qwen3-0.6B", "--served-model-name", "Qwen/Qwen3-0.6B").model_name() == \
        "Qwen/Qwen3-0.6B"
    monkeypatch.setenv("BUBBLESPEC_SERVED_MODEL_NAME", "Qwen/Qwen3-0.6B")
    assert settings("--tokenizer", "/models/Qwen3-0.6B").model_name() == "Qwen/Qwen3-0.6B"


def test_load_lora_adapter_takes_the_trainer_token_and_refuses_a_field_it_does_not_know():
    http, _ = _http(token="secret")
    body = {"lora_name": "math", "lora_path": "/ckpt/step_3"}  # prime_rl.utils.client.load_lora_adapter's body
    assert http.post("/load_lora_adapter", json=body).status_code == 401
    r = http.post("/load_lora_adapter", json={**body, "rank": 8}, headers={"Authorization": "Bearer secret"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "rank", r.text  # refused before any state is read
    r = http.post("/load_lora_adapter", content=b"[1]", headers={"Authorization": "Bearer secret"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "request", r.text
