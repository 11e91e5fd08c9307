"""Byte limits on requests, and the bound they put on every message to a worker.

Every field a trainer sends that reaches a worker is limited in bytes as well as in count
(``Limits``); the largest message the scheduler can send a worker is then bounded
(``worker_message_bound``), and that bound must fit the scheduler's send limit and the
worker's receive limit. A 5 MiB stop string used to pass and break every worker's stream.
"""

from __future__ import annotations

import pytest

from bubblespec.api.v1 import rollout_pb2 as pb
from bubblespec.common import codec as cv
from bubblespec.common.types import Prompt, SamplingParams
from bubblespec.scheduler.core.types import InvalidRequest, ModelLimits
from bubblespec.scheduler.core.validate import (
    Limits, build_step, check_request_bytes, check_sampling, check_weights_path, worker_message_bound,
)
from bubblespec.scheduler.settings import SchedulerSettings
from bubblespec.worker.settings import WorkerSettings

MODEL = ModelLimits(max_model_len=512, vocab_size=128)
OK = SamplingParams(temperature=0.0, max_tokens=4)


def refused(fn, *args, **kw) -> InvalidRequest:
    with pytest.raises(InvalidRequest) as err:
        fn(*args, **kw)
    assert str(err.value).startswith(err.value.field + ": ") and len(str(err.value)) < 400
    return err.value


def test_a_5_mib_stop_string_is_refused_naming_it():
    sp = SamplingParams(max_tokens=4, stop=("ok", "x" * (5 * 2**20)))
    err = refused(check_sampling, sp, Limits(), MODEL)
    assert err.field == "sampling.stop[1]" and "5242880 bytes" in str(err) and "1024" in str(err)


def test_stop_strings_are_measured_in_utf8_bytes():
    limits = Limits(max_stop_string_bytes=16)
    check_sampling(SamplingParams(max_tokens=4, stop=("x" * 16,)), limits, MODEL)
    err = refused(check_sampling, SamplingParams(max_tokens=4, stop=("\N{FIRE}" * 5,)), limits, MODEL)
    assert err.field == "sampling.stop[0]" and "20 bytes" in str(err)  # 5 characters, 20 bytes


def test_stop_token_ids_are_limited_in_number():
    check_sampling(SamplingParams(max_tokens=4, stop_token_ids=(1,) * 8), Limits(max_stop_token_ids=8), MODEL)
    err = refused(check_sampling, SamplingParams(max_tokens=4, stop_token_ids=(1,) * 9), Limits(max_stop_token_ids=8), MODEL)
    assert err.field == "sampling.stop_token_ids" and "at most 8" in str(err)


@pytest.mark.parametrize("where", ["prompts", "lookahead"])
def test_text_prompts_are_limited_before_they_are_tokenized(where):
    calls = []

    def tokenize(text: str) -> tuple[int, ...]:
        calls.append(len(text))
        return (5, 6)

    big = Prompt("p0", text="y" * 101)
    kw = {"prompts": [Prompt("ok", token_ids=(5,))], "lookahead": [big]} if where == "lookahead" else {"prompts": [big]}
    err = refused(build_step, step_id="s", policy_version=0, sampling=OK, limits=Limits(max_prompt_text_bytes=100),
                  model=MODEL, tokenize=tokenize, **kw)
    assert err.field == f"{where}[0].text" and "101 bytes" in str(err)
    assert 101 not in calls, "the oversized text was never tokenized"


def test_whole_requests_and_weights_paths_are_limited():
    check_request_bytes(100, 100)
    err = refused(check_request_bytes, 101, 100)
    assert err.field == "request" and "101 bytes" in str(err)
    check_weights_path("/ckpt/step-1", Limits())
    err = refused(check_weights_path, "/x" * 3000, Limits())
    assert err.field == "weights_path" and "6000 bytes" in str(err)


def _largest_messages(limits: Limits, max_model_len: int) -> list[pb.SchedulerMessage]:
    """The biggest messages requests within ``limits`` can make the scheduler send a worker."""
    ident = "9" * 128
    top = 2**31 - 1  # every int at its widest varint
    sampling = SamplingParams(temperature=1e300, top_p=0.123456789, top_k=-1, max_tokens=top,
                              stop=tuple("\N{FIRE}" * (limits.max_stop_string_bytes // 4)
                                         for _ in range(limits.max_stop_strings)),
                              stop_token_ids=(top,) * limits.max_stop_token_ids, seed=-(2**63), n=top, ignore_eos=True,
                              min_tokens=top, include_stop_str_in_output=True, skip_special_tokens=False,
                              spaces_between_special_tokens=False, logprobs=top, logprobs_mode="processed")
    prompt = [top] * (max_model_len - 1)
    assign = pb.Assignment(request_key=f"{ident}/{ident}/{top}", step_id=ident, prompt_id=ident, sample_index=top,
                           prompt_token_ids=prompt, sampling=cv.sampling_to_pb(sampling), policy_version=2**63 - 1,
                           use_drafts=True, group_size=top)
    job = pb.DraftJob(job_id=ident, step_id=ident, prompt_token_ids=prompt, sampling=cv.sampling_to_pb(sampling),
                      policy_version=2**63 - 1)
    load = pb.LoadPolicy(version=2**63 - 1, weights_path="w" * limits.max_weights_path_bytes)
    return [pb.SchedulerMessage(assign=assign), pb.SchedulerMessage(draft_job=job), pb.SchedulerMessage(load_policy=load)]


@pytest.mark.parametrize("limits,max_model_len", [
    (Limits(), 512),
    (Limits(), 131072),
    (Limits(max_stop_strings=64, max_stop_string_bytes=65536, max_stop_token_ids=8), 1024),
    (Limits(max_stop_strings=0, max_stop_token_ids=0, max_weights_path_bytes=2**20), 16),
])
def test_no_message_to_a_worker_exceeds_the_bound(limits, max_model_len):
    bound = worker_message_bound(limits, max_model_len)
    for msg in _largest_messages(limits, max_model_len):
        assert msg.ByteSize() <= bound, (msg.WhichOneof("kind"), msg.ByteSize(), bound)


def test_default_limits_fit_the_default_message_limits():
    scheduler, worker = SchedulerSettings(), WorkerSettings()
    assert worker.max_message_bytes >= scheduler.max_message_bytes, "a worker accepts what the scheduler may send"
    assert worker_message_bound(scheduler.limits, 1_000_000) <= scheduler.max_message_bytes
    assert scheduler.limits.max_request_bytes <= scheduler.max_message_bytes
    assert worker.max_message_bytes > 4 * 2**20, "above gRPC's default receive limit"


def test_the_default_policy_is_an_enum_and_a_wrong_name_is_refused_naming_the_field():
    from bubblespec.common.types import SchedulingPolicy

    assert SchedulerSettings(default_policy="longest-first").default_policy is SchedulingPolicy.LONGEST_FIRST
    assert SchedulerSettings().default_policy is SchedulingPolicy.QUEUE
    with pytest.raises(ValueError, match="default_policy: 'fastest' is not a policy"):
        SchedulerSettings(default_policy="fastest")
