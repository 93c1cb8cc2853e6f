"""Plans: how many tokens each sequence of a request computes next (vLLM V1's unified rule) and
whether the pool has the blocks for them. A plan is a value, a list of ``SlotRequest``; nothing
changes until the scheduler applies it (``allocate``, or ``Scheduler._admit``)."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from pagellm.config import SchedulerConfig
from pagellm.core.encoder_cache_manager import EncoderCacheManager
from pagellm.core.kv_cache_manager import KVCacheBlocks, KVCacheManager, SlotRequest
from pagellm.core.scheduler_output import CacheOps, ScheduledSequence
from pagellm.core.step_decisions import LeftOut
from pagellm.sequence import Sequence, SequenceGroup


@dataclass(slots=True)
class StepInProgress:
    """What one ``Scheduler.schedule()`` call has decided so far; its phases add to it in turn."""

    token_budget: int
    ops: CacheOps = field(default_factory=CacheOps)
    scheduled: list[tuple[SequenceGroup, list[SlotRequest]]] = field(default_factory=list)
    preempted: list[SequenceGroup] = field(default_factory=list)  # out of blocks (phase 1)
    forced: list[SequenceGroup] = field(default_factory=list)  # pushed out by a better request (phase 0)
    waiting_stop: str = LeftOut.TOKEN_BUDGET  # why admissions stopped (the step trace's LeftOut)
    lora_skipped: list[str] = field(default_factory=list)  # passed over for their adapter this step
    encoder: EncoderCacheManager | None = None

    def add(self, group: SequenceGroup, plan: list[SlotRequest]) -> None:
        self.scheduled.append((group, plan))
        self.token_budget -= sum(r.num_new_tokens for r in plan)
        if self.encoder is not None and group.mm_features:  # the images its chunks overlap
            for r in plan:
                self.encoder.schedule(group, r.num_computed_tokens, r.num_new_tokens)


class StepPlanner:
    """The scheduler's arithmetic over one request at a time: token counts and block fit."""

    def __init__(self, config: SchedulerConfig, kv_cache_manager: KVCacheManager, max_model_len: int,
                 encoder: EncoderCacheManager | None = None) -> None:
        self.config = config
        self.kv = kv_cache_manager
        self.max_model_len = max_model_len
        self.encoder = encoder  # (None: a text-only model)

    def plan(self, group: SequenceGroup, token_budget: int) -> list[SlotRequest]:
        """The group's live sequences' next tokens, in order, within the budget (a decoding
        sequence's drafts count as tokens to compute: they are verified in the same pass)."""
        plan = []
        for seq in group.live_seqs():
            if token_budget <= 0:
                break
            n = self.num_new_tokens(seq.num_tokens + self.num_drafts(seq, group), seq.num_computed_tokens,
                                     token_budget)
            n = self.encoder_cap(group, seq.num_computed_tokens, n)
            if n > 0:  # 0: a beam that sampled and waits for its siblings
                plan.append(SlotRequest(seq, seq.num_computed_tokens, n))
                token_budget -= n
        return plan

    def plan_admission(self, group: SequenceGroup, token_budget: int) -> list[SlotRequest]:
        """Like ``_plan`` for a waiting group, each sequence's prefix-cache hit counted as computed.
        A value: the sequences are not touched until ``_admit`` applies it."""
        kv = self.kv
        plan = []
        for seq in group.live_seqs():
            if token_budget <= 0:
                break
            # (vLLM's rule: prompt logprobs, and mean or first-token pooling, need every prompt
            # position computed, so no hits; last-token pooling takes them)
            no_hits = group.sampling_params.prompt_logprobs is not None or group.pooling in ("MEAN", "CLS")
            hits: KVCacheBlocks | list = [] if no_hits else kv.get_computed_blocks(seq, group.hash_key)
            computed = len(hits) * kv.block_size
            n = self.encoder_cap(group, computed, self.num_new_tokens(seq.num_tokens, computed, token_budget))
            plan.append(SlotRequest(seq, computed, n, hits))
            token_budget -= n
        return plan

    def encoder_cap(self, group: SequenceGroup, start: int, n: int) -> int:
        """``n`` tokens from ``start``, cut before the first image whose rows can be neither found
        in the encoder cache nor encoded this step."""
        if self.encoder is None or not group.mm_features:
            return n
        return self.encoder.num_new_tokens(group, start, n)

    def num_drafts(self, seq: Sequence, group: SequenceGroup) -> int:
        """How many of ``seq``'s drafts may be verified: none unless it is decoding (a prefill,
        a recompute or a swapped-in sequence computes its known tokens first); none past
        ``max_model_len``; none past ``max_tokens`` (the token after the last draft is free)."""
        k = len(seq.spec_token_ids)
        if not k or seq.num_computed_tokens != seq.num_tokens - 1:
            return 0
        k = min(k, self.max_model_len - seq.num_tokens)
        max_tokens = group.sampling_params.max_tokens
        if max_tokens is not None:
            k = min(k, max_tokens - seq.num_output_tokens - 1)
        return max(k, 0)

    def num_new_tokens(self, num_tokens: int, num_computed_tokens: int, token_budget: int) -> int:
        """The unified rule: every token not yet computed, capped by the chunk size and the budget."""
        return min(num_tokens - num_computed_tokens, self.config.prefill_chunk_cap, token_budget)

    def pending_block_hashes(self, groups: Iterable[SequenceGroup]) -> set[bytes]:
        """Hashes of the full blocks that these (running) groups have yet to compute and cache."""
        bs = self.kv.block_size
        return {h for group in groups for seq in group.live_seqs()
                for h in seq.block_hashes[seq.num_computed_tokens // bs:]}

    def allocate(self, plan: list[SlotRequest]) -> bool:
        """All of the plan's blocks, or nothing (and nothing changes)."""
        kv = self.kv
        if kv.num_new_blocks(plan) > kv.num_free_blocks:
            return False
        for r in plan:
            if kv.allocate_slots(r.seq, r.num_new_tokens) is None:
                raise RuntimeError(f"allocate_slots failed for sequence {r.seq.seq_id} after num_new_blocks "
                                   "said the pool had room")
        return True

    def admissible(self, plan: list[SlotRequest], has_running: bool) -> bool:
        """Whether ``plan`` fits now; trims it to the sequences that fit when nobody is running."""
        kv = self.kv
        if not self.config.enable_chunked_prefill and any(
                r.num_computed_tokens + r.num_new_tokens < r.seq.num_tokens for r in plan):
            return False  # a whole prompt or nothing
        if has_running:
            return kv.num_new_blocks(plan) + kv.watermark_blocks <= kv.num_free_blocks
        # An empty pool must admit something, without a watermark: the sequences that fit now (a
        # recomputing group may get the rest of its sequences' tokens in later steps).
        while len(plan) > 1 and kv.num_new_blocks(plan) > kv.num_free_blocks:
            plan.pop()
        return kv.num_new_blocks(plan) <= kv.num_free_blocks

    def why_not_admissible(self, plan: list[SlotRequest]) -> str:
        kv = self.kv
        if not self.config.enable_chunked_prefill and any(
                r.num_computed_tokens + r.num_new_tokens < r.seq.num_tokens for r in plan):
            return LeftOut.WHOLE_PROMPT
        return LeftOut.NO_FREE_BLOCKS if kv.num_new_blocks(plan) > kv.num_free_blocks else LeftOut.WATERMARK

    def allocate_lookahead(self, scheduled: list[tuple[SequenceGroup, list[SlotRequest]]],
                           num_lookahead_tokens: int) -> None:
        """Best effort, after every admission: slots past the scheduled tokens of each sampling
        sequence (not beams), where the draft model writes its drafts; none where the pool is
        short (the worker then drafts only as far as the slots go)."""
        kv = self.kv
        for group, plan in scheduled:
            if group.beam_state is not None:
                continue
            for r in plan:
                if r.num_computed_tokens + r.num_new_tokens >= r.seq.num_tokens:
                    kv.allocate_slots(r.seq, r.num_new_tokens + num_lookahead_tokens)

    def make_scheduled(self, group: SequenceGroup, seq: Sequence, n: int,
                       new_seq_id: Callable[[], int]) -> ScheduledSequence:
        """What the worker needs of ``seq``'s ``n`` tokens this step (``new_seq_id`` names the
        forks of a first sample)."""
        start = seq.num_computed_tokens
        # Tokens past the known ones are drafts (trimmed to what the budget left: ``plan``).
        num_spec = start + n - seq.num_tokens
        do_sample = num_spec >= 0 and group.pooling is None
        token_ids = seq.token_ids_range(start, start + n - max(num_spec, 0))
        spec = seq.spec_token_ids[:num_spec] if num_spec > 0 else None
        if spec:
            token_ids = token_ids + spec
        sample_ids = None
        if do_sample and not group.forked and group.num_samples > 1 and group.beam_state is None:
            # The request's first sample: draw one token per future sequence from this row.
            sample_ids = [seq.seq_id] + [new_seq_id() for _ in range(group.num_samples - 1)]
        return ScheduledSequence(
            request_id=group.request_id,
            seq_id=seq.seq_id,
            token_ids=token_ids,
            num_computed_tokens=start,
            block_ids=self.kv.get_block_ids(seq.seq_id),
            group_block_ids=self.kv.get_group_block_ids(seq.seq_id) if self.kv.num_groups > 1 else None,
            do_sample=do_sample,
            sampling_params=group.sampling_params,
            output_token_ids=seq.output_token_ids,
            prompt_token_ids=seq.prompt_token_ids,
            sample_seq_ids=sample_ids,
            spec_token_ids=spec,
            mm_spans=[(f.offset, f.length, f.mm_hash) for f in group.mm_features if f.overlaps(start, start + n)]
            or None,
            mrope_layout=[(f.offset, f.length, *f.mrope_grid) for f in group.mm_features if f.mrope_grid] or None,
        )
