"""What one draft token adds to an engine pass, measured from the engine's own passes (pure numpy).

The paying rule (``DraftLength``) needs ``draft_token_seconds``, which depends on the model, the
hardware and the kernels. Rather than have every deployment run ``bubblespec calibrate`` and
pass the figure by hand, the proposer fits it as the engine runs. Each clean pass (no request
joined, so no prefill in it; every row sampled) gives its seconds ``y`` (timed from the
runner's ``execute_model``: the engine's work between passes is left out), its rows ``n``, the
rows that had a draft ``m`` and the draft tokens it verified ``d``, and

    y = base + per_row x n + spec x [d > 0] + per_drafted_row x m + per_draft_token x d

is fitted over the last ``window`` clean passes, the newest weighing 1 and one
``1 / (1 - forget)`` passes back 1/e, so the figure follows the engine as it warms up or its
load changes. ``spec`` is what a pass pays for verifying any draft at all (the rejection
sampler's set-up, the drafts' metadata): measured apart, it is not charged to the tokens (on
vLLM's CPU engine it was worth tens of draft tokens, so a linear fit without it read 3-40x the
marginal cost and turned drafting off where it paid). ``per_drafted_row`` is what each drafted
request adds beyond its tokens (on an H100, one attention kernel throughout, 13-28 us a sequence
against 15.5 us a draft token: docs/SIMULATOR.md). It can be told from the tokens' term only
where drafted rows draft different lengths; where the data cannot tell them apart (its estimate
not sure to ``max_rel_error``, or not above zero), the fit without it decides, and
``per_drafted_request_seconds`` is 0.

**Robust to a shared machine.** A pass the OS preempts takes many times its work, and on a busy
host such passes are many (docs/results/2026-11-28-ci-time-and-draft-cost.md): least squares on
them reads a residual spread of several passes and is never sure of a draft token's cost, a
small part of one pass. The fit therefore starts from a least-absolute-
deviations fit (iteratively reweighted) and then gives each pass Tukey's biweight by its
residual over the residuals' robust scale (1.4826 x their weighted median absolute value):
passes ``TUKEY`` scales or more off the fit weigh nothing, so stalls, however many below half
of the passes, neither move the figure nor widen its uncertainty.

``seconds_per_draft_token`` is 0 (unknown: the acceptance rule decides) until the fit has seen
``min_steps`` clean passes, ``min_drafted`` of them with drafts (weighed by age), and its
estimate is sure to ``max_rel_error`` (standard error over the estimate). It then keeps the
last sure estimate while the data stops telling, for at most ``expire_steps`` passes in which
it held drafts back and none was verified: a figure too high turns drafting off, which would
otherwise leave it nothing to learn from, so it expires and the acceptance rule drafts (and
measures) again. Passes with nothing to draft (requests without drafts, candidates that
continue no one) do not count towards that. An estimate at or below zero (drafts free as far as
the clock can tell) reads as 0 too."""

from __future__ import annotations

import math

import numpy as np

__all__ = ["DraftCostFit"]

TERMS = 5
"""base, per row, spec (any draft), per drafted row, per draft token: the columns of the fit."""
WITHOUT_DRAFTED_ROWS = (0, 1, 2, 4)
"""The fit before the per-drafted-row term, used where the data cannot tell that term apart."""
TUKEY = 4.685
"""Tukey's biweight constant, in robust scales (95% efficiency under normal noise)."""
LAD_ROUNDS, TUKEY_ROUNDS = 5, 4
"""Reweighting rounds of the least-absolute-deviations start and of the biweight."""


class DraftCostFit:
    """The draft token's (and a drafted row's) cost, fitted from clean passes (module docstring)."""

    def __init__(self, forget: float = 0.995, min_steps: int = 64, min_drafted: float = 16.0,
                 max_rel_error: float = 0.25, refit_every: int = 32, expire_steps: int = 2048, window: int = 1024):
        if not 0 < forget < 1:
            raise ValueError(f"forget: must be in (0, 1), got {forget!r}")
        if window < min_steps or window < 2 * TERMS:
            raise ValueError(f"window: must hold at least min_steps and {2 * TERMS} passes, got {window!r}")
        self.forget, self.min_steps, self.min_drafted = forget, min_steps, min_drafted
        self.max_rel_error, self.refit_every, self.expire_steps = max_rel_error, refit_every, expire_steps
        self.steps = 0
        """Clean passes observed."""
        self._x = np.zeros((window, TERMS))  # ring buffer of the last ``window`` passes' columns
        self._y = np.zeros(window)  # and their seconds
        self._ages = forget ** np.arange(window)  # weight by age, newest first
        self._since_drafted = 0  # clean passes that held drafts back since the last one with drafts
        self._coef: np.ndarray | None = None  # the last fit, all five terms (per drafted row 0 where not told apart)
        self._sigma = 0.0  # its robust residual scale
        self.seconds_per_draft_token = 0.0
        """The last sure estimate; 0: none."""
        self.per_drafted_request_seconds = 0.0
        """The last fit's cost of each request with a draft beyond its tokens, where sure; 0: not told apart."""

    @property
    def spec_seconds(self) -> float:
        """The last fit's fixed cost of a pass with drafts (0: no fit yet)."""
        return float(self._coef[2]) if self._coef is not None else 0.0

    def observe(self, rows: int, drafts: int, seconds: float, held_back: bool = True,
                drafted_rows: int | None = None) -> None:
        """One clean pass: ``rows`` in the batch, ``drafts`` verified over ``drafted_rows`` of
        them (None: one row, where any), ``seconds`` taken; ``held_back``: whether the proposal
        before it kept drafts back that a candidate offered."""
        if rows <= 0 or not (math.isfinite(seconds) and seconds > 0):
            return
        if drafted_rows is None:
            drafted_rows = 1 if drafts > 0 else 0
        slot = self.steps % len(self._y)
        self._x[slot] = (1.0, float(rows), float(drafts > 0), float(drafted_rows), float(drafts))
        self._y[slot] = seconds
        if drafts > 0:
            self._since_drafted = 0
        elif held_back:
            self._since_drafted += 1
        self.steps += 1
        if self._since_drafted >= self.expire_steps:
            self.seconds_per_draft_token = 0.0
        elif self.steps >= self.min_steps and self.steps % self.refit_every == 0:
            x, y, w = self._window()
            if float(w @ (x[:, 2] > 0)) >= self.min_drafted:
                self._refit(x, y, w)

    def _window(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The passes held, newest first, with their weights by age."""
        n = min(self.steps, len(self._y))
        idx = (self.steps - 1 - np.arange(n)) % len(self._y)
        return self._x[idx], self._y[idx], self._ages[:n]

    def _refit(self, x: np.ndarray, y: np.ndarray, ages: np.ndarray) -> None:
        full = _robust_fit(x, y, ages, tuple(range(TERMS)))
        if full is None:
            return
        coef, se, sigma = full
        r, r_se = float(coef[3]), float(se[3])
        if not (r > 0 and r_se <= self.max_rel_error * r):  # not told apart: the fit without it
            reduced = _robust_fit(x, y, ages, WITHOUT_DRAFTED_ROWS)
            if reduced is None:
                return
            coef, se, sigma = reduced
            r = 0.0
        self._coef, self._sigma = coef, sigma
        self.per_drafted_request_seconds = r
        c, c_se = float(coef[4]), float(se[4])
        if c > 0 and c_se <= self.max_rel_error * c:
            self.seconds_per_draft_token = c
        elif c + 2 * c_se <= 0:  # sure that a draft token costs nothing the clock can see
            self.seconds_per_draft_token = 0.0


def _robust_fit(x: np.ndarray, y: np.ndarray, ages: np.ndarray,
                terms: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray, float] | None:
    """Coefficients (all ``TERMS``, 0 outside ``terms``), their standard errors and the robust
    residual scale of ``y`` on the columns ``terms``: a least-absolute-deviations start, then
    Tukey's biweight; None where the system cannot be solved."""
    cols = x[:, list(terms)]
    floor = 1e-3 * float(np.median(y))  # a residual scale below 0.1% of a pass is noise-free data
    w = ages
    solved = _weighted_least_squares(cols, y, w, terms)
    if solved is None:
        return None
    coef = solved[0]
    for _ in range(LAD_ROUNDS):
        w = ages / np.maximum(np.abs(y - cols @ coef), floor)
        solved = _weighted_least_squares(cols, y, w, terms)
        if solved is None:
            return None
        coef = solved[0]
    scale = floor
    for _ in range(TUKEY_ROUNDS):
        resid = y - cols @ coef
        scale = max(1.4826 * _weighted_median(np.abs(resid), ages), floor)
        u = resid / (TUKEY * scale)
        w = ages * np.where(np.abs(u) < 1, (1 - u * u) ** 2, 0.0)
        solved = _weighted_least_squares(cols, y, w, terms)
        if solved is None:
            return None
        coef = solved[0]
    _, inv = solved
    resid = y - cols @ coef
    dof = float(w.sum()) - len(terms)
    if dof <= 0:
        return None
    var = float(w @ (resid * resid)) / dof
    full, se = np.zeros(TERMS), np.zeros(TERMS)
    full[list(terms)] = coef
    se[list(terms)] = np.sqrt(np.maximum(0.0, var * np.diag(inv)))
    return full, se, math.sqrt(var)


def _weighted_least_squares(cols: np.ndarray, y: np.ndarray, w: np.ndarray,
                            terms: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray] | None:
    """(coefficients, inverse normal matrix) of ``y`` on ``cols`` weighted by ``w``."""
    xx = (cols * w[:, None]).T @ cols
    # a batch of one size throughout (an engine kept full) makes the rows' term the base's twin,
    # drafts of one length the spec term's, one drafted row a pass the spec term's too: a
    # whisper of ridge on those keeps the system solvable and leaves the draft token's term to
    # the evidence
    for i, term in enumerate(terms):
        if term in (1, 2, 3):
            xx[i, i] += 1e-9 * xx[i, i] + 1e-12
    try:
        inv = np.linalg.inv(xx)
    except np.linalg.LinAlgError:
        return None
    coef = inv @ ((cols * w[:, None]).T @ y)
    if not np.all(np.isfinite(coef)):
        return None
    return coef, inv


def _weighted_median(values: np.ndarray, weights: np.ndarray) -> float:
    order = np.argsort(values)
    cum = np.cumsum(weights[order])
    return float(values[order][np.searchsorted(cum, 0.5 * cum[-1])])
