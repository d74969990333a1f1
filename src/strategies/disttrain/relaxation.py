"""The orchestration's convex sub-problems (orchestration.py's docstring): each unit's
relaxed coefficients under one choice of options, the closed-form optimum of a sub-problem
(`solve_relaxed`), a lower bound of it that costs a few array operations (`relaxed_bound`),
and every sub-problem of a request in the order the integer recovery visits them, solved
in closed form only as far as that visit reaches (`Subproblems`).

At 1296 GPUs and a batch of 1920 there are some 170,000 sub-problems and the recovery
visits a few hundred of the best: the bound, within a few percent of the optimum, leaves
a thousand or so to solve.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, Sequence

import numpy as np

from src.strategies.disttrain.profile import Setting

INF = float("inf")
RELAX_CHUNK = 4096  # sub-problems solved at once
# A bound is lowered by this fraction before it rules a sub-problem out: it and the closed
# form round differently, and every term of both is at least 0.
ROUNDING = 1e-9
# The first band of bounds solved: the recovery mostly stops within 1% of the least.
FIRST_BAND = 0.01
_AXES = ((-1, 1, 1), (1, -1, 1), (1, 1, -1))  # a sub-problem's (encoder, LLM, generator) options
_COLUMNS = ("a", "low", "high", "beta", "F", "gamma")  # a sub-problem table's, per unit


@dataclass(frozen=True)
class RelaxedOption:
    """One unit at one (TP, DP, options) for one LLM DP: its relaxed coefficients."""

    setting: Setting
    dp: int
    b: int
    F: float
    a: float
    low: float
    high: float
    beta: float
    tail: float  # the unit's tail on one stage; on n GPUs, its stages' tails are at least tail TP DP / n

    @property
    def gamma(self) -> float:
        return self.tail * self.setting.tp * self.dp

    def coefficients(self) -> tuple[float, float, float, float, float, float]:
        return (self.F, self.a, self.low, -self.high, self.beta, self.tail)

    def row(self) -> tuple[float, float, float, float, float, float]:
        """Its columns of a sub-problem table (_COLUMNS)."""
        return (self.a, self.low, self.high, self.beta, self.F, self.gamma)


def undominated(options: list[RelaxedOption]) -> list[RelaxedOption]:
    """The options no other option is at least as good as in every coefficient (warm-up,
    stage coefficient, GPU bounds, p2p, end of iteration) and better in one: their
    relaxed optima, and their tails, can only be worse. Of equal ones, the first."""
    kept: list[RelaxedOption] = []
    for option in sorted(options, key=RelaxedOption.coefficients):
        mine = option.coefficients()
        if not any(all(x <= y for x, y in zip(other.coefficients(), mine)) for other in kept):
            kept.append(option)
    return kept


class Subproblems:
    """Every (encoder, LLM, generator) option triple of every LLM DP. Sub-problem i is
    numbered block by block (a block per LLM DP), in C order of its (encoder, LLM,
    generator) options in the block: the order that breaks ties between equal optima.
    Each has its `relaxed_bound`; `in_order` solves the closed form as it goes."""

    def __init__(self, spaces: Sequence[tuple[int, Sequence[Sequence[RelaxedOption]]]], batch: int, n: float) -> None:
        """spaces: per LLM DP, the (encoder, LLM, generator) options; n: the GPUs."""
        self.n = n
        self.spaces = spaces
        shapes = np.array([[len(options) for options in units] for _, units in spaces])
        self.starts = np.concatenate([[0], np.cumsum(shapes.prod(axis=1))])  # block j: [starts[j], starts[j + 1])
        self.count = int(self.starts[-1])
        self.strides = np.stack([shapes[:, 1] * shapes[:, 2], shapes[:, 2]], axis=1)
        self.shapes = shapes
        self.k = np.array([float(batch // dp_lm - 1) for dp_lm, _ in spaces])  # K = m - 1
        tables = [[np.array([o.row() for o in options]) for options in units] for _, units in spaces]
        for units in tables:
            # The LLM's tail ends the iteration (its stages hold most of the parameters), less
            # the encoder's last backward it overlaps (`solve`).
            units[0][:, 5] = units[2][:, 5] = 0.0
        # Per unit, every block's options one after another, and where each block's begin.
        self.rows = [np.concatenate([units[u] for units in tables]) for u in range(3)]
        self.first = [np.concatenate([[0], np.cumsum(shapes[:-1, u])]) for u in range(3)]
        bounds = []
        for units, k in zip(tables, self.k.tolist()):
            a, low, high, beta, f, gamma = ([units[u][:, c].reshape(_AXES[u]) for u in range(3)] for c in range(len(_COLUMNS)))
            bounds.append(relaxed_bound(a, low, high, beta, f[0] + f[1] + f[2], k, n, gamma, f[0]).ravel())
        self.bounds = np.concatenate(bounds)
        self.solved = 0

    def locate(self, index: int) -> tuple[int, tuple[RelaxedOption, RelaxedOption, RelaxedOption]]:
        """Sub-problem `index`: its LLM DP and its (encoder, LLM, generator) options."""
        block = int(np.searchsorted(self.starts, index, side="right")) - 1
        dp_lm, units = self.spaces[block]
        e, l, g = (int(i) for i in np.unravel_index(index - int(self.starts[block]), tuple(self.shapes[block])))
        return dp_lm, (units[0][e], units[1][l], units[2][g])

    def solve(self, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Lower bounds of these sub-problems' optima, and their taus, each column alone
        (the same to the last bit as solved among all of them). The LLM's tail ends the
        iteration no sooner than the encoder's last backward, which takes at most the
        encoder's F: the optimum with the tail less F_enc (never below 0) is at least both
        solve_relaxed's optimum without the tail and its optimum with it less F_enc."""
        self.solved += indices.size
        block = np.searchsorted(self.starts, indices, side="right") - 1
        local = indices - self.starts[block]
        strides = self.strides[block]
        picks = (local // strides[:, 0], local % strides[:, 0] // strides[:, 1], local % strides[:, 1])
        rows = [self.rows[u][self.first[u][block] + pick] for u, pick in enumerate(picks)]
        a, low, high, beta, warm, gamma = (np.stack([r[:, c] for r in rows]) for c in range(len(_COLUMNS)))
        k = self.k[block]
        values, taus = np.empty(indices.size), np.empty(indices.size)
        for first in range(0, indices.size, RELAX_CHUNK):  # columns that stay in cache
            cut = slice(first, first + RELAX_CHUNK)
            columns = (a[:, cut], low[:, cut], high[:, cut], beta[:, cut], warm[:, cut].sum(axis=0), k[cut], self.n)
            untailed, untailed_tau = solve_relaxed(*columns)
            tailed, tailed_tau = solve_relaxed(*columns, gamma[:, cut])
            tailed -= warm[0, cut]
            values[cut] = np.maximum(untailed, tailed)
            taus[cut] = np.where(tailed >= untailed, tailed_tau, untailed_tau)
        return values, taus

    def in_order(self) -> Iterator[tuple[float, int, float]]:
        """(relaxed optimum, sub-problem, tau) of every feasible sub-problem, ascending, ties
        in sub-problem order; the closed form solved a band of bounds at a time. A
        sub-problem whose bound is at least `ceiling` has an optimum at least `ceiling`:
        once every one bounded below it is solved, those of them whose optimum lies below
        it are the next in order, and the rest wait for the next band (its margin over
        the least bound doubled, the last band unbounded)."""
        finite = self.bounds[np.isfinite(self.bounds)]
        if not finite.size:
            return
        lowest = float(finite.min())
        relaxed, taus = np.full(self.count, INF), np.full(self.count, INF)
        waiting = np.empty(0, dtype=np.intp)  # solved, feasible, at or above the ceiling
        floor, margin = -INF, FIRST_BAND
        while floor < INF:
            ceiling = lowest + margin * abs(lowest) if margin < 1 else INF
            fresh = np.nonzero((self.bounds >= floor) & (self.bounds < ceiling))[0]
            relaxed[fresh], taus[fresh] = self.solve(fresh)
            waiting = np.concatenate([waiting, fresh[np.isfinite(relaxed[fresh])]])
            below = relaxed[waiting] < ceiling
            ready, waiting = np.sort(waiting[below]), waiting[~below]
            ready = ready[np.argsort(relaxed[ready], kind="stable")]
            yield from zip(relaxed[ready].tolist(), ready.tolist(), taus[ready].tolist())
            floor, margin = ceiling, 2 * margin


def solve_relaxed(
    a: np.ndarray,
    low: np.ndarray,
    high: np.ndarray,
    beta: np.ndarray,
    warm: np.ndarray,
    k: float | np.ndarray,
    n: float,
    gamma: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """The closed-form optimum (orchestration.py's docstring) of many sub-problems at once.
    Arrays a, low, high, beta (and gamma, the tails' coefficients) are (3, ...): one row
    per unit; warm and k (one per sub-problem or shared) are (...). Returns (optimal
    value, tau), inf where infeasible."""
    k = np.broadcast_to(np.asarray(k, dtype=float), warm.shape)
    with np.errstate(divide="ignore", invalid="ignore"):
        feasible = (low.sum(axis=0) <= n + 1e-9) & np.all(low <= high + 1e-9, axis=0)
        breaks = a / low  # n_u = low_u for tau >= a_u / low_u
        order = np.argsort(-breaks, axis=0)  # descending breakpoints
        bp = np.take_along_axis(breaks, order, axis=0)
        a_s = np.take_along_axis(a, order, axis=0)
        low_s = np.take_along_axis(low, order, axis=0)
        ba_s = np.take_along_axis(beta * a, order, axis=0)
        zero = np.zeros_like(a[:1])
        top_a = np.concatenate([zero, np.cumsum(a_s, axis=0)])  # S_k: sum of a over the k active units
        rest_low = low_s.sum(axis=0, keepdims=True) - np.concatenate([zero, np.cumsum(low_s, axis=0)])
        top_ba = np.concatenate([zero, np.cumsum(ba_s, axis=0)])
        upper = np.concatenate([np.full_like(zero, INF), bp])  # piece k: [bp_(k+1), bp_(k))
        lower = np.concatenate([bp, zero])
        # tau_N: the smallest tau with sum_u max(low_u, a_u / tau) <= n, piece by piece.
        cross = np.where(n - rest_low > 1e-12, top_a / (n - rest_low), INF)
        start = np.maximum(cross, lower)
        start = np.where(start < upper * (1 + 1e-12), start, INF)
        tau_lo = np.maximum(start.min(axis=0), (a / high).max(axis=0))
        # Candidates: tau_lo, every breakpoint, every piece's stationary point sqrt(S_beta / K)
        # (and sqrt(S_beta / (K + gamma_u / a_u)) where a unit's tail gamma_u / n_u grows with tau).
        slopes = [k] if gamma is None else [k, k + (gamma / a).max(axis=0)]
        stationary = [np.where(slope > 0, np.sqrt(top_ba / slope), bp[:1]) for slope in slopes]
        candidates = np.concatenate([tau_lo[None], bp, *stationary])
        candidates = np.maximum(candidates, tau_lo[None])
        counts = np.maximum(low[None], a[None] / candidates[:, None])
        values = warm[None] + (beta[None] * counts).sum(axis=1) + k[None] * candidates
        if gamma is not None:
            values = values + (gamma[None] / counts).max(axis=1)
        best = values.argmin(axis=0)
        value = np.take_along_axis(values, best[None], axis=0)[0]
        tau = np.take_along_axis(candidates, best[None], axis=0)[0]
        ok = feasible & np.isfinite(tau_lo) & np.isfinite(value)
        return np.where(ok, value, INF), np.where(ok, tau, INF)


def relaxed_bound(
    a: Sequence[np.ndarray],
    low: Sequence[np.ndarray],
    high: Sequence[np.ndarray],
    beta: Sequence[np.ndarray],
    warm: np.ndarray,
    k: float,
    n: float,
    gamma: Sequence[np.ndarray],
    overlap: np.ndarray,
) -> np.ndarray:
    """A lower bound of solve_relaxed's optimum, its unit rows given as three arrays that
    broadcast together (a, low, high, beta, gamma; warm their W): no breakpoints, no sort.

    With n_u(tau) = max(L_u, a_u / tau), a feasible tau has sum_u n_u(tau) <= N, so
    tau >= tau0 = max(sum_u a_u / N, max_u a_u / min(U_u, N - sum_(v != u) L_v)). For tau
    >= tau0, sum_u beta_u n_u(tau) >= max(C, B / tau) (C = sum_u beta_u L_u, B = sum_u
    beta_u a_u), and n_u(tau) <= n_u(tau0), so a tail gamma_u / n_u(tau) >= gamma_u /
    n_u(tau0). So the optimum is at least W + min over tau >= tau0 of phi(tau) = K tau +
    max(C, B / tau), plus max_u gamma_u / n_u(tau0) less `overlap` (Subproblems.solve's
    encoder backward), never below 0. phi is convex: K tau + B / tau up to
    B / C (least at sqrt(B / K)), then increasing, so its minimum is at sqrt(B / K) clipped
    to [tau0, max(tau0, B / C)]. Infinite where the units' fewest GPUs exceed N; lowered
    by ROUNDING."""
    with np.errstate(divide="ignore", invalid="ignore"):
        fewest = low[0] + low[1] + low[2]
        tau0 = (a[0] + a[1] + a[2]) / n
        for u in range(3):
            tau0 = np.maximum(tau0, a[u] / np.minimum(high[u], n - (fewest - low[u])))
        b = beta[0] * a[0] + beta[1] * a[1] + beta[2] * a[2]
        c = beta[0] * low[0] + beta[1] * low[1] + beta[2] * low[2]
        # fmax/fmin skip the NaN of 0 / 0 (no p2p at all, or K = 0 and B = 0): tau0 then.
        tau = np.fmin(np.fmax(np.sqrt(b / k), tau0), np.fmax(tau0, b / c))
        bound = warm + k * tau + np.maximum(c, b / tau)
        tails = [g / np.maximum(l, x / tau0) for g, l, x in zip(gamma, low, a) if np.any(g)]
        if tails:
            bound = bound + np.maximum(0.0, (tails[0] if len(tails) == 1 else np.maximum.reduce(tails)) - overlap)
        bound = np.where(fewest > n + 1e-6, INF, bound * (1 - ROUNDING))
        # A bound that does not evaluate is 0, which every optimum is at least.
        return np.nan_to_num(bound, nan=0.0, posinf=INF)
