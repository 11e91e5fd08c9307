"""A step's fingerprint is what a scheduler restarted mid-step compares with the one its
journal holds: ``sha256(repr((policy_version, prompts, sampling, lookahead, policy.value,
use_drafts)))``, first 32 hex digits. Digests written by earlier schedulers must still match."""

from __future__ import annotations

import hashlib
from dataclasses import replace

from bubblespec.common.types import Prompt, SamplingParams, SchedulingPolicy
from bubblespec.scheduler.core.types import InvalidRequest, ModelLimits, StepSpec
from bubblespec.scheduler.core.validate import Limits, build_step

MODEL = ModelLimits(max_model_len=40, vocab_size=100)


def repr_fingerprint(spec: StepSpec) -> str:
    text = repr((spec.policy_version, spec.prompts, spec.sampling, spec.lookahead, spec.policy.value, spec.use_drafts))
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def test_fingerprints_of_journals_written_before_still_match():
    """Digests computed by the scheduler of 2026-11-24 (the journal of a step mid-run holds
    them): the same steps give the same fingerprints."""
    sampling = SamplingParams(temperature=0.7, top_p=0.9, max_tokens=16, stop=("\N{FIRE}", "é\n"), seed=2**62 - 1, n=4,
                              logprobs_mode="processed")
    prompts = [Prompt("p0", token_ids=(5,), max_tokens=0), Prompt("p1", token_ids=(0, 99, 7), max_tokens=3),
               Prompt("é".encode().hex(), token_ids=tuple(range(30)), max_tokens=9)]
    cases = {
        "97083a9a3ffcc44de02f0f335b363788": dict(prompts=prompts, lookahead=[]),
        "52e6c6b7d178b642314165204f23024d": dict(prompts=prompts[:1], lookahead=[Prompt("x", token_ids=(1, 2))]),
        "d7caa25b248faf957208dbf1d68c4b97": dict(prompts=prompts[1:], lookahead=[Prompt("x", token_ids=(3,))],
                                                 policy=SchedulingPolicy.LONGEST_FIRST, use_drafts=False),
        "51e2582a685b432f7668896cc9d04acf": dict(prompts=[Prompt("t", text="hé")], lookahead=[Prompt("u", text="")]),
    }
    for digest, kw in cases.items():
        spec = build_step(step_id="s", policy_version=3, sampling=sampling, limits=Limits(), model=MODEL,
                          tokenize=lambda text: tuple(ord(c) % 100 for c in text) or (1,), **kw)
        assert (spec.fingerprint, repr_fingerprint(spec)) == (digest, digest)


def test_an_independent_call_gets_no_fingerprint_and_the_same_validation():
    """``resumable=False`` (HTTP calls and the SDK's ``Complete``: never resumed by their id):
    no fingerprint, every other field as a step's, and bad input refused the same way."""
    sampling = SamplingParams(temperature=0.7, max_tokens=16)
    kw = dict(step_id="s", policy_version=3, prompts=[Prompt("p0", token_ids=(5, 6))], sampling=sampling,
              limits=Limits(), model=MODEL)
    step, call = build_step(**kw), build_step(**kw, resumable=False)
    assert len(step.fingerprint) == 32 and call.fingerprint == ""
    assert replace(call, fingerprint=step.fingerprint) == step
    for bad in ((5, 100), (5, True), ()):
        errors = []
        for resumable in (True, False):
            try:
                build_step(**{**kw, "prompts": [Prompt("p0", token_ids=bad)]}, resumable=resumable)
            except InvalidRequest as exc:
                errors.append((exc.field, exc.message))
        assert len(errors) == 2 and errors[0] == errors[1], bad
