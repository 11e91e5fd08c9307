"""TRL adapters: lookahead announcements and directory weight syncs for TRL's vLLM server mode.

TRL's ``GRPOTrainer`` (and ``RLOOTrainer``) in server mode talk to the scheduler's HTTP port as
they talk to ``vllm serve`` (``vllm_server_base_url="http://scheduler:8080"``). This module adds
what TRL does not do by itself (docs/INTEGRATIONS.md, "TRL"):

* ``BubbleSpecLookahead``: a ``TrainerCallback`` that announces the prompts of the next
  generation rounds over gRPC (``Announce``), so that idle workers draft them under the current
  policy. It replays the trainer's sampler, so the announced token ids are the ones TRL will send.
* ``DirectoryWeightSync``: TRL's ``VLLMGeneration`` whose weight sync saves the policy to a fresh
  directory and POSTs ``/update_weights {"weight_dir": ...}`` (the scheduler's policy-version
  barrier) instead of joining vLLM's NCCL weight-transfer group, which TRL refuses to do from a
  non-CUDA trainer: ``NotImplementedError: Weight synchronization runs on vLLM's NCCL
  weight-transfer engine, which needs a CUDA device, got 'cpu'. Generation through the server is
  unaffected.`` (``VLLMClient.init_communicator``).
* ``BubbleSpecVLLMClient``: TRL's ``VLLMClient`` that sends ``Authorization: Bearer <token>``
  (TRL's own client sends none, so it cannot reach a scheduler that has a trainer token).

For TRL's ``AsyncGRPOTrainer`` (``trl.experimental.async_grpo``), whose own rollout child and
pause/resume calls run against the scheduler unchanged:

* ``DirectoryWeightTransfer``: its ``weight_transfer`` (TRL's ``WeightTransferProtocol``) that
  saves each policy to a directory and POSTs ``/update_weights {"weight_dir"}`` in place of
  TRL's NCCL ``WeightTransferClient``, which needs a CUDA trainer.
* ``async_grpo_on_cpu``: a context that replaces the trainer's two CUDA-only calls on a CPU
  trainer: the FlashAttention-3 tree-attention kernel (by the same attention in plain torch)
  and the peak-FLOPs lookup (None off CUDA: no MFU metrics).

Needs ``pip install 'bubblespec[trl]'``; TRL's server-mode client also needs vLLM importable in
the trainer's environment (its own check).
"""

from __future__ import annotations

import copy
import functools
import logging
import shutil
import uuid
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

try:
    import torch
    from torch.utils.data import SequentialSampler
    from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments
    from trl.generation.vllm_client import VLLMClient
    from trl.generation.vllm_generation import VLLMGeneration
    from trl.trainer.utils import RepeatSampler
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise ImportError(
        f"bubblespec.integrations.trl needs TRL >= 1.11 and transformers: pip install 'bubblespec[trl]' ({exc})"
    ) from exc

from bubblespec.client import ClientSettings, Retry, RolloutClient, SamplingParams

__all__ = [
    "BubbleSpecLookahead", "BubbleSpecVLLMClient", "DirectoryWeightSync", "DirectoryWeightTransfer", "PromptSchedule",
    "RoundShape", "async_grpo_on_cpu", "find_sampler", "lookahead_sampling", "replayable_copy", "tokenize_prompts",
]

logger = logging.getLogger(__name__)


# ----------------------------------------------------------------------------- which prompts come next


@dataclass(frozen=True)
class RoundShape:
    """How GRPOTrainer's dataloader stream maps onto generation rounds (one ``/v1/completions``
    call each): a global batch is ``items_per_round`` sampler indices, each prompt repeated
    ``repeats`` times in a row; a round is generated every ``batches_per_round`` batches (the
    batches in between repeat it); an optimizer step consumes ``grad_accum`` batches."""

    items_per_round: int
    """``generation_batch_size``: sampler indices per global batch (all processes)."""
    repeats: int = 1
    """``num_generations``: consecutive copies of each prompt index in a batch."""
    batches_per_round: int = 1
    """``steps_per_generation * num_iterations``: batches from one generation to the next."""
    grad_accum: int = 1
    """``gradient_accumulation_steps``: batches per optimizer step."""

    def __post_init__(self) -> None:
        for name in ("items_per_round", "repeats", "batches_per_round", "grad_accum"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"{name}: must be a positive int, got {getattr(self, name)!r}")
        if self.items_per_round % self.repeats:
            raise ValueError(f"items_per_round: {self.items_per_round} is not a multiple of repeats {self.repeats}")

    @classmethod
    def from_args(cls, args: Any) -> RoundShape:
        """From a ``GRPOConfig`` / ``RLOOConfig`` (after its ``__post_init__`` filled the sizes)."""
        return cls(items_per_round=args.generation_batch_size, repeats=args.num_generations,
                   batches_per_round=args.steps_per_generation * getattr(args, "num_iterations", 1),
                   grad_accum=args.gradient_accumulation_steps)

    def next_round(self, global_step: int) -> int:
        """The first round not generated yet after ``global_step`` optimizer steps (GRPOTrainer
        generates at batch ``r * batches_per_round``; epochs of whole rounds, as RepeatSampler's)."""
        return -(-global_step * self.grad_accum // self.batches_per_round)


def replayable_copy(sampler: Any) -> Any | None:
    """A copy of ``sampler`` that yields, epoch after epoch, the indices the original will yield
    from now on; None when that order cannot be known in advance (a sampler other than TRL's
    ``RepeatSampler`` or torch's ``SequentialSampler``, e.g. one seeded from the global RNG)."""
    if isinstance(sampler, SequentialSampler):
        return sampler
    if not isinstance(sampler, RepeatSampler):
        return None
    twin = copy.copy(sampler)
    if getattr(sampler, "shuffle", False):
        twin.generator = torch.Generator()
        twin.generator.set_state(sampler.generator.get_state())
    return twin


def find_sampler(dataloader: Any) -> Any | None:
    """The index sampler behind a (possibly accelerate-prepared) dataloader."""
    batch_sampler = getattr(dataloader, "batch_sampler", None)
    batch_sampler = getattr(batch_sampler, "batch_sampler", batch_sampler)  # accelerate's BatchSamplerShard
    return getattr(batch_sampler, "sampler", None) or getattr(dataloader, "sampler", None)


class PromptSchedule:
    """Dataset indices of each generation round's prompts, in the order the trainer sends them
    (``prompts[::num_generations]`` of the gathered batch), replayed from ``sampler`` (a
    ``replayable_copy`` taken before the trainer iterates its own). A partial last batch of an
    epoch, which RepeatSampler never yields, is not a round."""

    def __init__(self, sampler: Any, shape: RoundShape):
        self.shape = shape
        self._rounds: list[list[int]] = []
        self._source = self._replay(sampler)

    def _replay(self, sampler: Any) -> Iterator[list[int]]:
        s, batches = self.shape, 0
        while True:
            batch: list[int] = []
            yielded = False
            for index in sampler:  # one epoch
                yielded = True
                batch.append(int(index))
                if len(batch) == s.items_per_round:
                    if batches % s.batches_per_round == 0:
                        yield batch[::s.repeats]
                    batches += 1
                    batch = []
            if not yielded:
                return

    def round(self, r: int) -> list[int] | None:
        """Round ``r``'s prompt indices (0 = the first generation of this training run), or
        None past the end of an empty sampler."""
        while len(self._rounds) <= r:
            nxt = next(self._source, None)
            if nxt is None:
                return None
            self._rounds.append(nxt)
        return self._rounds[r]


def tokenize_prompts(processing_class: Any, prompts: Sequence[Any],
                     chat_template_kwargs: dict | None = None) -> list[list[int]]:
    """Token ids of ``prompts`` as GRPOTrainer computes them for generation (its
    ``_tokenize_prompts`` without tools, environments or images): conversations through the chat
    template with the generation prompt, text through the tokenizer as is."""
    from trl.data_utils import is_conversational

    if is_conversational({"prompt": prompts[0]}):
        out = processing_class.apply_chat_template(conversation=list(prompts), add_generation_prompt=True,
                                                   tokenize=True, return_dict=True, **(chat_template_kwargs or {}))
        return [list(ids) for ids in out["input_ids"]]
    return [list(ids) for ids in processing_class(text=list(prompts))["input_ids"]]


def lookahead_sampling(args: Any) -> SamplingParams:
    """The sampling parameters TRL's server mode sends (``temperature``, ``top_p``, ``top_k``,
    ``max_completion_length``, ``num_generations``; ``generation_kwargs`` override them as in
    TRL's request body): draft jobs use the distribution the next rounds will sample from."""
    body = {"temperature": args.temperature, "top_p": args.top_p, "top_k": args.top_k,
            "max_tokens": args.max_completion_length, **(getattr(args, "generation_kwargs", None) or {})}
    top_k = body.get("top_k")
    return SamplingParams(temperature=float(body["temperature"]), top_p=float(body["top_p"]),
                          top_k=-1 if top_k in (None, 0) else int(top_k), max_tokens=int(body["max_tokens"]),
                          n=int(args.num_generations))


# ----------------------------------------------------------------------------- the callback


class BubbleSpecLookahead(TrainerCallback):
    """Announce the next ``steps`` generation rounds' prompts to the scheduler, at train begin and
    after every optimizer step, so idle workers draft them (``Announce``, gRPC).

    ``trainer.add_callback(BubbleSpecLookahead("scheduler:50051", token=TOKEN, steps=2))``

    The prompts come from a copy of the trainer's sampler taken at train begin (TRL's
    ``RepeatSampler`` or a ``SequentialSampler``), tokenized as GRPOTrainer does
    (``tokenize_prompts``; pass ``tokenize=`` for tools or a custom chat template). When the
    order cannot be known (another sampler, an iterable dataset) nothing is announced and a
    warning says why (``exact`` is then False). A resumed run's first epoch is replayed from
    its start, so announcements can miss until the next epoch; that costs speed, never results.

    A failed announcement only loses drafting speed: it is logged at WARNING with its reason,
    counted in ``failures`` (``last_error`` holds the latest), and training goes on; the round is
    tried again after the next step. Only the main process announces. Each call waits at most
    ``timeout_seconds`` (no retries)."""

    def __init__(self, target: str = "localhost:50051", *, token: str = "", steps: int = 2,
                 timeout_seconds: float = 5.0, client: Any = None,
                 tokenize: Callable[[list], list[list[int]]] | None = None):
        if not isinstance(steps, int) or isinstance(steps, bool) or steps < 1:
            raise ValueError(f"steps: must be an int >= 1, got {steps!r}")
        self.target, self.steps = target, steps
        self._settings = ClientSettings(target=target, token=token, timeout_seconds=timeout_seconds,
                                        retry=Retry(attempts=1))
        self._client, self._owns_client = client, client is None
        self._tokenize = tokenize
        self.schedule: PromptSchedule | None = None
        self.exact: bool | None = None
        """Whether the next prompts are known exactly (set at train begin)."""
        self.announced_rounds: dict[int, list[list[int]]] = {}
        """Round -> the token ids announced for it (each round once, once it was accepted)."""
        self.accepted = 0
        self.failures = 0
        self.last_error: str | None = None

    def on_train_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                       train_dataloader: Any = None, processing_class: Any = None, **kwargs: Any) -> None:
        self._setup(args, train_dataloader, processing_class)
        self._announce(state)

    def on_step_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any) -> None:
        self._announce(state)

    def on_train_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any) -> None:
        if self._owns_client and self._client is not None:
            self._client.close()
            self._client = None

    def _setup(self, args: Any, dataloader: Any, processing_class: Any) -> None:
        self.shape = RoundShape.from_args(args)
        self.sampling = lookahead_sampling(args)
        sampler = find_sampler(dataloader)
        twin = replayable_copy(sampler)
        self.exact = twin is not None
        if twin is None:
            logger.warning("BubbleSpec lookahead: the trainer's prompt order cannot be known in advance (sampler %s); "
                           "no prompts will be announced, rollouts run without future drafts",
                           type(sampler).__name__)
            return
        self.schedule = PromptSchedule(twin, self.shape)
        self.dataset = dataloader.dataset
        if self._tokenize is None:
            self._tokenize = functools.partial(tokenize_prompts, processing_class,
                                               chat_template_kwargs=getattr(args, "chat_template_kwargs", None))

    def _announce(self, state: TrainerState) -> None:
        if self.schedule is None or not state.is_world_process_zero:
            return
        first = self.shape.next_round(state.global_step)
        last = first + self.steps
        if state.max_steps > 0:
            last = min(last, self.shape.next_round(state.max_steps))
        for r in range(first, last):
            if r not in self.announced_rounds and not self._announce_round(r):
                return

    def _announce_round(self, r: int) -> bool:
        try:
            if self.schedule is None or self._tokenize is None:  # (``_announce`` calls it once train begin set both)
                raise RuntimeError("the prompt order is not known: nothing to announce before train begin")
            indices = self.schedule.round(r)
            if indices is None:
                return False
            ids = self._tokenize([self.dataset[i]["prompt"] for i in indices])
            if self._client is None:
                self._client = RolloutClient(settings=self._settings)
            self.accepted += self._client.announce(ids, self.sampling)
        except Exception as exc:  # noqa: BLE001 - lookahead only speeds rollouts up: log, count, go on
            self.failures += 1
            self.last_error = f"{type(exc).__name__}: {exc}"
            logger.warning("BubbleSpec lookahead: announcing generation round %d to %s failed (%s); its rollouts run "
                           "without future drafts (%d failure(s) so far)", r, self.target, self.last_error,
                           self.failures)
            return False
        self.announced_rounds[r] = ids
        return True


# ----------------------------------------------------------------------------- weight sync through a directory


class BubbleSpecVLLMClient(VLLMClient):
    """TRL's ``VLLMClient`` that sends ``Authorization: Bearer <token>`` on every call, with
    ``update_weights_from_directory`` for the scheduler's ``/update_weights {"weight_dir"}``."""

    def __init__(self, *args: Any, token: str = "", **kwargs: Any) -> None:
        self._token = token
        super().__init__(*args, **kwargs)

    def check_server(self, *args: Any, **kwargs: Any) -> None:
        # VLLMClient.__init__ calls this once its session exists, before its first authenticated call
        if self._token:
            self.session.headers["Authorization"] = f"Bearer {self._token}"
        return super().check_server(*args, **kwargs)

    def update_weights_from_directory(self, weight_dir: str) -> dict:
        """Every live worker loads ``weight_dir`` as the next policy version; returns the answer
        once all have (the barrier). Raises naming the status and the scheduler's message otherwise."""
        return self._post(f"{self.base_url}/update_weights", json={"weight_dir": weight_dir})


class DirectoryWeightSync(VLLMGeneration):
    """TRL's server-mode generation with weight sync through a shared directory.

    ``sync_weights`` gathers the policy's tensors (under the names vLLM loads, as TRL's NCCL path
    streams them), writes ``config.json`` + ``model.safetensors`` to a fresh directory under
    ``weights_root`` (visible to every worker), and POSTs ``/update_weights {"weight_dir"}``,
    which returns once every worker serves the new version; the ``keep`` newest directories
    are kept, older ones deleted. No NCCL group is joined, so it runs on CPU trainers too.
    Construct it through ``DirectoryWeightSync.installed(...)`` around the trainer's constructor."""

    vllm_client: BubbleSpecVLLMClient
    """The main process's client (``_init_vllm``)."""

    def __init__(self, *args: Any, weights_root: str | Path, token: str = "", keep: int = 2, **kwargs: Any) -> None:
        if not isinstance(keep, int) or keep < 1:
            raise ValueError(f"keep: must be an int >= 1, got {keep!r}")
        self.weights_root, self.token, self.keep = Path(weights_root), token, keep
        self.synced_dirs: list[Path] = []
        """Directories written by this sync, oldest first (the ``keep`` newest remain on disk)."""
        super().__init__(*args, **kwargs)

    @classmethod
    @contextmanager
    def installed(cls, weights_root: str | Path, *, token: str = "", keep: int = 2,
                  trainer_module: Any = None) -> Iterator[functools.partial[DirectoryWeightSync]]:
        """While active, a TRL trainer constructed in the block builds this class instead of TRL's
        ``VLLMGeneration`` (``trainer_module``: default ``trl.trainer.grpo_trainer``; pass
        ``trl.trainer.rloo_trainer`` for RLOO). The trainer keeps it after the block."""
        if trainer_module is None:
            import trl.trainer.grpo_trainer as trainer_module
        factory = functools.partial(cls, weights_root=weights_root, token=token, keep=keep)
        saved = trainer_module.VLLMGeneration
        trainer_module.VLLMGeneration = factory
        try:
            yield factory
        finally:
            trainer_module.VLLMGeneration = saved

    def _init_vllm(self) -> None:
        if self.mode != "server":
            raise ValueError(f"vllm_mode: DirectoryWeightSync needs 'server', got {self.mode!r}")
        if self.accelerator.is_main_process:
            base_url = self.server_base_url or f"http://{self.server_host}:{self.server_port}"
            self.vllm_client = BubbleSpecVLLMClient(base_url=base_url, group_port=self.group_port,
                                                    connection_timeout=self.server_timeout, token=self.token)
            self.weights_root.mkdir(parents=True, exist_ok=True)
        self.accelerator.wait_for_everyone()

    def sync_weights(self) -> None:
        """Save the policy to a fresh directory and load it on every worker (see the class)."""
        main = self.accelerator.is_main_process
        tensors = {}
        for name, param in self._iter_named_params():  # every process takes part in the gathers
            if main:
                tensors[name] = param.detach().to("cpu", copy=True).contiguous()
        if main:
            path = self._save(tensors)
            self.vllm_client.update_weights_from_directory(str(path))
            self._prune()
        self.accelerator.wait_for_everyone()

    def _save(self, tensors: dict) -> Path:
        from safetensors.torch import save_file

        path = self.weights_root / f"policy-{len(self.synced_dirs):06d}-{uuid.uuid4().hex[:8]}"
        path.mkdir(parents=True)
        model = self.accelerator.unwrap_model(self.model)
        model.config.save_pretrained(str(path))
        save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
        self.synced_dirs.append(path)
        return path

    def _prune(self) -> None:
        for old in self.synced_dirs[:-self.keep]:
            if old.exists():
                shutil.rmtree(old)


# ----------------------------------------------------------------------------- async GRPO (trl.experimental.async_grpo)


class DirectoryWeightTransfer:
    """``AsyncGRPOTrainer(weight_transfer=...)`` (TRL's ``WeightTransferProtocol``) that loads
    each policy through the scheduler's ``/update_weights {"weight_dir": ...}`` instead of TRL's
    ``WeightTransferClient``, whose NCCL group (``/init_weight_transfer_engine``, then
    ``/start_weight_update``, ``/update_weights {"update_info"}``, ``/finish_weight_update``
    around a broadcast) needs a CUDA trainer.

    What is replaced is the transfer only: ``send_weights`` takes the ``(name, tensor)`` stream
    the trainer builds for the NCCL path (the names vLLM loads), writes ``config.json`` +
    ``model.safetensors`` to a fresh directory under ``weights_root`` (which every worker must
    be able to read) and POSTs it; the answer comes once every worker serves the new version.
    ``pause`` and ``resume`` are TRL's own ``VLLMClient`` calls (``/pause?mode=keep``,
    ``/resume``), ``init_weight_transfer`` waits for ``/health`` as TRL's does, and the first
    send repeats TRL's check of the trainer's dtype against ``/server_info``'s
    ``model_config.dtype`` (a warning, as TRL's). The ``keep`` newest directories stay on disk
    (``synced_dirs`` lists what was written, oldest first); ``destroy`` deletes nothing."""

    def __init__(self, base_url: str, weights_root: str | Path, model: str | Any, *, keep: int = 2,
                 server_timeout: float = 240.0, control_timeout: int = 300, update_timeout: int = 1800):
        if not isinstance(keep, int) or isinstance(keep, bool) or keep < 1:
            raise ValueError(f"keep: must be an int >= 1, got {keep!r}")
        from trl.experimental.async_grpo.vllm_client import VLLMClient as AsyncVLLMClient

        self.client = AsyncVLLMClient(base_url, server_timeout)
        self.weights_root, self.keep = Path(weights_root), keep
        self.control_timeout, self.update_timeout = control_timeout, update_timeout
        self._model = model
        self._dtype_checked = False
        self.synced_dirs: list[Path] = []
        """Directories written, oldest first (the ``keep`` newest remain on disk)."""

    def init_weight_transfer(self) -> None:
        self.client.wait_for_server_ready()
        self.weights_root.mkdir(parents=True, exist_ok=True)

    def pause(self) -> None:
        self.client.pause(timeout=self.control_timeout)

    def resume(self) -> None:
        self.client.resume(timeout=self.control_timeout)

    def send_weights(self, iterator: Iterator[tuple[str, Any]]) -> None:
        """Save the streamed policy to a fresh directory and load it on every worker."""
        from collections import Counter

        import requests
        from safetensors.torch import save_file

        tensors = {name: t.detach().to("cpu", copy=True).contiguous() for name, t in iterator}
        if not tensors:
            raise ValueError("send_weights: the trainer streamed no parameters")
        if not self._dtype_checked:
            self._dtype_checked = True
            train = Counter(str(t.dtype).removeprefix("torch.") for t in tensors.values()).most_common(1)[0][0]
            served = (self.client.get_dtype() or "").removeprefix("torch.")
            if served != train:
                logger.warning("The scheduler's workers serve in %s but the weights sent to them are %s: set `dtype` "
                               "in AsyncGRPOConfig to %r, or start the workers with that dtype", served, train, served)
        path = self.weights_root / f"policy-{len(self.synced_dirs):06d}-{uuid.uuid4().hex[:8]}"
        path.mkdir(parents=True)
        self._config().save_pretrained(str(path))
        save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
        r = requests.post(f"{self.client.server_url}/update_weights", json={"weight_dir": str(path)},
                          timeout=self.update_timeout)
        if r.status_code != 200:  # the scheduler changed nothing (its barrier loads all or none)
            shutil.rmtree(path)
            raise RuntimeError(f"POST /update_weights {{'weight_dir': {str(path)!r}}} failed: {r.status_code}, "
                               f"{r.text[:500]}")
        self.synced_dirs.append(path)
        for old in self.synced_dirs[:-self.keep]:
            if old.exists():
                shutil.rmtree(old)

    def destroy(self) -> None:
        """Nothing to release: no transfer group was joined."""

    def _config(self) -> Any:
        if isinstance(self._model, str):
            from transformers import AutoConfig

            self._model = AutoConfig.from_pretrained(self._model)
        return self._model


def _varlen_causal_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cu_seqlens_q: torch.Tensor,
                             cu_seqlens_k: torch.Tensor, max_seqlen_q: int | None = None, max_seqlen_k: int | None = None,
                             softmax_scale: float | None = None, causal: bool = True,
                             window_size: tuple[int, int] = (-1, -1), softcap: float = 0.0,
                             **kwargs: Any) -> torch.Tensor:
    """``flash_attn_varlen_func``'s contract in plain torch: segment ``i`` of ``query`` (rows
    ``cu_seqlens_q[i]:cu_seqlens_q[i+1]``) attends to rows ``cu_seqlens_k[i]:cu_seqlens_k[i+1]``
    of ``key``/``value`` with the causal mask aligned to the bottom right (the last query row
    sees every key), heads grouped as in GQA. Sliding windows and softcapping are refused."""
    import torch.nn.functional as F

    if not causal:
        raise NotImplementedError("torch tree attention: only causal attention (TRL's tree packing) is implemented")
    if tuple(window_size) != (-1, -1) or softcap:
        raise NotImplementedError(f"torch tree attention: sliding windows and softcapping are not implemented "
                                  f"(window_size={tuple(window_size)}, softcap={softcap})")
    if kwargs:
        raise NotImplementedError(f"torch tree attention: unsupported arguments {sorted(kwargs)}")
    heads, kv_heads = query.shape[1], key.shape[1]
    if heads % kv_heads:
        raise ValueError(f"query heads ({heads}) are not a multiple of key/value heads ({kv_heads})")
    cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    outs = []
    for (q0, q1), (k0, k1) in zip(zip(cq, cq[1:]), zip(ck, ck[1:]), strict=True):
        lq, lk = q1 - q0, k1 - k0
        if lq > lk:
            raise ValueError(f"a segment has {lq} queries but only {lk} keys")
        q, k, v = (x.transpose(0, 1) for x in (query[q0:q1], key[k0:k1], value[k0:k1]))  # (heads, len, dim)
        if kv_heads != heads:
            k, v = (x.repeat_interleave(heads // kv_heads, dim=0) for x in (k, v))
        mask = torch.ones(lq, lk, dtype=torch.bool, device=query.device).tril(diagonal=lk - lq)
        outs.append(F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=softmax_scale).transpose(0, 1))
    return torch.cat(outs, dim=0)


class _TorchFlashAttn:
    flash_attn_varlen_func = staticmethod(_varlen_causal_attention)


def _peak_flops_off_cuda(get_peak_flops_per_device: Callable) -> Callable:
    """TRL's ``get_peak_flops_per_device``, answering None (TRL's own "unknown device": MFU
    metrics off, every other metric kept) for a trainer not on a CUDA device, where TRL's asks
    ``torch.cuda.get_device_name`` and fails."""

    @functools.wraps(get_peak_flops_per_device)
    def peak_flops(accelerator: Any, dtype: str) -> float | None:
        if accelerator.device.type != "cuda":
            return None
        return get_peak_flops_per_device(accelerator, dtype)

    return peak_flops


@contextmanager
def async_grpo_on_cpu() -> Iterator[None]:
    """Lets TRL's ``AsyncGRPOTrainer`` construct and train on a CPU (or any non-CUDA) device;
    wrap both its constructor and ``train()``. Two CUDA-only parts of TRL are replaced while
    active, nothing else:

    * the tree attention (``trl.experimental.async_grpo.packing``) runs on
      ``_varlen_causal_attention`` (plain torch) instead of the FlashAttention-3 kernel TRL
      fetches from the Hugging Face Hub (``kernels``), which needs a CUDA or ROCm GPU; TRL's
      packing, masks and loss are its own;
    * the trainer's peak-FLOPs lookup answers None off CUDA (TRL's answer for an unknown device:
      no MFU metrics) instead of calling ``torch.cuda.get_device_name``, which raises on a
      CPU-only torch.

    Weight sync is separate: pass ``weight_transfer=DirectoryWeightTransfer(...)``."""
    from trl.experimental.async_grpo import async_grpo_trainer, packing

    saved = packing._flash_attn, async_grpo_trainer.get_peak_flops_per_device
    packing._flash_attn = lambda: _TorchFlashAttn  # type: ignore[assignment]  # TRL's answers a kernels module
    async_grpo_trainer.get_peak_flops_per_device = _peak_flops_off_cuda(saved[1])
    try:
        yield
    finally:
        packing._flash_attn, async_grpo_trainer.get_peak_flops_per_device = saved
