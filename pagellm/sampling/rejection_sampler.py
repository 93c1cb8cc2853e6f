"""Exact verification of drafted tokens: speculative sampling (Leviathan et al. 2023; vLLM V1's
``RejectionSampler``).

A sequence that scheduled drafts ``d_0 .. d_{k-1}`` runs ``k + 1`` positions: its last known
token, then each draft. Row ``i`` of its logits predicts the token after input ``i``, so draft
``d_i`` is checked against row ``i``, and row ``k`` gives the bonus token::

    inputs:  [last, d_0, d_1, d_2]          rows: p_0  p_1  p_2  p_3
    accept d_0 ~ p_0?  d_1 ~ p_1?  d_2 ~ p_2?  all accepted: bonus ~ p_3

Each ``p_i`` is what plain sampling would draw from at that position: the raw logits after
penalties and the ``min_tokens`` ban (the drafts before it counted as output), temperature,
top-k / top-p / min-p. Greedy rows accept while ``d_i == argmax p_i`` and emit the argmax at the
first mismatch. Random rows accept ``d_i`` with probability ``min(1, p_i(d_i) / q_i(d_i))`` and on
rejection draw from ``max(p_i - q_i, 0)`` renormalised, which makes every emitted token
distributed exactly as ``p`` (``q``: the proposer's distribution; one-hot for n-gram and suffix
drafts, so acceptance is ``p_i(d_i)`` and the residual is ``p_i`` without ``d_i``). A seeded row
draws its uniforms and its residual noise from its own generator.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagellm.sampling.sampler import (
    GreedyAndLSE,
    SamplerOutput,
    SamplingRow,
    TargetProbs,
    greedy_and_lse_native,
    logprobs_of,
    process_logits,
    target_probs,
)


@dataclass(slots=True)
class DraftSpan:
    """One sequence's rows in the logits: ``start .. start + len(draft_token_ids)`` inclusive."""

    start: int
    draft_token_ids: list[int]
    # The proposer's probabilities ``[k, V]`` for each draft position; ``None`` = one-hot drafts.
    draft_probs: torch.Tensor | None = None


def _uniform(gen: torch.Generator | None) -> float:
    return float(torch.rand((), generator=gen)) if gen is not None else float(torch.rand(()))


def _draw(probs: torch.Tensor, gen: torch.Generator | None) -> int:
    """One token from ``probs`` (the exponential race, as the sampler draws)."""
    noise = torch.empty_like(probs)
    if gen is not None:
        noise.exponential_(generator=gen)
    else:
        noise.exponential_()
    return int((probs / noise).argmax())


def residual(p: torch.Tensor, draft_token: int, q: torch.Tensor | None) -> torch.Tensor:
    """``max(p - q, 0)``, renormalised: where a rejected draft's mass goes."""
    if q is None:
        r = p.clone()
        r[draft_token] = 0.0
    else:
        r = (p - q).clamp_min_(0.0)
    total = r.sum()
    # Zero only when p <= q everywhere, i.e. p == q: then the draft cannot have been rejected.
    return r / total if total > 0 else p


def rejection_sample(logits: torch.Tensor, rows: list[SamplingRow], spans: list[DraftSpan],
                     greedy_and_lse: GreedyAndLSE = greedy_and_lse_native,
                     probs_of: TargetProbs = target_probs) -> list[SamplerOutput]:
    """``logits [R, V]`` with one row per position of every span (``rows[i]`` its params, with
    the drafts before position ``i`` appended to its output) -> per span, the emitted tokens in
    order: the accepted drafts, then the correction or the bonus token, each with its logprobs."""
    raw, processed, greedy, lse = process_logits(logits, rows, greedy_and_lse)
    random_rows = [i for i, r in enumerate(rows) if r.params.temperature > 0.0]
    probs = {}
    if random_rows:
        p = probs_of(processed[random_rows], [rows[i].params for i in random_rows])
        probs = {i: p[j] for j, i in enumerate(random_rows)}
    greedy_list = greedy.tolist()
    emitted_rows: list[int] = []
    emitted_tokens: list[int] = []
    counts: list[int] = []
    for span in spans:
        k = len(span.draft_token_ids)
        n_before = len(emitted_rows)
        for i in range(k + 1):
            row = span.start + i
            gen = rows[row].generator
            if i == k:  # every draft accepted: the bonus token
                token = greedy_list[row] if row not in probs else _draw(probs[row], gen)
            else:
                d = span.draft_token_ids[i]
                if row not in probs:
                    token = greedy_list[row]
                    if token == d:
                        emitted_rows.append(row)
                        emitted_tokens.append(token)
                        continue
                else:
                    p_row = probs[row]
                    q = span.draft_probs[i] if span.draft_probs is not None else None
                    q_d = float(q[d]) if q is not None else 1.0
                    if q_d > 0 and _uniform(gen) * q_d < float(p_row[d]):  # u < p(d) / q(d)
                        emitted_rows.append(row)
                        emitted_tokens.append(d)
                        continue
                    token = _draw(residual(p_row, d, q), gen)
            emitted_rows.append(row)
            emitted_tokens.append(token)
            break
        counts.append(len(emitted_rows) - n_before)
    if not emitted_rows:
        return []
    out = logprobs_of(raw[emitted_rows], lse[emitted_rows], torch.tensor(emitted_tokens, dtype=torch.long),
                      [rows[i] for i in emitted_rows])
    result, pos = [], 0
    for n in counts:
        result.append(SamplerOutput(out.token_ids[pos:pos + n], out.logprobs[pos:pos + n],
                                  out.top_logprobs[pos:pos + n]))
        pos += n
    return result
