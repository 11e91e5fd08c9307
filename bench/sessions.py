"""Multi-turn sessions through the HTTP gateway: prefill computed with and without session
affinity (``scheduler/core/affinity.py``), measured by the engines' prefix caches.

``python -m bubblespec.bench.sessions --engine sim`` (simulated engines with a simulated prefix
cache, ``bench/load_engine.py``) or ``--engine vllm`` (vLLM CPU engines on the tiny model, vLLM's
own ``num_cached_tokens``). Each run starts a cluster in this process twice, affinity on and
off (``CoreSettings.session_affinity``), and drives the same sessions through both: every
session sends its turns one after another to ``/v1/completions`` with token-id prompts, each
turn's prompt the previous prompt, the previous response and a new user message (a tool's
output, in an agent's rollout); all sessions run at once. ``--by header`` sends
``X-Session-ID`` per session (prime-rl's client does); ``--by prefix`` sends none, so the
scheduler must find the conversation by its tokens.

It prints, for each arm, the prompt tokens of the engines' finished requests, those their
prefix caches held, the prefill computed (the rest), calls per second, and the ratio of
computed prefill with affinity to without. Every call must answer 200 with one choice whose
tokens extend the session; any other answer stops the run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

__all__ = ["Arm", "main", "run_arm"]

SYSTEM_TOKENS = 32
"""A system prompt every session shares (its first tokens)."""


@dataclass(frozen=True)
class Workload:
    sessions: int = 1024
    turns: int = 8
    first_user_tokens: int = 64
    user_tokens: int = 40
    max_tokens: int = 24
    seed: int = 0


@dataclass
class Arm:
    affinity: bool
    calls: int = 0
    seconds: float = 0.0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    home: int = 0
    away: int = 0

    @property
    def computed(self) -> int:
        return self.prompt_tokens - self.cached_tokens


def _tokens(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(5, vocab) for _ in range(n)]


async def _session(http, url: str, i: int, work: Workload, vocab: int, by_header: bool, model: str,
                   system: list[int]) -> int:
    rng = random.Random(work.seed * 1_000_003 + i)
    prompt = system + _tokens(rng, work.first_user_tokens, vocab)
    headers = {"X-Session-ID": f"session-{i}"} if by_header else {}
    for turn in range(work.turns):
        body = {"prompt": prompt, "max_tokens": work.max_tokens, "temperature": 1.0,
                "seed": rng.randrange(2**31), "return_token_ids": True}
        async with http.post(url, json=body, headers=headers) as r:
            answer = await r.json()
            if r.status != 200:
                raise RuntimeError(f"session {i} turn {turn}: HTTP {r.status}: {json.dumps(answer)[:300]}")
        [choice] = answer["choices"]
        response = choice["token_ids"]
        if not response or answer["usage"]["prompt_tokens"] != len(prompt):
            raise RuntimeError(f"session {i} turn {turn}: {len(response)} tokens, usage {answer['usage']}")
        prompt = prompt + response + _tokens(rng, work.user_tokens, vocab)
    return work.turns


async def run_arm(affinity: bool, work: Workload, engine: str, workers: int, by_header: bool,
                  model_dir: str, kv_bytes: int, sim_cache_tokens: int, block_size: int = 0) -> Arm:
    """One cluster with ``affinity`` on or off, every session through it; the engines' counts."""
    import aiohttp

    from bubblespec.bench.load_engine import LoadEngineSettings, LoadTestEngine
    from bubblespec.cli.commands import Cluster
    from bubblespec.scheduler.core.settings import CoreSettings
    from bubblespec.scheduler.settings import SchedulerSettings
    from bubblespec.worker.engine import EngineSettings

    limit = 1024
    settings = SchedulerSettings(host="127.0.0.1", grpc_port=0, http_port=0,
                                 tokenizer=model_dir if engine == "vllm" else "",
                                 core=CoreSettings(session_affinity=affinity))
    factory = None
    engine_settings = EngineSettings(model=model_dir, max_model_len=limit, max_num_seqs=32,
                                     num_speculative_tokens=4, kv_cache_memory_bytes=kv_bytes, block_size=block_size)
    if engine == "sim":
        sim = LoadEngineSettings(step_seconds=0.002, batch_slope_seconds=0.00002, max_model_len=limit,
                                 max_num_seqs=64, median_tokens=work.max_tokens, progress_tokens=64,
                                 prefix_cache_tokens=sim_cache_tokens)
        factory = lambda _settings: LoadTestEngine(sim)  # noqa: E731
    cluster = Cluster(settings, engine_settings, workers=workers, engine_factory=factory)
    await cluster.start()
    try:
        vocab = cluster.scheduler.core.limits.vocab_size if engine == "vllm" else 30_000
        model = settings.model_name() if engine == "vllm" else "simulated"
        url = f"http://127.0.0.1:{cluster.scheduler.http_port}/v1/completions"
        system = _tokens(random.Random(work.seed), SYSTEM_TOKENS, vocab)
        connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=2)  # under the server's 5 s
        t0 = time.monotonic()
        async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=3600)) as http:
            turns = await asyncio.gather(*(_session(http, url, i, work, vocab, by_header, model, system)
                                           for i in range(work.sessions)))
        arm = Arm(affinity, calls=sum(turns), seconds=time.monotonic() - t0)
        aff = cluster.scheduler.core.pool.affinity
        arm.home, arm.away = (aff.placements["home"], aff.placements["away"]) if aff is not None else (0, 0)
        for e in cluster.engines:
            arm.prompt_tokens += e.prefill.prompt_tokens
            arm.cached_tokens += e.prefill.cached_tokens
        return arm
    finally:
        await cluster.stop()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bubblespec.bench.sessions", description=__doc__.split("\n\n")[0])
    p.add_argument("--engine", choices=("sim", "vllm"), default="sim")
    p.add_argument("--workers", type=int, default=0, help="default: 8 simulated, 2 vLLM")
    p.add_argument("--sessions", type=int, default=1024)
    p.add_argument("--turns", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=24)
    p.add_argument("--by", choices=("header", "prefix"), default="header")
    p.add_argument("--kv-cache-mib", type=int, default=1024, help="vLLM: KV cache per engine")
    p.add_argument("--block-size", type=int, default=32,
                   help="vLLM: tokens per KV block, the prefix cache's unit (vLLM's CPU default is 128; 0 = that)")
    p.add_argument("--sim-cache-tokens", type=int, default=0,
                   help="simulated prefix cache per engine (default: 1.5x the sessions' final tokens / workers)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default="", help="write the figures here")
    a = p.parse_args(argv)
    workers = a.workers or (8 if a.engine == "sim" else 2)
    work = Workload(a.sessions, a.turns, max_tokens=a.max_tokens, seed=a.seed)
    final = SYSTEM_TOKENS + work.first_user_tokens + (work.turns - 1) * (work.max_tokens + work.user_tokens)
    sim_cache = a.sim_cache_tokens or int(1.5 * final * work.sessions / workers)
    model_dir = ""
    if a.engine == "vllm":
        from bubblespec.bench.tiny_model import build_tiny_model

        model_dir = str(build_tiny_model(Path(tempfile.mkdtemp(prefix="bubblespec-sessions-")) / "tiny"))
    print(f"{work.sessions} sessions x {work.turns} turns, {workers} {a.engine} workers, sessions told by {a.by}; "
          f"final prompts up to {final} tokens; prefix cache per worker: "
          + (f"{sim_cache} tokens (simulated)" if a.engine == "sim"
             else f"{a.kv_cache_mib} MiB of KV in blocks of {a.block_size or 'the default'} tokens (vLLM)"),
          flush=True)
    arms = []
    for affinity in (True, False):
        arm = asyncio.run(run_arm(affinity, work, a.engine, workers, a.by == "header", model_dir,
                                  a.kv_cache_mib * 2**20, sim_cache, a.block_size))
        arms.append(arm)
        print(f"affinity {'on ' if affinity else 'off'}: {arm.calls} calls in {arm.seconds:.1f}s "
              f"({arm.calls / arm.seconds:.0f}/s); prompt tokens {arm.prompt_tokens}, cached {arm.cached_tokens} "
              f"({arm.cached_tokens / max(1, arm.prompt_tokens):.1%}), prefill computed {arm.computed}"
              + (f"; turns placed on their worker {arm.home}, elsewhere {arm.away}" if affinity else ""), flush=True)
    on, off = arms
    fewer = 1 - on.computed / max(1, off.computed)
    print(f"prefill computed with affinity / without: {on.computed / max(1, off.computed):.3f} "
          f"({fewer:.1%} fewer; target >= 60% fewer)")
    if a.json:
        Path(a.json).write_text(json.dumps({"workload": work.__dict__, "engine": a.engine, "workers": workers,
                                            "by": a.by, "arms": [dict(arm.__dict__, computed=arm.computed) for arm in arms],
                                            "fewer": fewer}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
