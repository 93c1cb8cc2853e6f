"""When speculation pays: step time against tokens per step, measured on this machine as the
engine runs, and the number of drafts per sequence that maximises expected tokens per second.

A decode step on a CPU streams every weight once whatever the batch, so verifying ``k`` drafts
costs little at one sequence and nearly ``k + 1`` times as much at 64 (the matmuls become
compute-bound): the same drafts that double one stream's speed would slow a full batch (vLLM's
users saw exactly that: vllm#19254, #16258). The model therefore learns ``t(T)``, the model time
of a step that computes ``T`` tokens, from every step (an average per bucket of about 9 % width
in ``T``, trusted after a few samples), and each step picks

    k* = argmax_k  (C + sum_i E_i(min(k, a_i))) / t(T_0 + sum_i min(k, a_i))

where sequence ``i`` has ``a_i`` drafts on offer and accepts each next draft with probability
``alpha_i`` (learnt per sequence), ``E(m) = 1 + alpha + ... + alpha^m`` is the tokens a run of
``m`` drafts yields, ``C`` the tokens the other sequences yield and ``T_0`` the step's tokens
without drafts. A bucket not measured enough borrows the nearest smaller one's time: optimistic,
so speculation is tried at a new size until it is measured, then judged by what it cost.
"""

from __future__ import annotations

import math
from bisect import bisect_left

_EMA = 0.2  # weight of a new measurement, once a bucket has _MEAN_SAMPLES
_MEAN_SAMPLES = 8
_KNOWN = 3  # samples before a bucket's time is trusted
_MARGIN = 1.03  # speculation must beat none by 3 % (measurements are noisy)


def _bucket(num_tokens: int) -> int:
    return num_tokens if num_tokens <= 16 else 16 + round(8 * math.log2(num_tokens / 16))


class StepCostModel:
    """``t(T)``: the average model time of a step computing ``T`` tokens, by bucket of ``T``.

    A bucket's first ``_MEAN_SAMPLES`` steps are averaged, later ones move it as an exponential
    average. A bucket with fewer than ``_KNOWN`` samples is not trusted yet (one noisy step must
    not switch speculation off at that size for good): it borrows the nearest smaller trusted
    bucket's time, which is optimistic, so the size gets tried and measured again."""

    def __init__(self) -> None:
        self._t: dict[int, float] = {}
        self._n: dict[int, int] = {}
        self._known: list[int] = []  # sorted buckets with at least _KNOWN samples

    def observe(self, num_tokens: int, seconds: float) -> None:
        if num_tokens <= 0 or seconds <= 0:
            return
        b = _bucket(num_tokens)
        n = self._n.get(b, 0) + 1
        self._n[b] = n
        old = self._t.get(b, seconds)
        self._t[b] = old + (seconds - old) * (1 / n if n <= _MEAN_SAMPLES else _EMA)
        if n == _KNOWN:
            self._known.insert(bisect_left(self._known, b), b)

    def estimate(self, num_tokens: int) -> float | None:
        """The measured time for ``num_tokens``; not measured enough: the nearest smaller trusted
        bucket's (then the nearest larger's, then the bucket's own few samples); ``None`` before any step."""
        b = _bucket(num_tokens)
        if self._n.get(b, 0) >= _KNOWN:
            return self._t[b]
        if self._known:
            i = bisect_left(self._known, b)
            return self._t[self._known[i - 1]] if i else self._t[self._known[0]]
        return self._t.get(b) or next(iter(self._t.values()), None)


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
        return max_k  # nothing measured yet: try, and learn
    best_k, best_rate = 0, (other_tokens + len(offers)) / t0 * _MARGIN
    for k in range(1, max_k + 1):
        extra = sum(min(k, a) for a, _ in offers)
        t = cost.estimate(base_tokens + extra) or t0
        rate = (other_tokens + sum(expected_tokens(alpha, min(k, a)) for a, alpha in offers)) / t
        if rate > best_rate:
            best_k, best_rate = k, rate
    return best_k
