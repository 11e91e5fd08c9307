"""``bubblespec.integrations.trl`` without a cluster: the lookahead's prompt replay, the callback's
announcements (to a recorder, and to a real gRPC servicer on loopback), its failure handling,
and the directory weight sync against a stub HTTP server.

The replay is checked against TRL itself: a real ``GRPOTrainer`` run (transformers generation,
no vLLM) whose generated prompts must equal what the callback announced for those rounds.
"""

from __future__ import annotations

import json
import logging
import threading
from concurrent import futures
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import SimpleNamespace

import grpc
import pytest
import torch
from safetensors.torch import load_file
from torch.utils.data import DataLoader, RandomSampler
from trl.trainer.utils import RepeatSampler

from bubblespec.api.v1 import rollout_pb2 as pb
from bubblespec.api.v1 import rollout_pb2_grpc as pbg
from bubblespec.client import SamplingParams
from bubblespec.integrations.trl import (
    BubbleSpecLookahead, DirectoryWeightSync, PromptSchedule, RoundShape, lookahead_sampling, replayable_copy,
)
from bubblespec.worker.checkpoint import check_checkpoint, read_checkpoint
from bubblespec.bench.tiny_model import build_tiny_model

PROMPTS = [f"{a}+{b}=" for a in range(4) for b in range(3)]  # 12 text prompts


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    return str(build_tiny_model(tmp_path_factory.mktemp("trl") / "tiny"))


@pytest.fixture(scope="module")
def tokenizer(tiny):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny)


class Recorder:
    """Stands in for ``RolloutClient``: records each ``announce``, or raises ``fail``."""

    def __init__(self, fail: Exception | None = None):
        self.calls: list[tuple[list[list[int]], SamplingParams]] = []
        self.fail = fail

    def announce(self, prompts, sampling):
        if self.fail is not None:
            raise self.fail
        self.calls.append(([list(p) for p in prompts], sampling))
        return len(prompts)


def _trainer_rounds(sampler, shape: RoundShape, epochs: int) -> list[list[int]]:
    """What GRPOTrainer generates from: global batches of the sampler's stream, one round every
    ``batches_per_round`` batches, ``prompts[::num_generations]`` of it."""
    rounds, batches = [], 0
    for _ in range(epochs):
        stream = list(sampler)
        for start in range(0, len(stream), shape.items_per_round):
            if batches % shape.batches_per_round == 0:
                rounds.append(stream[start:start + shape.items_per_round][::shape.repeats])
            batches += 1
    return rounds


def test_next_round_counts_generations_started_by_optimizer_steps():
    default = RoundShape(items_per_round=8, repeats=2, batches_per_round=1, grad_accum=1)
    assert [default.next_round(g) for g in range(4)] == [0, 1, 2, 3]
    # 4 batches per round, 2 per optimizer step: a round every other step
    spread = RoundShape(items_per_round=8, repeats=2, batches_per_round=4, grad_accum=2)
    assert [spread.next_round(g) for g in range(6)] == [0, 1, 1, 2, 2, 3]
    with pytest.raises(ValueError, match="items_per_round"):
        RoundShape(items_per_round=6, repeats=4)
    with pytest.raises(ValueError, match="grad_accum"):
        RoundShape(items_per_round=4, grad_accum=0)


@pytest.mark.parametrize("shuffle", [True, False])
def test_schedule_replays_the_repeat_sampler_across_epochs(shuffle):
    sampler = RepeatSampler(list(range(10)), mini_repeat_count=2, batch_size=3, repeat_count=2, shuffle=shuffle,
                            seed=7)
    shape = RoundShape(items_per_round=6, repeats=2, batches_per_round=2)
    schedule = PromptSchedule(replayable_copy(sampler), shape)  # copied before the trainer iterates
    expected = _trainer_rounds(sampler, shape, epochs=3)  # 3 rounds per epoch (a partial chunk dropped)
    assert len(expected) == 9 and all(len(r) == 3 for r in expected)
    assert [schedule.round(r) for r in range(9)] == expected
    assert schedule.round(3) == expected[3]  # asking again: the same round
    if shuffle:
        assert expected[0] != expected[3]  # each epoch draws a new order, and the replay follows it


def test_samplers_whose_order_is_not_knowable_are_not_replayed():
    assert replayable_copy(RandomSampler(list(range(5)))) is None
    assert replayable_copy(None) is None


def _args(tmp_path, **over):
    from trl import GRPOConfig

    base = {"output_dir": str(tmp_path), "report_to": "none", "use_cpu": True, "per_device_train_batch_size": 4,
                "num_generations": 2, "max_completion_length": 8, "temperature": 0.7, "top_p": 0.9, "top_k": 5, "max_steps": 4}
    base.update(over)
    return GRPOConfig(**base)


def _state(global_step=0, max_steps=4, main=True):
    from transformers import TrainerState

    state = TrainerState(max_steps=max_steps, is_world_process_zero=main)
    state.global_step = global_step
    return state


def _dataloader(args, shuffle=True):
    dataset = [{"prompt": p} for p in PROMPTS]
    sampler = RepeatSampler(dataset, mini_repeat_count=args.num_generations,
                            batch_size=args.generation_batch_size // args.num_generations,
                            repeat_count=args.num_iterations * args.steps_per_generation, shuffle=shuffle, seed=args.seed)
    return DataLoader(dataset, batch_size=args.generation_batch_size, sampler=sampler, collate_fn=list)


def test_callback_announces_the_next_rounds_token_ids_with_the_trainer_sampling(tmp_path, tokenizer):
    args = _args(tmp_path)
    loader = _dataloader(args)
    trained_rounds = [[row["prompt"] for row in batch][::2] for batch in loader]  # the trainer's order (epoch 1)
    rec = Recorder()
    cb = BubbleSpecLookahead(steps=2, client=rec)
    cb.on_train_begin(args, _state(0), None, train_dataloader=_dataloader(args), processing_class=tokenizer)
    assert cb.exact is True

    def ids(r: int) -> list[list[int]]:
        return [list(t) for t in tokenizer(text=trained_rounds[r])["input_ids"]]

    assert [c[0] for c in rec.calls] == [ids(0), ids(1)]
    assert rec.calls[0][1] == SamplingParams(temperature=0.7, top_p=0.9, top_k=5, max_tokens=8, n=2)
    cb.on_step_end(args, _state(1), None)  # rounds 1 and 2 are next: only round 2 is new
    assert [c[0] for c in rec.calls] == [ids(0), ids(1), ids(2)]
    cb.on_step_end(args, _state(3), None)  # round 4 would be past max_steps
    assert [c[0] for c in rec.calls][3:] == [ids(3)]
    assert sorted(cb.announced_rounds) == [0, 1, 2, 3]
    assert cb.accepted == 4 * 2 and cb.failures == 0


def test_callback_is_silent_off_the_main_process_and_warns_when_the_order_is_unknown(tmp_path, tokenizer, caplog):
    args = _args(tmp_path)
    rec = Recorder()
    cb = BubbleSpecLookahead(client=rec)
    cb.on_train_begin(args, _state(0, main=False), None, train_dataloader=_dataloader(args), processing_class=tokenizer)
    cb.on_step_end(args, _state(1, main=False), None)
    assert rec.calls == []
    loader = DataLoader([{"prompt": p} for p in PROMPTS], batch_size=4, shuffle=True, collate_fn=list)
    unknown = BubbleSpecLookahead(client=rec)
    with caplog.at_level(logging.WARNING, logger="bubblespec.integrations.trl"):
        unknown.on_train_begin(args, _state(0), None, train_dataloader=loader, processing_class=tokenizer)
    assert unknown.exact is False and rec.calls == []
    assert "cannot be known in advance (sampler RandomSampler)" in caplog.text


def test_failed_announcements_are_logged_counted_and_retried_without_stopping_training(tmp_path, tokenizer, caplog):
    from bubblespec.client import ServiceUnavailable

    args = _args(tmp_path)
    rec = Recorder(fail=ServiceUnavailable("scheduler is draining"))
    cb = BubbleSpecLookahead(steps=2, client=rec)
    with caplog.at_level(logging.WARNING, logger="bubblespec.integrations.trl"):
        cb.on_train_begin(args, _state(0), None, train_dataloader=_dataloader(args), processing_class=tokenizer)
        cb.on_step_end(args, _state(1), None)
    assert cb.failures == 2 and cb.announced_rounds == {}
    assert "scheduler is draining" in cb.last_error
    assert caplog.text.count("announcing generation round") == 2 and "scheduler is draining" in caplog.text
    rec.fail = None
    cb.on_step_end(args, _state(1), None)  # the scheduler is back: the missed rounds go out
    assert sorted(cb.announced_rounds) == [1, 2] and cb.failures == 2
    with pytest.raises(ValueError, match="steps"):
        BubbleSpecLookahead(steps=0)


class _AnnounceServicer(pbg.RolloutServicer):
    def __init__(self):
        self.requests: list[tuple[pb.AnnounceRequest, dict]] = []

    def Announce(self, request, context):
        self.requests.append((request, dict(context.invocation_metadata())))
        return pb.AnnounceResponse(accepted=len(request.prompts))


def test_callback_announces_over_real_grpc_with_the_trainer_token(tmp_path, tokenizer):
    servicer = _AnnounceServicer()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    pbg.add_RolloutServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        args = _args(tmp_path)
        cb = BubbleSpecLookahead(f"127.0.0.1:{port}", token="s3cret", steps=1)
        cb.on_train_begin(args, _state(0), None, train_dataloader=_dataloader(args), processing_class=tokenizer)
        cb.on_train_end(args, _state(0), None)
    finally:
        server.stop(None)
    [(request, metadata)] = servicer.requests
    assert metadata["authorization"] == "Bearer s3cret"
    assert [list(p.token_ids.ids) for p in request.prompts] == cb.announced_rounds[0]
    assert request.sampling.temperature == pytest.approx(0.7) and request.sampling.max_tokens == 8
    assert cb.accepted == 2


def test_unreachable_scheduler_costs_a_warning_not_the_run(tmp_path, tokenizer, caplog):
    args = _args(tmp_path)
    cb = BubbleSpecLookahead("127.0.0.1:9", steps=1, timeout_seconds=0.5)  # nothing listens on port 9
    with caplog.at_level(logging.WARNING, logger="bubblespec.integrations.trl"):
        cb.on_train_begin(args, _state(0), None, train_dataloader=_dataloader(args), processing_class=tokenizer)
    cb.on_train_end(args, _state(0), None)
    assert cb.failures == 1 and "127.0.0.1:9" in caplog.text


def test_lookahead_matches_what_a_real_grpo_trainer_generates(tmp_path, tiny, tokenizer):
    """GRPOTrainer (transformers generation, no vLLM, CPU): every round it generates after the
    first is one the callback announced beforehand, token for token."""
    from datasets import Dataset
    from trl import GRPOTrainer

    args = _args(tmp_path, max_steps=3, per_device_train_batch_size=2, gradient_accumulation_steps=2,
                 max_completion_length=3, logging_steps=1, save_strategy="no", seed=3)
    rec = Recorder()
    cb = BubbleSpecLookahead(steps=1, client=rec)
    trainer = GRPOTrainer(model=tiny, reward_funcs=lambda completions, **kw: [float(len(c)) for c in completions],
                          args=args, train_dataset=Dataset.from_list([{"prompt": p} for p in PROMPTS]),
                          processing_class=tokenizer, callbacks=[cb])
    generated: list[list[list[int]]] = []
    real = trainer._generate_single_turn

    def spy(prompt_ids, *a, **kw):
        generated.append([list(p) for p in prompt_ids[::args.num_generations]])
        return real(prompt_ids, *a, **kw)

    trainer._generate_single_turn = spy
    trainer.train()
    assert cb.exact is True and cb.failures == 0
    assert len(generated) == 3  # one round per step (steps_per_generation = gradient_accumulation_steps)
    assert cb.announced_rounds[0] == generated[0]
    for r in (1, 2):
        assert cb.announced_rounds[r] == generated[r], f"round {r}"


# ----------------------------------------------------------------------------- directory weight sync


class _StubServer(ThreadingHTTPServer):
    """Answers what TRL's VLLMClient asks at construction, records ``/update_weights``."""

    def __init__(self, server_info: dict):
        super().__init__(("127.0.0.1", 0), _StubHandler)
        self.server_info, self.updates, self.auth = server_info, [], []


class _StubHandler(BaseHTTPRequestHandler):
    def log_message(self, *args):
        pass

    def _answer(self, code: int, body: dict | None) -> None:
        raw = json.dumps(body).encode() if body is not None else b""
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(raw)))
        self.end_headers()
        self.wfile.write(raw)

    def do_GET(self):
        self.server.auth.append(self.headers.get("Authorization"))
        answers = {"/health": None, "/v1/models": {"data": [{"id": "tiny"}]}, "/get_world_size": {"world_size": 1},
                   "/server_info": {"vllm_config": self.server.server_info}}
        path = self.path.split("?")[0]
        self._answer(200, answers[path]) if path in answers else self._answer(404, {"detail": "Not Found"})

    def do_POST(self):
        self.server.auth.append(self.headers.get("Authorization"))
        body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
        if self.path == "/update_weights":
            self.server.updates.append(body)
            self._answer(200, {"version": len(self.server.updates)})
        else:
            self._answer(404, {"detail": "Not Found"})


@pytest.fixture
def stub():
    server = _StubServer({"weight_transfer_config": {"backend": "nccl"}, "model_config": {"logprobs_mode": "processed_logprobs"}})
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


def _generation_kwargs(tiny, tokenizer, url):
    from accelerate import Accelerator
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny)
    return {"model": model, "accelerator": Accelerator(cpu=True), "processing_class": tokenizer, "mode": "server",
                "server_base_url": url, "server_timeout": 5.0}


def test_trls_own_server_mode_refuses_a_cpu_trainer(stub, tiny, tokenizer):
    """What blocks TRL's NCCL weight sync on CPU, quoted: with no weight-transfer backend (the
    scheduler's default) TRL refuses first for that; with one, for the CPU device."""
    from trl.generation.vllm_generation import VLLMGeneration

    url = f"http://127.0.0.1:{stub.server_address[1]}"
    with pytest.raises(NotImplementedError, match="needs a CUDA device, got 'cpu'"):
        VLLMGeneration(**_generation_kwargs(tiny, tokenizer, url))
    stub.server_info = {**stub.server_info, "weight_transfer_config": None}
    with pytest.raises(RuntimeError, match="has no weight-transfer engine"):
        VLLMGeneration(**_generation_kwargs(tiny, tokenizer, url))
    # DirectoryWeightSync joins no NCCL group: it constructs against the same server
    assert DirectoryWeightSync(weights_root=tiny + "-w", **_generation_kwargs(tiny, tokenizer, url)).vllm_client.model == "tiny"


def test_directory_sync_writes_a_loadable_checkpoint_and_posts_it(stub, tiny, tokenizer, tmp_path):
    kwargs = _generation_kwargs(tiny, tokenizer, f"http://127.0.0.1:{stub.server_address[1]}")
    sync = DirectoryWeightSync(weights_root=tmp_path / "weights", token="tok", keep=2, **kwargs)
    start = read_checkpoint(tiny)
    posted = []
    for _ in range(3):
        with torch.no_grad():
            kwargs["model"].model.norm.weight.add_(1.0)  # "a training step"
        sync.sync_weights()
        posted.append(stub.updates[-1]["weight_dir"])
        check_checkpoint(posted[-1], start)  # what a worker checks before loading: complete, same shapes
        saved = load_file(f"{posted[-1]}/model.safetensors")
        assert torch.equal(saved["model.norm.weight"], kwargs["model"].model.norm.weight)
    assert [u for u in stub.updates] == [{"weight_dir": p} for p in posted] and len(set(posted)) == 3
    assert [Path(p).exists() for p in posted] == [False, True, True]  # keep=2
    assert sync.synced_dirs == [Path(p) for p in posted]
    # TRL polls /health with a bare requests.get (open, like vLLM's); every other call carries the token
    assert stub.auth == [None] + ["Bearer tok"] * (len(stub.auth) - 1) and len(stub.auth) == 5


def test_installed_swaps_trls_generation_only_inside_the_block(tmp_path):
    import trl.trainer.grpo_trainer as grpo

    original = grpo.VLLMGeneration
    with DirectoryWeightSync.installed(tmp_path, token="t", keep=3) as factory:
        assert grpo.VLLMGeneration is factory
        assert factory.keywords == {"weights_root": tmp_path, "token": "t", "keep": 3}
    assert grpo.VLLMGeneration is original


def test_lookahead_sampling_follows_generation_kwargs(tmp_path):
    args = SimpleNamespace(temperature=1.0, top_p=1.0, top_k=0, max_completion_length=16, num_generations=4,
                           generation_kwargs={"temperature": 0.0, "max_tokens": 5})
    assert lookahead_sampling(args) == SamplingParams(temperature=0.0, top_p=1.0, top_k=-1, max_tokens=5, n=4)
