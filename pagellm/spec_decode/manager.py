"""``SpecDecodeManager``: the engine's side of speculative decoding.

After each step the engine asks it for drafts (``propose``): every running sequence that is
decoding (not a beam, not under a grammar) gets up to ``k`` proposed tokens in
``Sequence.spec_token_ids``, ``k`` chosen by the cost model for the coming step; the scheduler
schedules them and rolls back what the rejection sampler refuses. ``record`` takes each verified
run's result (acceptance per sequence, the engine's statistics, the request's metrics),
``observe_step`` each step's model time.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping

from pagellm.config import SpeculativeConfig
from pagellm.core.scheduler_output import SchedulerOutput
from pagellm.metrics import IterationStats
from pagellm.sequence import Sequence, SequenceGroup
from pagellm.spec_decode.cost_model import StepCostModel, choose_k
from pagellm.spec_decode.proposers import DraftModelProposer, create_proposer

_ALPHA_PRIOR = 0.5  # a new sequence's acceptance before it has drafted
_ALPHA_EMA = 0.3
_ALPHA_DRIFT = 0.05  # per step off
_EXPLORE_MIN, _EXPLORE_MAX = 8, 1024


class SpecDecodeManager:
    """Proposes drafts each step and keeps the measurements that decide how many."""

    def __init__(self, config: SpeculativeConfig, stats: IterationStats | None = None,
                 skip: Callable[[SequenceGroup], bool] = lambda group: False) -> None:
        """``stats``: the engine's statistics; ``skip``: requests that must not draft."""
        self.config = config
        self.stats = stats if stats is not None else IterationStats()
        self.skip = skip
        self.proposer = create_proposer(config)
        self.cost = StepCostModel()
        self._alpha: dict[int, float] = {}  # seq_id -> per-draft acceptance, learnt
        # Exploration: after this many steps with speculation off, one step drafts one token per
        # sequence anyway (the cheapest step that measures what drafts cost), so that a guess or an
        # unlucky measurement cannot switch speculation off for good; the interval doubles each
        # time it stays off (at most one step in 1024 then) and resets when speculation pays.
        self._explore_every = _EXPLORE_MIN
        self._off_steps = 0

    def observe_step(self, num_decode_rows: int, model_seconds: float) -> None:
        """A step of decodes only (drafted positions included): its model time."""
        self.cost.observe(num_decode_rows, model_seconds)

    def record(self, group: SequenceGroup, seq_id: int, num_drafts: int, num_accepted: int,
               stats: IterationStats) -> None:
        """One verified run: ``num_accepted`` of ``num_drafts`` drafts were accepted."""
        stats.record_spec(num_drafts, num_accepted)
        m = group.metrics
        m.spec_num_drafts += 1
        m.spec_num_draft_tokens += num_drafts
        m.spec_num_accepted_tokens += num_accepted
        # Per-draft acceptance of a geometric run: accepted / (accepted + 1 if one was refused).
        observed = num_accepted / (num_accepted + (num_accepted < num_drafts))
        old = self._alpha.get(seq_id, _ALPHA_PRIOR)
        self._alpha[seq_id] = old + _ALPHA_EMA * (observed - old)

    def propose(self, running: Iterable[SequenceGroup]) -> None:
        """Drafts for the next step's decoding sequences.
        A draft model's drafts were decided (``decorate_step``) and computed during the step:
        they are only handed out here."""
        stats = self.stats
        decoding, other = self._decoding(running, self.skip)
        if not decoding:
            return
        by_model = isinstance(self.proposer, DraftModelProposer)
        max_k, explore = (self.config.num_speculative_tokens, False) if by_model else \
            self._max_k([s.seq_id for s in decoding], other, stats)
        if not max_k:
            return
        offers = [(seq, self.proposer.propose(seq, max_k)) for seq in decoding]
        offers = [(seq, d) for seq, d in offers if d]
        if by_model and not offers:
            return
        k = max_k
        if self.config.cost_model and offers and not explore:
            k = choose_k(self.cost, len(decoding) + other, other + len(decoding) - len(offers),
                         [(len(d), self._alpha.get(s.seq_id, _ALPHA_PRIOR)) for s, d in offers], max_k)
            if k == 0:
                self._off(stats)
                return
        if offers and not explore:
            self._off_steps = 0
            self._explore_every = _EXPLORE_MIN
        stats.spec_k = k
        for seq, d in offers:
            seq.spec_token_ids = d[:k]

    def decorate_step(self, so: SchedulerOutput, requests: Mapping[str, SequenceGroup]) -> None:
        """A draft model proposes during the step (after the target samples): decide now, for the
        sequences that sample in it, how many drafts it computes (``so.draft_k``). The engine
        registers this decorator only for a draft model."""
        skip = self.skip
        sampling = [s.seq_id for s in so.scheduled
                    if s.do_sample and requests[s.request_id].beam_state is None and not skip(requests[s.request_id])]
        if not sampling:
            return
        other = sum(1 for s in so.scheduled if s.do_sample) - len(sampling)
        k, _ = self._max_k(sampling, other, self.stats)
        if k:
            so.draft_k = dict.fromkeys(sampling, k)

    @staticmethod
    def _decoding(running: Iterable[SequenceGroup], skip: Callable[[SequenceGroup], bool]
                  ) -> tuple[list[Sequence], int]:
        """Sequences that decode next (those that may draft, and how many others)."""
        decoding: list[Sequence] = []
        other = 0
        for group in running:
            drafting = group.beam_state is None and not skip(group)
            for seq in group.live_seqs():
                if seq.num_tokens - seq.num_computed_tokens == 1:
                    if drafting:
                        decoding.append(seq)
                    else:
                        other += 1
        return decoding, other

    def _max_k(self, seq_ids: list[int], other: int, stats: IterationStats) -> tuple[int, bool]:
        """``(most drafts worth proposing per sequence, exploring?)``; 0 = speculation off this
        step (counted). Would drafts pay even if every sequence had a full run on offer? If not,
        the proposer's time is not spent on them."""
        cfg = self.config
        max_k = cfg.num_speculative_tokens
        if cfg.disable_by_batch_size is not None and len(seq_ids) + other >= cfg.disable_by_batch_size:
            self._off(stats)
            return 0, False
        if not cfg.cost_model:
            return max_k, False
        best = choose_k(self.cost, len(seq_ids) + other, other,
                        [(max_k, self._alpha.get(i, _ALPHA_PRIOR)) for i in seq_ids], max_k)
        if best:
            return best, False
        if self._off_steps + 1 >= self._explore_every and self.cost.estimate(1) is not None:
            # Exploring: one draft each, the cheapest step that measures what drafts cost.
            self._off_steps = 0
            self._explore_every = min(2 * self._explore_every, _EXPLORE_MAX)
            return 1, True
        for i in seq_ids:  # unmeasured while off: drift back towards the prior (optimism)
            a = self._alpha.get(i)
            if a is not None:
                self._alpha[i] = a + _ALPHA_DRIFT * (_ALPHA_PRIOR - a)
        self._off(stats)
        return 0, False

    def receive_model_drafts(self, drafts: dict[int, tuple[int, list[int]]]) -> None:
        if isinstance(self.proposer, DraftModelProposer):
            self.proposer.receive(drafts)

    def _off(self, stats: IterationStats) -> None:
        stats.spec_steps_off += 1
        stats.spec_k = 0
        self._off_steps += 1

    def request_finished(self, group: SequenceGroup) -> None:
        for seq in group.seqs:
            self._alpha.pop(seq.seq_id, None)
        self.proposer.request_finished(group.seqs)
