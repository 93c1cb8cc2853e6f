"""A beam search's state and its step rule, step for step the algorithm of Hugging Face
``generate(num_beams=k, do_sample=False)`` (transformers 4.5x/5.x), so outputs can be compared
token for token.

Each step every running beam proposes its top ``2k`` next tokens (log-probabilities from the
model runner). Over all beams the ``2k`` best continuations by cumulative log-probability are
kept; among the first ``k`` of them, those that end (EOS, or the length limit) become finished
hypotheses scored ``cum_logprob / generated_len ** length_penalty`` and compete for the ``k``
finished slots; the ``k`` best continuations that did not end become the next running beams.
The search stops when (``early_stopping``) ``k`` hypotheses are finished, when no running beam
can still beat the worst finished one (HF's heuristic), or when every continuation ended.

Pure arithmetic over scores and token lists (layer 1, beside ``sequence.py``, so a
``SequenceGroup`` can hold it typed); ``core/beam_search.py`` maps it onto a request's sequences.
"""

from __future__ import annotations

from dataclasses import dataclass, field

_NEG = -1.0e9  # HF's "impossible" score


@dataclass(slots=True)
class BeamHypothesis:
    """A finished beam: its generated tokens, raw cumulative log-probability and ranking score."""

    output_token_ids: list[int]
    cum_logprob: float
    score: float
    finish_reason: str  # "stop" (ended with EOS) or "length"


@dataclass(slots=True)
class BeamStep:
    """What a step decided: new running beams as ``(parent index, token, cumulative logprob)``
    (parent index into the previous running list), and whether the search is over."""

    running: list[tuple[int, int, float]]
    done: bool


@dataclass(slots=True)
class BeamSearchState:
    beam_width: int
    max_tokens: int
    length_penalty: float = 1.0
    early_stopping: bool | str = False
    eos_token_id: int | None = None  # None: EOS is an ordinary token (ignore_eos)
    running_scores: list[float] = field(default_factory=lambda: [0.0])
    finished: list[BeamHypothesis] = field(default_factory=list)  # best first, at most beam_width
    num_generated: int = 0
    heuristic_unsatisfied: bool = True
    # Candidates of running beams that sampled this step, waiting for their siblings (seq_id -> {token: logprob}).
    pending: dict[int, dict[int, float]] = field(default_factory=dict)

    @property
    def num_candidates(self) -> int:
        """Next-token candidates each running beam must report: HF's ``beams_to_keep``."""
        return max(2, 1 + (self.eos_token_id is not None)) * self.beam_width

    def step(self, outputs: list[list[int]], candidates: list[dict[int, float]]) -> BeamStep:
        """Advance by one token. ``outputs[i]`` / ``candidates[i]``: generated tokens and next-token
        log-probabilities (at least ``num_candidates`` best) of running beam ``i``."""
        k = self.beam_width
        keep = self.num_candidates
        pairs = zip(self.running_scores, candidates, strict=True)
        flat = [(score + lp, i, tok) for i, (score, cand) in enumerate(pairs) for tok, lp in cand.items()]
        flat.sort(key=lambda c: (-c[0], c[1], c[2]))
        top = flat[:keep]
        at_limit = self.num_generated + 1 >= self.max_tokens
        hits = [at_limit or (self.eos_token_id is not None and tok == self.eos_token_id) for _, _, tok in top]

        # Finished hypotheses: ending candidates among the first k compete for the k slots.
        full = len(self.finished) == k
        if self.heuristic_unsatisfied and not (full and self.early_stopping is True):
            norm = (self.num_generated + 1) ** self.length_penalty
            new = [BeamHypothesis(outputs[i] + [tok], acc, acc / norm,
                                  "stop" if (self.eos_token_id is not None and tok == self.eos_token_id) else "length")
                   for j, (acc, i, tok) in enumerate(top) if j < k and hits[j]]
            if new:
                merged = self.finished + new
                merged.sort(key=lambda h: -h.score)  # stable: earlier slots win ties, as HF's merge
                self.finished = merged[:k]

        # Next running beams: the best continuations that did not end.
        ranked = sorted(range(len(top)), key=lambda j: -(top[j][0] + (_NEG if hits[j] else 0.0)))[:k]
        running = [(top[j][1], top[j][2], top[j][0] + (_NEG if hits[j] else 0.0)) for j in ranked]
        self.running_scores = [acc for _, _, acc in running]
        self.num_generated += 1

        # HF's early-stop heuristic: can the best running beam still beat the worst finished one?
        if self.early_stopping == "never" and self.length_penalty > 0.0:
            best_len = self.max_tokens
        else:
            best_len = self.num_generated
        best_possible = self.running_scores[0] / (best_len ** self.length_penalty)
        worst_finished = min(h.score for h in self.finished) if len(self.finished) == k else _NEG
        self.heuristic_unsatisfied = self.heuristic_unsatisfied and best_possible > worst_finished
        done = (not self.heuristic_unsatisfied or (len(self.finished) == k and self.early_stopping is True)
                or all(hits))
        return BeamStep(running, done)
