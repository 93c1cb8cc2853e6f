"""Sampler: penalties -> min_tokens ban -> greedy, or temperature -> top-k / top-p / min-p -> sample.

Random rows draw in one of two exact ways: in PyTorch (``draw_native``, on any device) with the
"exponential race" (``argmax(p / q)``, ``q ~ Exp(1)`` per token) after sorting for top-k / top-p;
on CPU (``draw_cpu``) with the sampling kernel, which filters without sorting the vocabulary and
draws by inverse CDF from one uniform number per row (``kernels/sampling.c``; 24-44x faster for 64
rows of a 49k vocabulary, ``benchmarks/sampling.py``). A row with a ``seed`` draws its randomness from its own
``torch.Generator``, so its tokens do not depend on what else is in the batch. Logprobs are those of the model's raw
distribution (vLLM's default), whatever the sampling transforms did.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from pagellm.kernels import cpu_ops, sampling
from pagellm.layers.custom_op import CustomOp
from pagellm.sampling_params import SamplingParams


@dataclass(slots=True)
class SamplingRow:
    """What the sampler needs to know about one sampling sequence."""

    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    generator: torch.Generator | None


@dataclass(slots=True)
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[float]
    top_logprobs: list[dict[int, tuple[float, int]] | None]


def apply_token_bitmask(logits: torch.Tensor, bitmask: Any, rows: list[int], mask_rows: list[int]) -> None:
    """Structured output: ``logits[rows[i]]`` keeps only the tokens set in ``bitmask[mask_rows[i]]``
    (numpy ``int32 [R, ceil(V / 32)]``, bit ``t % 32`` of word ``t // 32``), in place; the rest
    become ``-inf`` before penalties, sampling and logprobs, so the constrained distribution is
    what every later stage sees (beam search included). The compiled kernel on CPU, else the words
    unpacked by shifts on the logits' device (a GPU's mask is applied there)."""
    if not rows:
        return
    if logits.device.type == "cpu" and logits.dtype == torch.float32 and cpu_ops.available():
        cpu_ops.apply_token_bitmask(logits, bitmask, rows, mask_rows)
        return
    vocab = logits.shape[1]
    # The packed words go to the logits' device (32x smaller than a mask) and are unpacked there.
    words = torch.from_numpy(np.ascontiguousarray(bitmask[mask_rows], dtype=np.int32)).to(logits.device)
    shifts = torch.arange(32, dtype=torch.int32, device=logits.device)
    banned = ((words.unsqueeze(-1) >> shifts) & 1).view(len(mask_rows), -1)[:, :vocab] == 0
    idx = torch.tensor(rows, dtype=torch.long, device=logits.device)
    logits[idx] = logits[idx].masked_fill(banned, float("-inf"))


def apply_penalties(logits: torch.Tensor, rows: list[SamplingRow]) -> None:
    """Repetition (prompt + output, HF/vLLM style), frequency and presence (output only), in place."""
    vocab = logits.shape[1]
    for i, row in enumerate(rows):
        p = row.params
        if not p.has_penalties:
            continue
        out = torch.tensor(row.output_token_ids, dtype=torch.long, device=logits.device)
        out = out[out < vocab]
        if p.repetition_penalty != 1.0:
            seen = torch.tensor(row.prompt_token_ids + row.output_token_ids, dtype=torch.long, device=logits.device)
            seen = torch.unique(seen[seen < vocab])
            vals = logits[i, seen]
            logits[i, seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
        if out.numel() and (p.frequency_penalty or p.presence_penalty):
            counts = torch.bincount(out, minlength=vocab).to(logits.dtype)
            logits[i] -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(logits.dtype)


def apply_min_tokens(logits: torch.Tensor, rows: list[SamplingRow]) -> None:
    """Until ``min_tokens`` are out, EOS and ``stop_token_ids`` cannot be sampled."""
    for i, row in enumerate(rows):
        p = row.params
        if len(row.output_token_ids) < p.min_tokens:
            banned = list(p.stop_token_ids or ())
            if p.eos_token_id is not None and not p.ignore_eos:
                banned.append(p.eos_token_id)
            if banned:
                logits[i, banned] = float("-inf")


def _temperature(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    temps = torch.tensor([p.temperature for p in params], dtype=logits.dtype, device=logits.device)
    return logits / temps[:, None]


def _top_k(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    vocab = logits.shape[1]
    k_t = torch.tensor([p.top_k if 0 < p.top_k < vocab else vocab for p in params], device=logits.device)
    kth = logits.sort(dim=-1, descending=True).values.gather(1, (k_t - 1)[:, None])
    return logits.masked_fill(logits < kth, float("-inf"))


def _top_p(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    p_t = torch.tensor([p.top_p for p in params], dtype=logits.dtype, device=logits.device)
    sorted_logits, idx = logits.sort(dim=-1, descending=True)
    probs = sorted_logits.softmax(dim=-1)
    # Drop a token when the mass strictly before it already reaches top_p (keeps at least one).
    # Rows with top_p = 1 are left alone: their float32 cumsum can round to 1 before the tail.
    drop = ((probs.cumsum(dim=-1) - probs) >= p_t[:, None]) & (p_t < 1.0)[:, None]
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, idx, sorted_logits)


def _min_p(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    m_t = torch.tensor([p.min_p for p in params], dtype=logits.dtype, device=logits.device)
    probs = logits.softmax(dim=-1)
    return logits.masked_fill(probs < m_t[:, None] * probs.max(dim=-1, keepdim=True).values, float("-inf"))


@dataclass(frozen=True, slots=True)
class Filter:
    """One transform of random rows' logits: its name, whether a row's parameters use it (given the
    vocabulary size), and the op over all the rows (a row that does not use it is left as it is)."""

    name: str
    used: Callable[[SamplingParams, int], bool]
    apply: Callable[[torch.Tensor, list[SamplingParams]], torch.Tensor]


# The filters random rows go through, in order: :func:`target_probs` applies every one a row uses.
FILTERS: list[Filter] = [
    Filter("temperature", lambda p, vocab: True, _temperature),
    Filter("top_k", lambda p, vocab: 0 < p.top_k < vocab, _top_k),
    Filter("top_p", lambda p, vocab: p.top_p < 1.0, _top_p),
    Filter("min_p", lambda p, vocab: p.min_p > 0.0, _min_p),
]


def _filter(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Every filter of :data:`FILTERS` some row uses, in order, on the rows of ``logits`` (all random rows)."""
    vocab = logits.shape[1]
    for f in FILTERS:
        if any(f.used(p, vocab) for p in params):
            logits = f.apply(logits, params)
    return logits


def kernel_takes(params: SamplingParams, vocab: int) -> bool:
    """Whether the sampling kernel computes this row's distribution: it uses no filter but those
    the kernel declares (``sampling.KERNEL_FILTERS``). Any other row goes through the reference
    (:func:`target_probs`), in sampling and in the rejection sampler's target alike."""
    return all(f.name in sampling.KERNEL_FILTERS or not f.used(params, vocab) for f in FILTERS)


# ``(greedy tokens of logits, logsumexp of raw)``: one row each. ``logits`` is ``raw`` itself unless
# penalties changed it (then the token comes from them, the logprobs still from ``raw``).
GreedyAndLSE = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


def greedy_and_lse_native(raw: torch.Tensor, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return logits.argmax(dim=-1), torch.logsumexp(raw, dim=-1)


def greedy_and_lse_cpu(raw: torch.Tensor, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One fused pass over each row gives the argmax and the logsumexp (float32 ``[S, V]``)."""
    tokens, lse = cpu_ops.argmax_logsumexp(raw)
    if logits is not raw:
        tokens = cpu_ops.argmax(logits)
    return tokens, lse


# The random rows' tokens: ``(their processed logits, their rows) -> one token each``.
RandomDraw = Callable[[torch.Tensor, list[SamplingRow]], torch.Tensor]


def draw_native(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """The exponential race over :func:`target_probs`: ``argmax(p / q)``, ``q ~ Exp(1)`` per token."""
    probs = target_probs(logits, [r.params for r in rows])
    noise = torch.empty_like(probs)
    for j, row in enumerate(rows):
        if row.generator is not None:
            noise[j].exponential_(generator=row.generator)
        else:
            noise[j].exponential_()
    return (probs / noise).argmax(dim=-1)


def _kernel_rows(logits: torch.Tensor, params: list[SamplingParams], uniforms: torch.Tensor,
                 probs_out: torch.Tensor | None = None) -> tuple[torch.Tensor, list[int]]:
    """The sampling kernel over ``logits`` with each row's filters: ``(tokens, rows it did not take)``
    (rows that use a filter it lacks, and rows with no finite logit)."""
    vocab = logits.shape[1]
    tokens = sampling.sample_rows(logits, [p.temperature for p in params],
                                  [p.top_k if 0 < p.top_k < vocab else 0 for p in params],
                                  [p.top_p for p in params], [p.min_p for p in params], uniforms, probs_out)
    bad = (tokens < 0).nonzero().flatten().tolist()
    if any(f.name not in sampling.KERNEL_FILTERS for f in FILTERS):  # (none today: no per-row check)
        bad = sorted(set(bad) | {j for j, p in enumerate(params) if not kernel_takes(p, vocab)})
    return tokens, bad


def draw_cpu(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """The sampling kernel (float32 on CPU): the same filters as :func:`target_probs`, then an
    inverse-CDF draw with one float64 uniform per row from the row's generator (or torch's global
    one). A row the kernel does not take (a filter it lacks, no finite logit) goes through
    :func:`draw_native`."""
    u = torch.empty(len(rows), dtype=torch.float64)
    shared = [j for j, r in enumerate(rows) if r.generator is None]
    if shared:
        u[shared] = torch.rand(len(shared), dtype=torch.float64)
    for j, r in enumerate(rows):
        if r.generator is not None:
            u[j] = torch.rand(1, dtype=torch.float64, generator=r.generator)
    tokens, bad = _kernel_rows(logits, [r.params for r in rows], u)
    if bad:
        tokens[bad] = draw_native(logits[bad], [rows[j] for j in bad])
    return tokens


# The distribution random rows draw from: ``(their processed logits, their params) -> probs``.
TargetProbs = Callable[[torch.Tensor, list[SamplingParams]], torch.Tensor]


def target_probs_cpu(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """:func:`target_probs` through the sampling kernel (no vocabulary sort); a row it cannot take
    goes through :func:`target_probs`. For speculative decoding's verification."""
    probs = torch.empty(logits.shape, dtype=torch.float32)
    _, bad = _kernel_rows(logits, params, torch.zeros(len(params), dtype=torch.float64), probs)
    if bad:
        probs[bad] = target_probs(logits[bad], [params[j] for j in bad])
    return probs


class Sampler(CustomOp):
    """:func:`sample` with the greedy/logsumexp pass and the random draw chosen once (``select_kernels``)."""

    @property
    def greedy_and_lse(self) -> GreedyAndLSE:
        """The pass ``forward`` uses (for the rejection sampler, which shares it)."""
        return greedy_and_lse_cpu if self.use_kernel else greedy_and_lse_native

    @property
    def target_probs(self) -> TargetProbs:
        """The filtered distribution of random rows as ``forward`` draws from it (for the rejection sampler)."""
        return target_probs_cpu if self.use_kernel and sampling.available() else target_probs

    def forward_native(self, logits: torch.Tensor, rows: list[SamplingRow]) -> SamplerOutput:
        return sample(logits, rows, greedy_and_lse_native)

    def forward_cpu(self, logits: torch.Tensor, rows: list[SamplingRow]) -> SamplerOutput:
        return sample(logits, rows, greedy_and_lse_cpu, draw_cpu if sampling.available() else draw_native)


def sample(logits: torch.Tensor, rows: list[SamplingRow], greedy_and_lse: GreedyAndLSE = greedy_and_lse_native,
           draw: RandomDraw = draw_native) -> SamplerOutput:
    """``logits [S, V]`` (float32, one row per sampling sequence) -> one token per row."""
    raw, logits, tokens, lse = process_logits(logits, rows, greedy_and_lse)
    random_idx = [i for i, r in enumerate(rows) if r.params.temperature > 0.0]
    if len(random_idx) == len(rows):  # no copy of the logits when every row samples
        tokens = draw(logits, rows)
    elif random_idx:
        tokens[random_idx] = draw(logits[random_idx], [rows[i] for i in random_idx])
    return logprobs_of(raw, lse, tokens, rows)


def process_logits(logits: torch.Tensor, rows: list[SamplingRow], greedy_and_lse: GreedyAndLSE
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(raw, processed, greedy tokens, logsumexp of raw)``: penalties and the ``min_tokens`` ban
    applied to a copy (``processed`` is ``raw`` itself when neither applies)."""
    raw = logits
    if any(r.params.has_penalties for r in rows) or any(len(r.output_token_ids) < r.params.min_tokens for r in rows):
        logits = logits.clone()
        apply_penalties(logits, rows)
        apply_min_tokens(logits, rows)
    # Logprobs are of the raw distribution: ``raw - logsumexp(raw)``, never materialised whole
    # unless top logprobs are asked for.
    tokens, lse = greedy_and_lse(raw, logits)
    return raw, logits, tokens, lse


def target_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """The distribution random rows sample from: temperature, top-k / top-p / min-p, softmax."""
    return _filter(logits, params).softmax(dim=-1)


def logprobs_of(raw: torch.Tensor, lse: torch.Tensor, tokens: torch.Tensor, rows: list[SamplingRow]) -> SamplerOutput:
    """Each row's chosen token with its logprob (and rank and top-k when asked for) under ``raw``."""
    token_list = tokens.tolist()
    chosen = (raw.gather(1, tokens[:, None]).squeeze(1) - lse).tolist()
    tops: list[dict[int, tuple[float, int]] | None] = [None] * len(rows)
    want = [i for i, r in enumerate(rows) if r.params.logprobs is not None]
    if want:
        k_max = max(rows[i].params.logprobs or 0 for i in want)
        sub = raw[want] - lse[want, None]
        top_vals, top_ids = sub.topk(k_max, dim=-1) if k_max > 0 else (sub[:, :0], sub[:, :0].long())
        ranks = (sub > sub.gather(1, tokens[want][:, None])).sum(dim=-1) + 1
        for j, i in enumerate(want):
            k = rows[i].params.logprobs or 0
            d = {int(t): (float(v), r + 1) for r, (t, v) in
                 enumerate(zip(top_ids[j, :k].tolist(), top_vals[j, :k].tolist(), strict=True))}
            d.setdefault(token_list[i], (chosen[i], int(ranks[j])))
            tops[i] = d
    return SamplerOutput(token_list, chosen, tops)
