"""Builders shared by the test tiers: prompts, requests, raw gRPC calls."""

from __future__ import annotations

import random

import grpc

from bubblespec.api.v1 import rollout_pb2 as pb
from bubblespec.api.v1 import rollout_pb2_grpc as pbg
from bubblespec.client._base import make_generate_request
from bubblespec.common.types import SamplingParams

__all__ = ["GREEDY", "call_client", "prompt_ids", "raw_generate", "token_prompts"]

GREEDY = SamplingParams(temperature=0.0, max_tokens=32)


def prompt_ids(seed: int, length: int = 8, vocab: int = 100) -> tuple[int, ...]:
    rng = random.Random(seed)
    return tuple(rng.randrange(4, vocab) for _ in range(length))


def token_prompts(count: int, seed: int = 0, length: int = 8) -> list[tuple[int, ...]]:
    return [prompt_ids(seed * 100_003 + i, length) for i in range(count)]


async def raw_generate(target: str, request: pb.GenerateRequest, timeout: float = 600.0) -> list[pb.GenerateResponse]:
    """Every message of one Generate stream, undeduplicated (to check exactly-once on the wire)."""
    async with grpc.aio.insecure_channel(target) as channel:
        stub = pbg.RolloutStub(channel)
        return [msg async for msg in stub.Generate(request, timeout=timeout)]


def generate_request(step: str, prompts, sampling: SamplingParams = GREEDY, **kw) -> pb.GenerateRequest:
    return make_generate_request(step, kw.pop("policy_version", 0), prompts, sampling, **kw)


def call_client(kind: str, settings, method: str, *args, **kwargs):
    """Run ``method`` on the sync client (``kind="sync"``) or on its async twin: same arguments, same result."""
    import asyncio

    from bubblespec.client import AsyncRolloutClient, RolloutClient

    if kind == "sync":
        with RolloutClient(settings=settings) as client:
            return getattr(client, method)(*args, **kwargs)

    async def run():
        async with AsyncRolloutClient(settings=settings) as client:
            return await getattr(client, method)(*args, **kwargs)

    return asyncio.run(run())
