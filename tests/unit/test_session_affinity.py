"""Session affinity (``core/affinity.py``): a conversation's next turn goes to the worker that
holds its prefix while that worker has room; a full or gone worker loses it."""

from __future__ import annotations

from bubblespec.common.types import Prompt, SamplingParams
from bubblespec.scheduler.core.affinity import Affinity, prefix_hashes
from bubblespec.scheduler.core.types import Assign, Deliver
from bubblespec.scheduler.core.validate import Limits, build_step

from tests.unit.test_core import LIMITS, complete, hello, make_core, of


def call(prompt: tuple[int, ...], max_tokens: int = 16):
    return build_step(step_id="http-x", policy_version=0, prompts=[Prompt("p", token_ids=prompt)],
                      sampling=SamplingParams(temperature=0.0, max_tokens=max_tokens), limits=Limits(), model=LIMITS)


def conversation(i: int, length: int = 70) -> tuple[int, ...]:
    """A prompt of ``length`` tokens that no other conversation shares beyond its first token."""
    return tuple(3 + (i * 7 + j * (i + 1)) % 90 for j in range(length))


def test_prefix_hashes_are_a_chain_over_full_blocks():
    a = prefix_hashes(list(range(10)), block=4)
    b = prefix_hashes(list(range(8)) + [99, 98, 97], block=4)
    assert len(a) == 2 and a == b  # the 2 full blocks agree; the partial third is not hashed
    assert prefix_hashes([1, 2, 3], block=4) == []
    assert prefix_hashes([9, 1, 2, 3, 4], block=4)[0] != prefix_hashes([1, 2, 3, 4], block=4)[0]


def test_session_and_prefix_lookup_and_the_bound():
    aff = Affinity(max_entries=2, block=4)
    prompt = tuple(range(10, 22))
    assert aff.submitted(["k1"], prompt, "s1") is None  # nothing known yet
    aff.finished("k1", prompt, (40, 41, 42, 43), "w1")
    assert aff.wanted == {} and aff.session_of == {}
    assert aff.submitted(["k2"], (50, 51), "s1") == "w1"  # by session id, whatever the tokens
    assert aff.submitted(["k3"], prompt + (40, 41, 42, 43, 7), "") == "w1"  # extends prompt + response
    assert aff.submitted(["k4"], prompt + (77, 78, 79, 80), "") == "w1"  # the prompt, another response
    assert aff.submitted(["k7"], prompt[:8] + (77, 78, 79, 80), "") is None  # only ends of turns are kept
    assert aff.submitted(["k5"], (1, 2, 3, 4, 5), "") is None
    aff.dropped("k7")
    assert aff.wanted == {"k2": "w1", "k3": "w1", "k4": "w1"}
    aff.placed("k2", "w1")
    aff.dropped("k3")
    assert aff.wanted == {"k4": "w1"}
    for i in range(3):  # the bound: oldest sessions and prefixes forgotten first
        aff.submitted([f"s{i}"], (), f"other{i}")
        aff.finished(f"s{i}", (), (), f"w{i}")
    assert aff.sizes()[0] == 2 and aff.sizes()[1] <= 2
    assert aff.submitted(["k6"], (), "s1") is None


def _turns(core, prompts: dict[int, tuple[int, ...]], sessions: bool) -> dict[int, str]:
    """Submit one turn per conversation, run every request to the end; the worker of each."""
    keys = {}
    assigns = []
    for i, prompt in prompts.items():
        k, actions = core.submit_requests(call(prompt), session_id=f"s{i}" if sessions else "")
        keys[k[0]] = i
        assigns += of(actions, Assign)
    where = {}
    while assigns:
        a = assigns.pop(0)
        where[keys[a.request.key]] = a.worker_id
        actions = complete(core, a, tokens=5)
        assigns += of(actions, Assign)
        assert len(of(actions, Deliver)) == 1
    return where


def test_turns_follow_their_session_to_its_worker():
    core, _ = make_core()
    for w in "abcd":
        core.add_worker(hello(w, capacity=4))
    first = _turns(core, {i: conversation(i, 8) for i in range(8)}, sessions=True)
    assert len(set(first.values())) == 4  # spread over the workers
    # next turn: other tokens, in another order; each session goes back to its worker
    second = _turns(core, {i: conversation(100 + i, 8) for i in reversed(range(8))}, sessions=True)
    assert second == first


def test_without_a_session_id_a_prompt_extending_an_earlier_turn_follows_it():
    core, _ = make_core()
    for w in "abcd":
        core.add_worker(hello(w, capacity=4))
    prompts = {i: conversation(i) for i in range(8)}
    first = _turns(core, prompts, sessions=False)
    response = tuple(range(5))  # what ``complete`` answers
    second = _turns(core, {i: prompts[i] + response + (9, 9) for i in reversed(range(8))}, sessions=False)
    assert second == first
    off, _ = make_core(session_affinity=False)  # the same with affinity off: placement by load alone
    for w in "abcd":
        off.add_worker(hello(w, capacity=4))
    first_off = _turns(off, prompts, sessions=False)
    second_off = _turns(off, {i: prompts[i] + response + (9, 9) for i in reversed(range(8))}, sessions=False)
    assert second_off != first_off and off.pool.affinity is None


def test_a_full_or_gone_worker_loses_the_turn_and_a_freed_slot_takes_its_own_first():
    core, _ = make_core()
    core.add_worker(hello("a", capacity=1))
    core.add_worker(hello("b", capacity=1))
    first = _turns(core, {0: conversation(0, 8), 1: conversation(1, 8)}, sessions=True)
    assert sorted(first.values()) == ["a", "b"]
    home = first[0]
    other = "b" if home == "a" else "a"
    # both workers busy with other calls; an older call and session 0's next turn wait
    running = {a.worker_id: a for p in ((50, 51), (52, 53)) for a in of(core.submit_requests(call(p))[1], Assign)}
    assert set(running) == {"a", "b"}
    k_older, _ = core.submit_requests(call((60, 61)))
    k_turn, actions = core.submit_requests(call(conversation(200, 8)), session_id="s0")
    assert not of(actions, Assign)
    # the home worker's slot frees first: it takes the turn that prefers it, ahead of the older call
    [a] = of(complete(core, running[home]), Assign)
    assert a.worker_id == home and a.request.key == k_turn[0]
    # the other worker's slot frees: it takes the older call (nothing prefers it)
    [b] = of(complete(core, running[other]), Assign)
    assert b.worker_id == other and b.request.key == k_older[0]
    complete(core, a)
    complete(core, b)
    # the home worker leaves: the session's next turn runs on the other one
    core.remove_worker(home, "gone")
    assert home not in core.pool.affinity.wanted_by and home not in core.pool.affinity._sessions.values()
    [c] = of(core.submit_requests(call(conversation(300, 8)), session_id="s0")[1], Assign)
    assert c.worker_id == other
