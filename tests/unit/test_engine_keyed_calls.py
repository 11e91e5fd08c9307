"""``worker/engine.py``'s ``KeyedCalls``: the proposer's per-request stats, one engine RPC for
the requests that finish together (``VllmEngine._provenance``)."""

from __future__ import annotations

import asyncio

import pytest

from bubblespec.worker.engine import KeyedCalls


class Rpc:
    """A stand-in for the engine RPC: records each call's keys, answers from ``values`` after
    ``release`` is set (or at once), or raises ``fail`` for the calls numbered in it."""

    def __init__(self, values: dict, fail: dict[int, Exception] | None = None):
        self.values, self.fail = values, fail or {}
        self.calls: list[list[str]] = []
        self.release = asyncio.Event()
        self.release.set()

    async def __call__(self, keys: list[str]) -> dict:
        self.calls.append(keys)
        await self.release.wait()
        if len(self.calls) - 1 in self.fail:
            raise self.fail[len(self.calls) - 1]
        return {k: self.values[k] for k in keys if k in self.values}


def test_keys_asked_for_together_go_in_one_call_and_each_gets_its_own_value():
    async def main():
        rpc = Rpc({"a": 1, "b": 2, "c": 3})
        calls = KeyedCalls(rpc)
        got = await asyncio.gather(calls.get("a"), calls.get("b"), calls.get("c"), calls.get("x"))
        assert got == [1, 2, 3, None]  # a key the engine has no stats for: None, as before
        assert rpc.calls == [["a", "b", "c", "x"]]

    asyncio.run(main())


def test_keys_asked_for_while_a_call_runs_go_together_in_the_next():
    async def main():
        rpc = Rpc({k: k.upper() for k in "abcd"})
        rpc.release.clear()
        calls = KeyedCalls(rpc)
        first = asyncio.ensure_future(calls.get("a"))
        await asyncio.sleep(0.01)
        assert rpc.calls == [["a"]]  # in flight
        later = [asyncio.ensure_future(calls.get(k)) for k in "bcd"]
        await asyncio.sleep(0.01)
        assert rpc.calls == [["a"]]  # one call at a time
        rpc.release.set()
        assert await first == "A"
        assert await asyncio.gather(*later) == ["B", "C", "D"]
        assert rpc.calls == [["a"], ["b", "c", "d"]]

    asyncio.run(main())


def test_a_failed_call_fails_its_own_keys_only_and_the_next_call_is_made():
    async def main():
        rpc = Rpc({"a": 1, "b": 2}, fail={0: RuntimeError("engine core gone")})
        rpc.release.clear()
        calls = KeyedCalls(rpc)
        first = asyncio.ensure_future(calls.get("a"))
        await asyncio.sleep(0.01)
        second = asyncio.ensure_future(calls.get("b"))
        rpc.release.set()
        with pytest.raises(RuntimeError, match="engine core gone"):
            await first
        assert await second == 2
        assert rpc.calls == [["a"], ["b"]]
        assert await calls.get("a") == 1  # and later calls go on as usual

    asyncio.run(main())


def test_a_cancelled_caller_leaves_the_others_their_values():
    async def main():
        rpc = Rpc({"a": 1, "b": 2})
        rpc.release.clear()
        calls = KeyedCalls(rpc)
        a, b = asyncio.ensure_future(calls.get("a")), asyncio.ensure_future(calls.get("b"))
        await asyncio.sleep(0.01)
        a.cancel()
        rpc.release.set()
        assert await b == 2
        assert a.cancelled()

    asyncio.run(main())


def test_when_the_call_itself_is_cancelled_every_waiting_key_gets_an_error_not_a_hang():
    async def main():
        rpc = Rpc({"a": 1, "b": 2})
        rpc.release.clear()
        calls = KeyedCalls(rpc)
        a = asyncio.ensure_future(calls.get("a"))
        await asyncio.sleep(0.01)
        b = asyncio.ensure_future(calls.get("b"))  # waits for the next call
        await asyncio.sleep(0)
        calls._running.cancel()  # e.g. the loop shutting down
        for f in (a, b):
            with pytest.raises(RuntimeError, match="cancelled"):
                await asyncio.wait_for(f, 1)
        rpc.release.set()
        assert await calls.get("b") == 2  # a new call starts for later keys

    asyncio.run(main())
