"""LoRA adapters as named policies in the pure core (``core/adapters.py``, ``core/pool.py``):
vLLM's load and unload checks, a version per load, a failed load changing nothing, requests
naming an adapter going only to workers that hold its version, and sibling groups that never
cross adapters or versions."""

from __future__ import annotations

from dataclasses import replace

import pytest
from bubblespec.scheduler.core.adapters import AdapterTable
from bubblespec.scheduler.core.pool import POOL
from bubblespec.scheduler.core.types import Assign, ErrorCode, InvalidRequest, RequestFailed
from bubblespec.store import prompt_key

from tests.unit.test_core import complete, hello, make_core, of
from tests.unit.test_request_pool import call


def loaded(table: AdapterTable, name: str, workers=("a",), path: str = "/lora", inplace: bool = False):
    plan = table.begin_load(name, path, "base", inplace)
    return table.finish_load(plan, set(workers))


def test_versions_count_loads_of_a_name_and_each_load_gets_a_new_engine_id():
    t = AdapterTable()
    first = loaded(t, "math")
    assert (first.version, first.int_id) == (1, 1) and t.resolve("math") == ("math", 1)
    again = loaded(t, "math", path="/lora2", inplace=True)
    assert (again.version, again.int_id, again.path) == (2, 2, "/lora2") and t.resolve("math") == ("math", 2)
    other = loaded(t, "code")
    assert (other.version, other.int_id) == (1, 3)
    assert t.resolve("base") is None and t.resolve("nope") is None


@pytest.mark.parametrize(("name", "path", "inplace", "field", "words"), [
    ("", "/p", False, "lora_name", "Both 'lora_name' and 'lora_path' must be provided"),
    ("x", "", False, "lora_name", "Both 'lora_name' and 'lora_path' must be provided"),
    ("base", "/p", False, "lora_name", "conflicts with a served base model"),
    ("a b", "/p", False, "lora_name", "without whitespace"),
    ("a@1", "/p", False, "lora_name", "'@'"),
    (7, "/p", False, "lora_name", "must be a string"),
    ("x", ["/p"], False, "lora_path", "must be a string"),
])
def test_a_bad_load_is_refused_naming_the_field_and_changes_nothing(name, path, inplace, field, words):
    t = AdapterTable()
    with pytest.raises(InvalidRequest) as err:
        t.begin_load(name, path, "base", inplace)
    assert err.value.field == field and words in str(err.value)
    assert not t.loading and not t.served


def test_a_loaded_name_reloads_only_in_place_as_vllm():
    t = AdapterTable()
    loaded(t, "math")
    with pytest.raises(InvalidRequest, match="already been loaded.*load_inplace"):
        t.begin_load("math", "/p", "base", False)
    assert t.resolve("math") == ("math", 1) and not t.loading


def test_a_failed_load_leaves_the_adapter_as_it_was():
    t = AdapterTable()
    loaded(t, "math", workers=("a", "b"))
    plan = t.begin_load("math", "/bad", "base", True)
    assert "math" in t.loading and t.resolve("math") == ("math", 1)  # the old version serves meanwhile
    with pytest.raises(InvalidRequest, match="being loaded"):
        t.begin_load("math", "/p", "base", True)
    t.abandon_load(plan)
    assert not t.loading and t.resolve("math") == ("math", 1) and t.served["math"].path == "/lora"
    assert t.holds("a", ("math", 1)) and not t.holds("a", ("math", 2))
    first = t.begin_load("new", "/bad", "base")
    t.abandon_load(first)
    assert t.resolve("new") is None and "new" not in t.served


def test_unload_as_vllm_and_holders():
    t = AdapterTable()
    with pytest.raises(InvalidRequest) as err:
        t.unload("math")
    assert err.value.code == ErrorCode.NOT_FOUND and "cannot be found" in str(err.value)
    with pytest.raises(InvalidRequest, match="needs to be provided"):
        t.unload("")
    loaded(t, "math", workers=("a", "b"))
    loaded(t, "math", workers=("a",), inplace=True)
    assert t.holds("a", ("math", 2)) and not t.holds("b", ("math", 2)) and t.holds("b", ("math", 1))
    loaded(t, "math", workers=("a",), inplace=True)
    assert set(t.served["math"].holders) == {2, 3}  # workers keep the previous version only
    t.left("a")
    assert not t.holds("a", ("math", 3))
    t.unload("math")
    assert t.resolve("math") is None and not t.holds("a", ("math", 3))


def test_requests_with_an_adapter_go_only_to_workers_that_hold_its_version():
    core, _ = make_core()
    core.add_worker(hello("a", capacity=4))
    core.add_worker(hello("b", capacity=4))
    adapters = core.pool.adapters
    loaded(adapters, "math", workers=("b",))
    _, actions = core.submit_requests(replace(call((5, 6), n=3), adapter=("math", 1)))
    assigns = of(actions, Assign)
    assert {a.worker_id for a in assigns} == {"b"} and len(assigns) == 3
    assert all(a.request.adapter == ("math", 1) for a in assigns)


def test_a_request_for_an_adapter_not_served_or_held_is_refused_naming_model():
    core, _ = make_core()
    core.add_worker(hello("a", capacity=4))
    with pytest.raises(InvalidRequest) as err:
        core.submit_requests(replace(call((5, 6)), adapter=("math", 1)))
    assert err.value.field == "model" and err.value.code == ErrorCode.NOT_FOUND
    loaded(core.pool.adapters, "math", workers=("gone",))
    with pytest.raises(InvalidRequest) as err:
        core.submit_requests(replace(call((5, 6)), adapter=("math", 1)))
    assert err.value.code == ErrorCode.UNAVAILABLE and "no connected worker holds" in str(err.value)
    assert core.pool.pending == 0


def test_sibling_groups_never_cross_adapters_or_versions():
    core, _ = make_core()
    core.add_worker(hello("a", capacity=16))
    adapters = core.pool.adapters
    loaded(adapters, "math")
    base, _ = core.submit_requests(call((5, 6), n=2))
    v1, _ = core.submit_requests(replace(call((5, 6), n=2), adapter=("math", 1)))
    loaded(adapters, "math", inplace=True)
    v2, _ = core.submit_requests(replace(call((5, 6)), adapter=("math", 2)))
    base2, _ = core.submit_requests(call((5, 6)))
    assert base == [f"{POOL}/g0/0", f"{POOL}/g0/1"] and base2 == [f"{POOL}/g0/2"]
    assert v1 == [f"{POOL}/g1/0", f"{POOL}/g1/1"] and v2 == [f"{POOL}/g2/0"]


def test_the_store_keys_of_a_prompt_differ_by_adapter_and_version():
    prompt = (5, 6, 7)
    keys = {prompt_key(prompt), prompt_key(prompt, ("math", 1)), prompt_key(prompt, ("math", 2)),
            prompt_key(prompt, ("code", 1))}
    assert len(keys) == 4 and prompt_key(prompt, ("math", 1)) == prompt_key(list(prompt), ("math", 1))


def test_unload_fails_the_queued_requests_naming_model_and_lets_running_ones_finish():
    core, _ = make_core()
    core.add_worker(hello("a", capacity=1))
    loaded(core.pool.adapters, "math")
    keys, actions = core.submit_requests(replace(call((5, 6), n=3), adapter=("math", 1)))
    running = of(actions, Assign)
    assert len(running) == 1
    failed = core.pool.unload_adapter("math")
    assert sorted(f.key for f in of(failed, RequestFailed)) == sorted(k for k in keys if k != running[0].request.key)
    assert all(f.field == "model" and "unloaded" in f.message for f in of(failed, RequestFailed))
    done = complete(core, running[0])
    assert core.pool.pending == 0 and done  # the running one was delivered


def test_an_adapters_requests_are_never_moved():
    from bubblespec.scheduler.core.moves import Mover

    core, _ = make_core()
    core.add_worker(hello("a", capacity=4))
    loaded(core.pool.adapters, "math")
    _, actions = core.submit_requests(replace(call((5, 6)), adapter=("math", 1)))
    req = core.steps[POOL].requests[of(actions, Assign)[0].request.key]
    assert not Mover._movable(core.steps[POOL], req)
    _, actions = core.submit_requests(call((5, 7)))
    base = core.steps[POOL].requests[of(actions, Assign)[0].request.key]
    assert Mover._movable(core.steps[POOL], base)


def test_a_worker_that_joins_loads_the_current_version_of_each_adapter_and_only_then_holds_it():
    core, _ = make_core()
    core.add_worker(hello("a", capacity=4))
    t = core.pool.adapters
    loaded(t, "math")
    loaded(t, "math", path="/lora2", inplace=True)
    core.add_worker(hello("late", capacity=4))
    plan = t.missing("late", "math")
    assert (plan.name, plan.path, plan.version, plan.int_id) == ("math", "/lora2", 2, 2)
    assert t.missing("a", "math") is None and t.missing("late", "nope") is None
    assert not t.holds("late", ("math", 2))  # not before its load
    _, actions = core.submit_requests(replace(call((5, 6), n=2), adapter=("math", 2)))
    assert {a.worker_id for a in of(actions, Assign)} == {"a"}
    assert t.joined("late", plan) and t.holds("late", ("math", 2)) and t.missing("late", "math") is None
    loaded(t, "math", inplace=True)  # a later load: a plan of an older version no longer counts
    assert not t.joined("late", plan) and not t.holds("late", ("math", 3))


def test_a_load_failed_on_join_is_kept_and_named_where_no_worker_can_serve_the_adapter():
    core, _ = make_core()
    core.add_worker(hello("late", capacity=4))
    t = core.pool.adapters
    loaded(t, "math", workers=("gone",))
    t.join_failed("late", t.missing("late", "math"), "lora_path: '/lora' is not a directory on this worker")
    with pytest.raises(InvalidRequest) as err:
        core.submit_requests(replace(call((5, 6)), adapter=("math", 1)))
    assert err.value.code == ErrorCode.UNAVAILABLE and err.value.field == "model"
    assert "worker late could not load it: lora_path: '/lora' is not a directory" in str(err.value)
    core.remove_worker("late")  # a worker that leaves takes its failure with it
    assert t.served["math"].failed == {}
