"""A BubbleSpec proposer that drops every draft: what the worker looks like when draft ids no
longer reach the proposer (a vLLM whose hook or ``extra_args`` plumbing changed). It attaches
like the real one, so only the start-up self-check that needs accepted drafts can notice."""

from __future__ import annotations

from typing import Any

from bubblespec.worker.proposer import BubbleSpecProposer

PATH = "tests.support.dropping_proposer.DroppingProposer"


class DroppingProposer(BubbleSpecProposer):
    def propose(self, sampled_token_ids, num_tokens_no_spec, token_ids_cpu, **_: Any):
        return [[] for _ in sampled_token_ids]
