"""The scheduler's cheaper per-completion paths give the same results as the plain ones:
decoding a worker's completion, sealing a journal record, queueing journal writes."""

from __future__ import annotations

import asyncio
import hashlib
import hmac

import pytest

from bubblespec.api.v1 import rollout_pb2 as pb
from bubblespec.common import codec as cv
from bubblespec.common.types import Completion, FinishReason, Provenance, SourceStats
from bubblespec.scheduler.core.types import InvalidRequest
from bubblespec.scheduler.journal import _DOMAIN, StepJournal
from bubblespec.scheduler.pending import Pending
from bubblespec.store import StoreSettings


def _plain_decode(msg: pb.Completion) -> Completion:
    """Field by field, with keywords (what ``completion_from_pb`` computes)."""
    return Completion(
        step_id=msg.step_id, prompt_id=msg.prompt_id, sample_index=msg.sample_index, token_ids=tuple(msg.token_ids),
        logprobs=tuple(msg.logprobs), text=msg.text,
        finish_reason={pb.FINISH_REASON_LENGTH: FinishReason.LENGTH}.get(msg.finish_reason, FinishReason.STOP),
        policy_version=msg.policy_version, worker_id=msg.worker_id, prompt_tokens=msg.prompt_tokens,
        provenance=Provenance(msg.provenance.forward_passes, tuple(
            SourceStats(s.source, s.drafted_tokens, s.accepted_tokens) for s in msg.provenance.sources)))


def test_a_decoded_completion_equals_the_field_by_field_decoding():
    sources = (SourceStats("history", 6, 4), SourceStats("future", 2, 0))
    cases = [Completion("s", "p", 3, (5, 6, 2), (-0.5, -0.25, -1.0), "hi", FinishReason.STOP, 7, "w", 12, Provenance(3)),
             Completion("s", "p", 0, (5,), (), "", FinishReason.LENGTH, 0, "", 0, Provenance(1, sources)),
             Completion("s", "q", 1, (), (), "", FinishReason.STOP, 1, "w2", 4, Provenance())]
    for c in cases:
        msg = cv.completion_to_pb(c)
        assert cv.completion_from_pb(msg) == _plain_decode(msg) == c
    odd = cv.completion_to_pb(cases[0])
    odd.finish_reason = 99  # unknown to this version: decoded as STOP
    assert cv.completion_from_pb(odd) == _plain_decode(odd)
    assert cv.completion_from_pb(odd).finish_reason is FinishReason.STOP
    # completions without draft sources share one immutable Provenance per forward-pass count
    a, b = (cv.completion_from_pb(cv.completion_to_pb(cases[0])) for _ in range(2))
    assert a.provenance is b.provenance and a.provenance == Provenance(3)


def test_a_journal_mac_is_the_hmac_of_the_length_prefixed_key_field_and_value():
    secret = b"k" * 32
    journal = StepJournal(StoreSettings(url="redis://127.0.0.1:1"), secret)
    for key, field, payload in [("P{sched}:step:s", "s/p0/0", b"\x00\x01payload"), ("P{sched}:policy", "", b""),
                                ("k" * 300, "f\u00e9", bytes(range(256)) * 5)]:
        parts = [_DOMAIN]
        for part in (key.encode(), field.encode(), payload):
            parts += [len(part).to_bytes(8, "big"), part]
        expected = hmac.new(secret, b"".join(parts), hashlib.sha256).digest()
        assert journal._mac(key, field, payload) == expected  # the keyed state reused, twice
        assert journal._mac(key, field, payload) == expected
        assert journal._open(key, field, journal._seal(key, field, payload)) == payload
        assert journal._open(key, field + "x", journal._seal(key, field, payload)) is None


async def test_queued_journal_writes_are_taken_all_at_once_in_order():
    writes = Pending()
    waiter = asyncio.ensure_future(writes.wait())
    await asyncio.sleep(0)
    assert not waiter.done()  # nothing queued: the writer waits
    for i in range(5):
        writes.put_nowait(("hset", "k", f"f{i}", b"v"))
    await asyncio.wait_for(waiter, 5)
    assert [w[2] for w in writes.take()] == ["f0", "f1", "f2", "f3", "f4"]
    assert writes.take() == []
    waiter = asyncio.ensure_future(writes.wait())
    await asyncio.sleep(0)
    assert not waiter.done()  # taken: it waits again
    writes.put_nowait(("expire", "k", 5))
    await asyncio.wait_for(waiter, 5)
    assert writes.take() == [("expire", "k", 5)]


async def test_a_step_subscriber_gets_the_completions_waiting_at_once_as_one_list_in_order():
    from bubblespec.common.types import StepSummary
    from bubblespec.scheduler.core.types import StepFailed
    from bubblespec.scheduler.service import END, _items

    def done(i: int) -> Completion:
        return Completion("s", f"p{i}", 0, (5,), (), "", FinishReason.STOP, 0)

    summary = StepSummary("s", 0, 3, 1.0, 3)
    inbox = Pending()
    stream = _items(inbox)
    reader = asyncio.ensure_future(anext(stream))
    await asyncio.sleep(0)
    assert not reader.done()  # nothing published yet
    for i in range(2):
        inbox.put_nowait(done(i))
    assert await asyncio.wait_for(reader, 5) == [done(0), done(1)]
    for item in (done(2), summary, END):
        inbox.put_nowait(item)
    assert [item async for item in stream] == [[done(2)], summary]  # the summary after the completions, then the end

    failing = Pending()
    for item in (done(0), StepFailed("s", "prompts[1]", "failed"), END):
        failing.put_nowait(item)
    stream = _items(failing)
    assert await anext(stream) == [done(0)]
    with pytest.raises(InvalidRequest) as failed:
        await anext(stream)
    assert failed.value.field == "prompts[1]"
