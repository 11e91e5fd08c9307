"""``bubblespec`` command line: scheduler, worker, up, demo, make-tiny-model, bench, simulate,
calibrate, loadtest.

Every flag has a ``BUBBLESPEC_<FLAG>`` environment variable (dashes become underscores),
read here at the entry point only.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

__all__ = ["main"]


_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off", "")


def _env(name: str, default):
    """The flag's ``BUBBLESPEC_<FLAG>`` variable as the flag's type, else ``default``. A value
    that is not one (``BUBBLESPEC_SPREAD_SAMPLES=ture``, ``BUBBLESPEC_GRPC_PORT=80a``) ends the
    command naming the variable: read as off, or as a traceback, it would start something else."""
    var = "BUBBLESPEC_" + name.upper().replace("-", "_")
    raw = os.environ.get(var)
    if raw is None:
        return default
    if isinstance(default, bool):
        if raw.strip().lower() in _TRUE + _FALSE:
            return raw.strip().lower() in _TRUE
        raise SystemExit(f"bubblespec: {var}={raw!r:.40} is not a boolean (1/true/yes/on or 0/false/no/off)")
    try:
        return type(default)(raw)
    except ValueError:
        raise SystemExit(f"bubblespec: {var}={raw!r:.40} is not a valid {type(default).__name__}") from None


def _add(p: argparse.ArgumentParser, flag: str, default, help: str) -> None:
    value = _env(flag, default)
    if isinstance(default, bool):
        p.add_argument(f"--{flag}", action=argparse.BooleanOptionalAction, default=value,
                       help=f"{help} (default: {'on' if value else 'off'})")
    else:
        p.add_argument(f"--{flag}", type=type(default), default=value, help=f"{help} (default: %(default)s)")


def _scheduler_flags(p: argparse.ArgumentParser) -> None:
    _add(p, "host", "", "bind address ('': 0.0.0.0 when both tokens are set, else 127.0.0.1; "
         "a non-loopback address without both tokens is logged as INSECURE)")
    _add(p, "grpc-port", 50051, "gRPC port (trainer + worker APIs, health, reflection)")
    _add(p, "http-port", 8080, "HTTP port (/healthz /readyz /metrics /status /ui)")
    _add(p, "tokenizer", "", "model directory or tokenizer.json for text prompts")
    _add(p, "served-model-name", "", "the model name of /v1/models and of every call's model field ('' = the "
         "tokenizer directory's name), as vllm serve's --served-model-name")
    _add(p, "redis-url", "", "draft store URL (redis:// or rediss://)")
    _add(p, "redis-password", "", "draft store password")
    _add(p, "redis-tls-ca-file", "", "PEM CA for rediss://")
    _add(p, "journal-redis-url", "", "step journal Redis, noeviction ('' = --redis-url)")
    _add(p, "journal-secret", "", "HMAC key of the step journal, >= 16 bytes (prefer the environment variable; "
                                  "'' = no journal)")
    _add(p, "journal-finished-ttl-seconds", 600, "keep a finished step's journal this long")
    _add(p, "weight-update-deadline-seconds", 600.0, "roll back a weight update started by the trainer and not "
         "finished within this many seconds (POST /abort_weight_update does it at once)")
    _add(p, "http-keep-alive-seconds", 5.0, "close an HTTP connection idle this long (vllm serve's 5 s)")
    _add(p, "orphan-grace-seconds", 30.0, "cancel a step this long after its trainer disconnected")
    _add(p, "trainer-token", "", "bearer token trainers must send")
    _add(p, "worker-token", "", "bearer token workers must send")
    _add(p, "tls-cert-file", "", "PEM certificate for the gRPC port")
    _add(p, "tls-key-file", "", "PEM key for the gRPC port")
    _add(p, "tls-client-ca-file", "", "PEM CA for client certificates (mutual TLS)")
    _add(p, "default-policy", "queue", "policy of steps that name none: static | queue | longest-first")
    _add(p, "default-logprobs-mode", "processed", "logprobs of steps that name none: processed | raw")
    from bubblespec.scheduler.core.settings import CoreSettings  # pure: no grpc, vLLM or torch

    defaults = CoreSettings()
    _add(p, "spread-samples", defaults.spread_samples, "hand out the shared queue a request at a time, a prompt's samples "
         "over different workers, not a sample group at a time (CoreSettings.spread_samples; on where each worker has "
         "its own CPUs: docs/SIMULATOR.md)")
    _add(p, "draft-jobs-beside-requests", defaults.max_draft_jobs_beside_requests, "draft jobs a busy worker runs beside its "
         "requests (CoreSettings.max_draft_jobs_beside_requests; 0: drafting only in bubbles and the trainer's gaps)")
    _add(p, "min-requests-beside-draft-jobs", defaults.min_requests_beside_draft_jobs, "no draft job starts beside fewer "
         "requests than this on a worker (CoreSettings.min_requests_beside_draft_jobs; 0: at any count)")
    _add(p, "draft-beside-first-step", defaults.draft_beside_first_step, "draft jobs beside the first step's requests, "
         "before completions show whether future drafts pay (CoreSettings.draft_beside_first_step)")
    _add(p, "min-requests-beside-draft-jobs-at-tail", defaults.min_requests_beside_draft_jobs_at_tail, "at a step's "
         "tail (a worker out of its work), no draft job runs beside fewer requests than this on a worker; idle workers "
         "draft their prompts (CoreSettings.min_requests_beside_draft_jobs_at_tail; 0: as before the tail)")
    _add(p, "move-long-requests", defaults.move_long_requests, "a worker that runs out of work takes over the running "
         "request with the most tokens from the fullest batch, and goes on from what it generated "
         "(CoreSettings.move_long_requests; docs/SIMULATOR.md)")
    _add(p, "min-tokens-to-move", defaults.min_tokens_to_move, "a request moves only once it has generated this many "
         "tokens (CoreSettings.min_tokens_to_move)")
    _add(p, "no-worker-timeout-seconds", defaults.no_worker_timeout_seconds or 0.0, "once no worker has been connected "
         "this long, running and queued calls fail UNAVAILABLE (HTTP 503) and new ones are refused until a worker "
         "connects (CoreSettings.no_worker_timeout_seconds; 0: wait for a worker forever)")
    _add(p, "move-to-workers-running-at-most", defaults.move_to_workers_running_at_most, "in a step without drafts, a worker "
         "running at most this many requests and no draft job also takes over a long request from a batch more than "
         "twice its own (CoreSettings.move_to_workers_running_at_most; 0: only a worker with nothing to run)")


def _engine_flags(p: argparse.ArgumentParser, speculative_tokens: int = 8, draft_token_seconds: float = 0.0) -> None:
    _add(p, "model", "", "model directory (default for up/demo: the tiny test model)")
    _add(p, "max-model-len", 1024, "longest prompt + response")
    _add(p, "max-num-seqs", 64, "concurrent requests per engine (capacity)")
    _add(p, "num-speculative-tokens", speculative_tokens, "most draft tokens per request per step; the draft "
         "token budget lowers it at larger batches (0 = no speculation)")
    _add(p, "draft-token-budget", 256, "most draft tokens one engine step verifies over its whole batch (each "
         "request's share: budget // batch)")
    _add(p, "tensor-parallel-size", 1, "GPUs per engine")
    _add(p, "enforce-eager", False, "run the model without torch.compile (vLLM's --enforce-eager): a faster "
         "engine start, possibly slower passes")
    _add(p, "kv-cache-memory-bytes", 256 * 2**20, "KV cache size for CPU engines")
    _add(p, "block-size", 0, "tokens per KV-cache block, the prefix cache's unit (0 = vLLM's default: 128 on CPU, "
         "16 on GPUs; CPU engines take multiples of 32)")
    _add(p, "dtype", "auto", "weights dtype (auto: the checkpoint's on CPU engines, vLLM's choice on GPUs)")
    _add(p, "cpu-cores", "", "CPU engines: cores the model runs on, one thread per core, e.g. 1, 0-3 or 0,2 ('' = unbound, "
         "torch's default threads: give each engine of a shared host its own; up, demo and bench put engine i on core i; "
         "with --tensor-parallel-size N, N lists separated by |)")
    _add(p, "logprobs-mode", "processed", "returned logprobs: processed (temperature/top-k/top-p applied) | raw")
    _add(p, "self-suffix-drafting", False, "where no stored or sibling draft continues a request, draft from its own "
         "prompt + output (draft source 'suffix'; exact either way)")
    _add(p, "draft-token-seconds", draft_token_seconds, "seconds one draft token adds to a pass (per_draft_token_seconds from "
         "`bubblespec calibrate`): draft length by cost, none where it costs more than it saves (0 = measured by the "
         "engine, --measure-draft-cost)")
    _add(p, "measure-draft-cost", True, "with --draft-token-seconds 0: the engine measures what a draft token adds to "
         "its steps as it runs, then drafts by cost with that figure (off: by acceptance only)")
    _add(p, "draft-for-makespan", True, "with a draft token's cost set or measured: draft lengths that end the batch's "
         "last request soonest (deep for the long requests, none for the short) instead of the batch's most tokens/s")
    _add(p, "allow-unsupported-vllm", False, "start on a vLLM release the worker was not checked against "
         "(exactness UNVERIFIED; logged loudly)")
    _add(p, "enable-lora", False, "start the engine with LoRA support, for the scheduler's /v1/load_lora_adapter "
         "(docs/INTEGRATIONS.md; CPU engines then run without torch.compile)")
    _add(p, "max-lora-rank", 16, "with --enable-lora: the largest adapter rank loaded (vLLM's max_lora_rank)")
    _add(p, "max-loras", 4, "with --enable-lora: adapter versions one batch may use at once (vLLM's max_loras)")
    _add(p, "unsafe-skip-self-checks", False, "UNSAFE: skip the start-up self-checks (drafts, CPU sampler fix, "
         "weight reload) that run before a worker joins the scheduler")
    _transfer_flag(p)


def _transfer_flag(p: argparse.ArgumentParser) -> None:
    _add(p, "weight-transfer-backend", "", "vLLM weight-transfer backend for trainer-pushed weights, e.g. nccl "
         "(GPUs; '' = off; docs/INTEGRATIONS.md)")


def _verbose_flag(p: argparse.ArgumentParser) -> None:
    _add(p, "verbose", False, "show vLLM's output (its logs, warnings, progress bars) here instead of "
         "writing it to a log file under ~/.cache/bubblespec/logs")


def _worker_flags(p: argparse.ArgumentParser) -> None:
    _add(p, "scheduler", "localhost:50051", "scheduler address")
    _add(p, "worker-id", "", "stable worker id (default hostname-pid)")
    _add(p, "worker-token", "", "bearer token for the worker API")
    _add(p, "tls", False, "dial the scheduler over TLS")
    _add(p, "tls-ca-file", "", "PEM roots for the scheduler's certificate")
    _add(p, "tls-cert-file", "", "PEM client certificate (mutual TLS)")
    _add(p, "tls-key-file", "", "PEM client key (mutual TLS)")
    _add(p, "redis-url", "", "draft store URL ('' = no drafts from other workers)")
    _add(p, "redis-password", "", "draft store password")
    _add(p, "redis-tls-ca-file", "", "PEM CA for rediss://")
    _add(p, "completion-batch-seconds", 0.05, "a completion ending within this long of the worker's last "
         "completion message waits out the gap and goes with those ending meanwhile in one message, unless no "
         "request is left running on the worker (0 = no wait)")
    _add(p, "metrics-port", 8081, "HTTP port for /metrics and /healthz (-1 = off)")
    _add(p, "shutdown-seconds", 90.0, "on SIGTERM: exit after this long even if the drain has not finished")
    _engine_flags(p)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="bubblespec", description=__doc__)
    _add(parser, "log-level", "INFO", "logging level")
    sub = parser.add_subparsers(dest="command", required=True)
    sched = sub.add_parser("scheduler", help="run the scheduler")
    _scheduler_flags(sched)
    _transfer_flag(sched)
    _worker_flags(sub.add_parser("worker", help="run one vLLM worker that dials the scheduler"))
    up = sub.add_parser("up", help="scheduler + N vLLM workers + in-process draft store on this machine")
    _add(up, "workers", 2, "number of vLLM workers")
    _add(up, "shutdown-seconds", 60.0, "on SIGTERM: exit after this long even if the drain has not finished")
    _verbose_flag(up)
    _scheduler_flags(up)
    _engine_flags(up)
    demo = sub.add_parser("demo", help="start `up` and run a two-step rollout through the SDK")
    _add(demo, "workers", 2, "number of vLLM workers")
    _add(demo, "prompts", 16, "prompts per step")
    _add(demo, "samples", 2, "samples per prompt")
    _verbose_flag(demo)
    _engine_flags(demo)
    sub.add_parser("simulate", help="cluster simulator: the scheduling core at 8-4,096 workers (see --help)",
                   add_help=False)
    from bubblespec.bench.sim.costs import CPU_TINY

    bench = sub.add_parser("bench", help="baseline vs BubbleSpec on the same RL steps, side by side")
    _add(bench, "workers", 2, "number of vLLM workers")
    _add(bench, "steps", 5, "RL steps per arm")
    _add(bench, "prompts", 32, "prompts per step")
    _add(bench, "samples", 2, "samples per prompt")
    _add(bench, "max-tokens", 480, "longest response")
    _add(bench, "lookahead-steps", 2, "following steps whose prompts each step announces for drafting")
    _add(bench, "train-seconds", 0.8, "pause between steps standing in for reward + training (drafting goes on)")
    _add(bench, "update-scale", 3e-5, "RMS of the weight noise standing in for each gradient step")
    _add(bench, "seed", 0, "workload seed")
    _add(bench, "draft-jobs-during-step", -1, "draft jobs per idle worker while others still run the step "
                                             "(-1 = the scheduler's default, 16; full width after the step)")
    _add(bench, "draft-jobs-beside-requests", -1, "draft jobs per busy worker beside its requests, for the "
                                                  "upcoming prompts predicted longest (-1 = the scheduler's default, 4)")
    _add(bench, "draft-beside-first-step", True, "draft jobs beside the first step's requests, before completions "
                                                 "show whether future drafts pay (the scheduler's default)")
    _add(bench, "spread-samples", False, "hand out the shared queue a request at a time, a prompt's samples spread "
                                         "over the workers, not a sample group at a time (the scheduler's default)")
    from bubblespec.scheduler.core.settings import CoreSettings  # pure: no grpc, vLLM or torch

    _add(bench, "min-requests-beside-draft-jobs-at-tail", CoreSettings.min_requests_beside_draft_jobs_at_tail,
         "at a step's tail, no draft job beside fewer requests than this on a worker (the scheduler's default)")
    _add(bench, "move-long-requests", CoreSettings.move_long_requests, "an idle worker takes over a long running "
         "request, going on from what it generated (the scheduler's default)")
    _add(bench, "min-tokens-to-move", CoreSettings.min_tokens_to_move, "a request moves only once it has this many "
         "tokens (the scheduler's default)")
    _add(bench, "move-to-workers-running-at-most", CoreSettings.move_to_workers_running_at_most, "in a step without "
         "drafts, a worker running at most this many requests also takes over a long request (the scheduler's default)")
    _add(bench, "runs", 1, "times every arm runs on the same engines (arm order rotated per run); "
         "the table gives each run's speedup and their median")
    _add(bench, "json", "", "write the report here")
    bench.add_argument("--quick", action="store_true", help="3 steps x 16 prompts (a few minutes)")
    _verbose_flag(bench)
    # deep drafts for the tail, and draft length by cost: the bench's model on this CPU costs
    # CPU_TINY.per_draft_token_seconds per draft token, measured by `bubblespec calibrate` (docs/BENCHMARKS.md)
    _engine_flags(bench, speculative_tokens=32, draft_token_seconds=CPU_TINY.per_draft_token_seconds)
    cal = sub.add_parser("calibrate", help="measure an engine's cost per forward pass (the simulator's cost model)")
    _add(cal, "repeats", 3, "runs per measured point (median)")
    _add(cal, "json", "", "write the observations and fitted profile here")
    _engine_flags(cal)
    tiny = sub.add_parser("make-tiny-model", help="write the tiny Llama test model and tokenizer")
    tiny.add_argument("dir")
    tiny.add_argument("--seed", type=int, default=0)
    rlvr = sub.add_parser("make-rlvr-model", help="train the tiny Llama on the RLVR arithmetic task (minutes, CPU)")
    rlvr.add_argument("dir")
    rlvr.add_argument("--seed", type=int, default=0)
    rlvr.add_argument("--steps", type=int, default=None, help="optimizer steps (default: TrainSettings.steps)")
    from bubblespec.cli.loadtest import add_parser as add_loadtest_parser

    add_loadtest_parser(sub, _add)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["simulate"]:  # the simulator owns its flags
        from bubblespec.bench.sim.__main__ import main as simulate

        return simulate(argv[1:])
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.command == "make-tiny-model":
        from bubblespec.bench.tiny_model import build_tiny_model

        print(build_tiny_model(args.dir, seed=args.seed))
        return 0
    if args.command == "make-rlvr-model":
        from bubblespec.bench.rlvr import train_rlvr_model

        stats = train_rlvr_model(args.dir, seed=args.seed, steps=args.steps)
        print(f"{stats['path']}: loss {stats['final_loss']:.4f} after {stats['seconds']:.0f}s")
        return 0
    if args.command == "calibrate":
        from bubblespec.cli.calibrate import main as calibrate

        calibrate(args)
        return 0
    if args.command == "loadtest" and args.http:  # cli/loadtest_http.py builds on cli/loadtest.py, not back
        from bubblespec.cli.loadtest import settings_of
        from bubblespec.cli.loadtest_http import http_loadtest, http_settings

        return http_loadtest(http_settings(settings_of(args), argv, os.environ), args.json)
    if args.command == "loadtest":
        from bubblespec.cli.loadtest import loadtest

        return loadtest(args)
    if args.command == "bench":
        from bubblespec.cli.bench import main as bench

        return bench(args)
    from bubblespec.cli import commands

    return getattr(commands, args.command.replace("-", "_"))(args) or 0


if __name__ == "__main__":
    sys.exit(main())
