"""Draft lengths for a batch's critical path (pure: numpy, no vLLM).

The paying rule (``draft_index.DraftLength``) maximises a batch's tokens per second: a draft
token is worth proposing where its expected gain beats the batch's rate. In a synchronous RL
step whose requests all start together, the step does not end when the batch has made
enough tokens, but when its *last* request does. A draft token for a request that will end
early anyway only makes every pass slower; the same token for the request that will end last
shortens the step. On an engine where verifying draft tokens costs real time (a CPU, a
compute-bound batch) the throughput rule spreads drafts over the whole batch, and the few
long requests that decide the step crawl along with everyone's verification cost.

The model: a pass costs ``T0 + c * (draft tokens in the pass)``. Request ``i`` has ``L_i``
tokens of draft left ahead of it (the rest of the candidate that continues it: for a
``future`` or ``history`` draft, a prediction of how much it still has to generate) and a
per-token acceptance ``a_i``; drafting ``k`` tokens makes it ``E_i(k) = (1 - a_i**(k+1)) /
(1 - a_i)`` tokens a pass (``k + 1`` at ``a_i = 1``). For the batch to be done within ``P``
passes, request ``i`` needs the least ``k_i`` with ``L_i / E_i(k_i) <= P``, and the batch
takes about ``P * (T0 + c * sum(k_i))``. ``makespan_draft_tokens`` tries a geometric grid of
``P`` from the fewest passes the allowed draft lengths reach to the most passes without drafts
(``max L_i``, which it always includes: the rule never picks a plan its own model says is
slower than not drafting) and returns the ``k_i`` of the cheapest plan. The long requests get
deep drafts, the short ones none. It is recomputed every engine step, so as the long requests
advance and the short ones end, the plan follows.

A request may also have ``U_i`` tokens to generate past its draft, one a pass (``undrafted``):
it then takes ``L_i / E_i(k_i) + U_i`` passes. The proposer uses it for the requests no
candidate continues (``L_i = 0``, ``U_i`` = the scheduler's predicted length less what it
generated): where such a request ends the batch, drafting the others deep cannot shorten
the batch and only slows every pass of it, so the plan drafts only what would end later.

The proposer applies the lengths to the rows a candidate continues; the rest (no candidate, so
at most self-suffix drafts) keep the throughput rule (``proposer.BubbleSpecProposer``). Where
more requests will join the batch before its last one ends (a queue deeper than the engine),
the plan still ends the current batch's last request soonest, which is what frees its slot.
"""

from __future__ import annotations

import numpy as np
from numpy.typing import ArrayLike

__all__ = ["GRID_POINTS", "makespan_draft_tokens"]

GRID_POINTS = 16
"""Pass targets tried between the fewest and the most passes (geometric)."""


def makespan_draft_tokens(remaining: ArrayLike, accept: ArrayLike, most: ArrayLike, pass_seconds: float,
                          draft_token_seconds: float, undrafted: ArrayLike | None = None) -> np.ndarray:
    """Draft tokens per request (int array) that minimise the modelled time until the last of
    them ends (module docstring). ``remaining``: draft tokens left ahead of each request;
    ``accept``: each one's per-token acceptance (0-1); ``most``: each one's cap;
    ``pass_seconds``: a pass without drafts (``T0``); ``draft_token_seconds``: ``c``;
    ``undrafted``: tokens each request is predicted to generate past its draft, one per pass
    (``U_i``, default none): a request with no draft at all is ``remaining`` 0 and ``undrafted``
    its predicted length, and it may be the one that ends the batch. Every pass target of the
    grid is evaluated at once (a grid x batch array): ~0.1 ms for a batch of 64."""
    L = np.asarray(remaining, dtype=np.float64)
    U = np.zeros(len(L)) if undrafted is None else np.maximum(np.asarray(undrafted, dtype=np.float64), 0.0)
    a = np.clip(np.asarray(accept, dtype=np.float64), 0.0, 1.0)
    m = np.minimum(np.asarray(most, dtype=np.float64), L)
    zeros = np.zeros(len(L), dtype=np.int64)
    if len(L) == 0 or pass_seconds <= 0 or draft_token_seconds < 0 or not np.any((L > 1) & (m > 0) & (a > 0)):
        return zeros
    sure = a >= 1.0
    q = np.clip(a, 1e-9, 1.0 - 1e-9)  # the geometric form's acceptance (unused where sure)
    log_q, one_minus_q = np.log(q), 1.0 - q

    def per_pass(k: np.ndarray) -> np.ndarray:  # expected tokens a pass gives each request drafting k
        return np.where(sure, k + 1.0, -np.expm1(log_q * (k + 1.0)) / one_minus_q)

    p_max = float(np.max(L + U))
    p_min = float(np.max(L / per_pass(m) + U))
    if p_min >= p_max:
        return zeros
    # np.geomspace's grid with its ends exact, without its checks (~50 us of a call a pass)
    targets = np.exp(np.linspace(np.log(p_min), np.log(p_max), GRID_POINTS))
    targets[0], targets[-1] = p_min, p_max
    targets = targets[:, None]
    needed = L / np.maximum(targets - U, 1e-9)  # tokens a pass each needs on its draft, per target
    k_geo = np.ceil(np.log(np.maximum(1.0 - one_minus_q * needed, 1e-300)) / log_q - 1.0 - 1e-9)
    k = np.where(sure, np.ceil(needed - 1.0 - 1e-9), k_geo)
    k = np.clip(np.where(needed <= 1.0, 0.0, k), 0.0, m)
    passes = np.max(L / per_pass(k) + U, axis=1)
    cost = passes * (pass_seconds + draft_token_seconds * k.sum(axis=1))
    best = int(np.argmin(cost))  # the last target is max(L + U): no drafts, the plan to beat
    return k[best].astype(np.int64) if cost[best] < p_max * pass_seconds else zeros
