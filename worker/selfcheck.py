"""Start-up self-checks: the vLLM internals the worker relies on work on this very engine.

Run after the engine started and before the worker says hello to the scheduler
(``worker.main.serve``, ``cli.commands.Cluster``); a failure ends the worker with a message
naming what broke, and the scheduler never sees it. They take a few requests of a few tokens,
one weights reload and one prefix-cache reset (a few seconds on the tiny model):

* ``proposer``: the BubbleSpec proposer was built by vLLM's ``custom_class`` hook and attached
  to the model runner (``bubblespec_attach``).
* ``drafts``: draft ids reach it through ``SamplingParams.extra_args``: a greedy response,
  generated again with itself as the draft, is token-identical and has accepted draft tokens.
* ``sampler``: the rejection sampler's ``expand_batch_to_tokens`` keeps float per-request
  parameters (temperatures 0.7 and 1.3) intact, run inside the engine process; where the CPU
  fix is asked for, the installed routine must be ours.
* ``reload``: weights reload from the engine's own model directory and the prefix cache
  resets (``VllmEngine.load_weights``), and the greedy response is unchanged afterwards.

``EngineSettings.self_checks=False`` skips them: unsafe, for debugging only.
"""

from __future__ import annotations

import logging
import math
import os
import time
from typing import TYPE_CHECKING, Any

from bubblespec.common.types import SamplingParams

if TYPE_CHECKING:
    from collections.abc import Awaitable

    from bubblespec.worker.engine import EngineOutput, VllmEngine

__all__ = ["CHECKS", "SelfCheckFailed", "require_self_checks", "run_self_checks"]

logger = logging.getLogger(__name__)
CHECKS = ("proposer", "drafts", "sampler", "reload")
_PROMPT = (1, 5, 9, 14, 20, 27)
_TOKENS = 8


class SelfCheckFailed(RuntimeError):
    """One or more start-up self-checks failed; ``problems`` lists them, one line each."""

    def __init__(self, problems: list[str]):
        super().__init__("worker self-checks failed (the worker will not serve):\n  - " + "\n  - ".join(problems))
        self.problems = problems


async def _greedy(engine: VllmEngine, key: str, drafts: tuple = ()) -> EngineOutput:
    from bubblespec.worker.engine import EngineRequest

    sp = SamplingParams(temperature=0.0, max_tokens=_TOKENS, ignore_eos=True)
    prompt = tuple(t % max(engine.info.vocab_size, 1) for t in _PROMPT)
    final = None
    async for out in engine.generate(EngineRequest(f"bubblespec-selfcheck-{key}-{os.urandom(4).hex()}", prompt, sp,
                                                   drafts, use_drafts=bool(drafts))):
        final = out
    if final is None or len(final.token_ids) != _TOKENS:
        raise RuntimeError(f"a {_TOKENS}-token greedy request returned {None if final is None else len(final.token_ids)} tokens")
    if len(final.logprobs) != len(final.token_ids) or not all(math.isfinite(x) and x <= 0 for x in final.logprobs):
        raise RuntimeError(f"logprobs do not match the tokens: {len(final.logprobs)} for {len(final.token_ids)} tokens")
    return final


async def _check_drafts(engine: VllmEngine, plain: EngineOutput) -> list[str]:
    drafted = await _greedy(engine, "draft", (("history", tuple(plain.token_ids)),))
    problems = []
    if drafted.token_ids != plain.token_ids:
        problems.append(f"drafts: greedy output changed when given its own tokens as a draft "
                        f"({list(plain.token_ids)} -> {list(drafted.token_ids)}): speculative decoding is not exact here")
    if drafted.provenance.accepted() <= 0:
        problems.append(f"drafts: a request carrying its own greedy output as a draft accepted no draft tokens "
                        f"(drafted {drafted.provenance.drafted()}): draft ids do not reach the BubbleSpec proposer "
                        "(custom_class hook or SamplingParams.extra_args changed?)")
    return problems


async def _check_sampler(llm: Any) -> list[str]:
    problems = []
    for rank, r in enumerate(await llm.collective_rpc("bubblespec_check_sampler")):
        if r["fix_wanted"] and not r["patched"]:
            problems.append(f"sampler: rank {rank}: vllm.v1.sample.rejection_sampler.expand_batch_to_tokens is not "
                            "BubbleSpec's CPU fix although cpu_sampler_fix is on (the patch did not take)")
        if not r["ok"]:
            detail = r["error"] or f"{r['expected']} came back as {[round(v, 4) for v in r['got']]}"
            fix = "" if r["patched"] else " and the CPU fix is not installed (EngineSettings.cpu_sampler_fix)"
            problems.append(f"sampler: rank {rank} ({r['device']}): rejection_sampler.expand_batch_to_tokens corrupts "
                            f"float per-request parameters ({detail}){fix}: sampled speculative decoding would draw "
                            "from the wrong distribution")
    return problems


async def _check_reload(engine: VllmEngine, plain: EngineOutput) -> list[str]:
    model = engine.settings.model
    if not os.path.isdir(model):
        logger.warning("self-check: weights reload not checked: %r is not a local model directory", model)
        return []
    try:
        await engine.load_weights(model)
    except Exception as exc:  # noqa: BLE001 - reported as this check's problem
        return [(f"reload: reloading the weights from {model!r} or resetting the prefix cache failed: "
                 f"{type(exc).__name__}: {exc}")]
    again = await _greedy(engine, "reload")
    if again.token_ids != plain.token_ids:
        return [(f"reload: greedy output changed after reloading the same weights "
                 f"({list(plain.token_ids)} -> {list(again.token_ids)})")]
    return []


async def run_self_checks(engine: VllmEngine) -> list[str]:
    """Run the checks on a started ``VllmEngine``; the problems found (empty: all passed).
    Never raises for a failed check: an exception inside one becomes its problem."""
    started = time.monotonic()
    llm = engine._llm
    assert llm is not None, "engine not started"
    problems: list[str] = []
    plain = None
    try:
        plain = await _greedy(engine, "plain")
    except Exception as exc:  # noqa: BLE001 - reported as a problem
        problems.append(f"generate: a greedy request failed: {type(exc).__name__}: {exc}")
    if engine.settings.num_speculative_tokens > 0:
        if not engine.info.speculation or not all(await llm.collective_rpc("bubblespec_attach")):
            problems.append("proposer: the BubbleSpec proposer is not attached to the model runner "
                            "(vLLM's custom_class speculative_config hook did not build it)")
        elif plain is not None:
            problems += await _guarded("drafts", _check_drafts(engine, plain))
        problems += await _guarded("sampler", _check_sampler(llm))
    if plain is not None:
        problems += await _guarded("reload", _check_reload(engine, plain))
    logger.info("self-checks %s in %.1fs", "passed" if not problems else f"FAILED ({len(problems)})",
                time.monotonic() - started)
    return problems


async def _guarded(name: str, check: Awaitable[list[str]]) -> list[str]:
    try:
        return await check
    except Exception as exc:  # noqa: BLE001 - a check that breaks is a failed check
        return [f"{name}: the check itself failed: {type(exc).__name__}: {exc}"]


async def require_self_checks(engine: Any) -> bool:
    """``run_self_checks``: True if they all passed, ``SelfCheckFailed`` if any failed. With
    ``EngineSettings.self_checks`` off: a loud warning and False."""
    if not engine.settings.self_checks:
        logger.error("worker self-checks are OFF (self_checks=False): UNSAFE, nothing verifies that drafts, "
                     "the CPU sampler fix or weight reloads work on this vLLM")
        return False
    problems = await run_self_checks(engine)
    if problems:
        raise SelfCheckFailed(problems)
    return True
