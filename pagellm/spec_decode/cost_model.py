"""When speculation pays: step time against decode rows per step, measured on this machine as
the engine runs, and the number of drafts per sequence that maximises expected tokens per second.

A decode step on a CPU streams every weight once whatever the batch, so verifying ``k`` drafts
costs little at one sequence and nearly ``k + 1`` times as much at 64 (the matmuls become
compute-bound, and each verified position reads its context's K/V like a decode does): the same
drafts that double one stream's speed would slow a full batch (vLLM's users saw exactly that:
vllm#19254, #16258). The model therefore learns ``t(T)``, the model time of a step of ``T``
decode rows (steps with a prefill chunk are not comparable and are left out), and each step picks

    k* = argmax_k  (C + sum_i E_i(min(k, a_i))) / t(T_0 + sum_i min(k, a_i))

where sequence ``i`` has ``a_i`` drafts on offer and accepts each next draft with probability
``alpha_i`` (learnt per sequence), ``E(m) = 1 + alpha + ... + alpha^m`` is the tokens a run of
``m`` drafts yields, ``C`` the tokens the other sequences yield and ``T_0`` the step's rows
without drafts.

``t`` keeps an average per bucket of about 9 % width in ``T``. Between measured buckets it
interpolates; above the largest it extrapolates with the slope of the two largest, or, with a
single bucket measured, as if every row cost the same (the pessimistic guess: no speculation is
tried on a guess that it is free). The manager's exploration steps (one draft per sequence now
and then) measure the slope.
"""

from __future__ import annotations

import math
from bisect import bisect_left

_EMA = 0.2  # weight of a new measurement, once a bucket has _MEAN_SAMPLES
_MEAN_SAMPLES = 8
_MARGIN = 1.03  # speculation must beat none by 3 % (measurements are noisy)


def _bucket(num_tokens: int) -> int:
    return num_tokens if num_tokens <= 16 else 16 + round(8 * math.log2(num_tokens / 16))


class StepCostModel:
    """``t(T)``: the average model time of a step of ``T`` decode rows, by bucket of ``T`` (a
    bucket's first ``_MEAN_SAMPLES`` steps averaged, later ones as an exponential average)."""

    def __init__(self) -> None:
        self._t: dict[int, float] = {}
        self._n: dict[int, int] = {}
        self._rows: dict[int, float] = {}  # mean T of each bucket (for interpolation)
        self._keys: list[int] = []  # sorted buckets measured

    def observe(self, num_rows: int, seconds: float) -> None:
        if num_rows <= 0 or seconds <= 0:
            return
        b = _bucket(num_rows)
        n = self._n.get(b, 0) + 1
        self._n[b] = n
        w = 1 / n if n <= _MEAN_SAMPLES else _EMA
        self._t[b] = self._t.get(b, seconds) + (seconds - self._t.get(b, seconds)) * w
        self._rows[b] = self._rows.get(b, num_rows) + (num_rows - self._rows.get(b, num_rows)) * w
        if n == 1:
            self._keys.insert(bisect_left(self._keys, b), b)

    def estimate(self, num_rows: int) -> float | None:
        """``t(num_rows)`` (see the module docstring); ``None`` before any decode step."""
        keys = self._keys
        if not keys:
            return None
        b = _bucket(num_rows)
        if b in self._t:
            return self._t[b]
        i = bisect_left(keys, b)
        if i == len(keys):  # above every measurement: extrapolate
            hi = keys[-1]
            if len(keys) == 1:
                return self._t[hi] * num_rows / self._rows[hi]
            lo = keys[-2]
            slope = max(0.0, (self._t[hi] - self._t[lo]) / max(self._rows[hi] - self._rows[lo], 1e-9))
            return self._t[hi] + slope * (num_rows - self._rows[hi])
        if i == 0:  # below every measurement: no more than the smallest
            return self._t[keys[0]]
        lo, hi = keys[i - 1], keys[i]
        f = (num_rows - self._rows[lo]) / max(self._rows[hi] - self._rows[lo], 1e-9)
        return self._t[lo] + (self._t[hi] - self._t[lo]) * min(max(f, 0.0), 1.0)


def expected_tokens(alpha: float, m: int) -> float:
    """Tokens a run of ``m`` drafts yields when each next draft is accepted with ``alpha``."""
    return sum(alpha ** j for j in range(m + 1))


def choose_k(cost: StepCostModel, base_tokens: int, other_tokens: float, offers: list[tuple[int, float]],
             max_k: int) -> int:
    """The best number of drafts per sequence (0 = no speculation this step) for sequences that
    offer ``(drafts available, acceptance)``; see the module docstring."""
    if not offers:
        return 0
    t0 = cost.estimate(base_tokens)
    if t0 is None:
        return 0  # no decode step measured yet
    best_k, best_rate = 0, (other_tokens + len(offers)) / t0 * _MARGIN
    for k in range(1, max_k + 1):
        extra = sum(min(k, a) for a, _ in offers)
        t = cost.estimate(base_tokens + extra) or t0
        rate = (other_tokens + sum(expected_tokens(alpha, min(k, a)) for a, alpha in offers)) / t
        if rate > best_rate:
            best_k, best_rate = k, rate
    return best_k
