"""The settings of one ``bubblespec loadtest`` run, apart from the load test itself so that its
worker processes (``cli/loadtest_workers.py``) read them without importing the harness that
starts them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

__all__ = ["LoadSettings"]


@dataclass(frozen=True)
class LoadSettings:
    """One load-test run."""

    workers: int = 64
    """Simulated-engine workers (agents in the worker processes, each with its own gRPC stream)."""
    worker_processes: int = 0
    """Processes hosting the workers, each a share of them (0 = one per CPU core, at most ``workers``)."""
    steps: int = 20
    """Rollout steps."""
    prompts: int = 512
    """Prompts per step (fresh ones every step)."""
    samples: int = 4
    """Samples per prompt (sampling.n)."""
    capacity: int = 8
    """Requests each simulated engine runs at once (max_num_seqs, reported to the scheduler)."""
    prompt_tokens: int = 32
    """Mean prompt length in tokens (uniform in [prompt_tokens/2, 3*prompt_tokens/2])."""
    max_tokens: int = 256
    """max_tokens of every request."""
    median_tokens: int = 48
    """Median simulated response length (log-normal; EOS ends it)."""
    step_seconds: float = 0.02
    """Simulated engine step with one request running."""
    batch_slope_seconds: float = 0.0005
    """Extra simulated step time per further running request."""
    keep_steps: int = 2
    """Finished steps the scheduler keeps for resume (the service default is 4)."""
    length_history: int = 8192
    """Prompts whose response lengths the scheduler remembers (``CoreSettings.max_length_history``,
    200,000 in the service: ~90 bytes a prompt, so about 18 MiB at most). Bounded memory, not a
    leak, so the test keeps few, as for ``keep_steps``: with 4,096 new prompts a round the bound
    is reached in round 2 and the memory verdict sees the steady state."""
    policy: str = "queue"
    """Scheduling policy of every step: static | queue | longest-first."""
    update_policy: bool = True
    """Push a new policy version (UpdatePolicy barrier) before every step."""
    redis_url: str = ""
    """Redis for the scheduler journal and the workers' drafts ('' = start redis-server on a free
    port, or the in-process memory store if none is installed; 'memory' = no Redis)."""
    worker_store: Literal["redis", "memory", "none"] = "redis"
    """Workers' draft store: 'redis' (the Redis above, one client per worker, as deployed),
    'memory' (one in-process store per worker: keeps the worker processes' CPU for the agents) or
    'none' (no store: the agents neither read drafts nor record responses, the cheapest load
    generator; the scheduler's work is the same, its draft jobs aside, which simulated engines never get)."""
    completion_batch_seconds: float = 0.05
    """Every agent's ``WorkerSettings.completion_batch_seconds`` (its default): completions ending
    within this long of the agent's last completion message go in one message."""
    seed: int = 0
    """Seed of the prompts and of the sampling seeds."""
    trace_memory: bool = False
    """Run tracemalloc in the scheduler and report its largest allocation sites at the end
    (diagnosis only: it slows the scheduler down)."""
    http: bool = False
    """Drive the scheduler's ``/v1/completions`` over HTTP (``cli/loadtest_http.py``) instead of
    running steps through the SDK: ``connections`` clients, ``rounds`` calls each."""
    connections: int = 4096
    """HTTP mode: concurrent connections, each one rollout sending one call per round."""
    rounds: int = 20
    """HTTP mode: rounds; in a round every connection sends one call and gets its answer."""
    choices: int = 1
    """HTTP mode: choices per call (its ``n``)."""
    client_processes: int = 1
    """HTTP mode: processes running the HTTP clients, each a share of the connections."""
    keep_alive_seconds: float = 60.0
    """HTTP mode: the scheduler closes a connection idle this long
    (``SchedulerSettings.http_keep_alive_seconds``; the service's default is 5 s, vLLM's); the
    clients reopen one idle ``KEEP_ALIVE_MARGIN_SECONDS`` less. At 5 s most connections sat idle
    past it between their answer and the next round, and were reopened every round."""
