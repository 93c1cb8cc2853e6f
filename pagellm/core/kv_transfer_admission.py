"""KV transfer in the scheduler (``core/kv_connector.py`` holds the connectors): which waiting
requests load their prefix from a connector, the blocks they load into, what the step's worker
reported back, and which filled blocks are offered for saving.

At its first admission a request whose prefix a connector holds past the local hits gets blocks
for it and waits in ``loading`` (vLLM's ``WAITING_FOR_REMOTE_KVS``) for one step, using none of
the token budget; the step's worker fills the blocks, and ``finish_loads`` caches what arrived
intact and frees the blocks, so the scheduler puts the request back at the head of ``waiting``,
where it finds them as ordinary prefix hits.
"""

from __future__ import annotations

from typing import Any

from pagellm.core.kv_cache_manager import KVCacheManager, SlotRequest
from pagellm.core.kv_connector import KVConnectorScheduler
from pagellm.core.scheduler_output import KVConnectorMetadata, KVConnectorOutput
from pagellm.sequence import SequenceGroup


class KVTransferAdmission:
    """The scheduler's side of one connector: loads at admission, reports after the step, saves."""

    def __init__(self, connector: KVConnectorScheduler, kv_cache_manager: KVCacheManager,
                 failure_policy: str = "recompute") -> None:
        self.connector = connector
        self.kv = kv_cache_manager
        # What a load that fails means: recompute the rest, or end the request with an error.
        self.failure_policy = failure_policy
        self.loading: dict[str, SequenceGroup] = {}  # the requests whose blocks this step fills

    def waiting_for_remote(self, group: SequenceGroup) -> bool:
        """Another engine is still sending ``group``'s prefix: it keeps its place in the queue."""
        return self.connector.waiting_for_remote(group)

    def must_fail(self, group: SequenceGroup) -> bool:
        """Its pushed K/V timed out and the policy is ``fail``: it ends instead of recomputing."""
        return group.kv_transfer.timed_out and self.failure_policy == "fail"

    def start_load(self, group: SequenceGroup, plan: list[SlotRequest], has_running: bool) -> int:
        """Blocks for the K/V the connector holds past ``group``'s local hits, and the group put in
        ``loading`` (the caller takes it out of ``waiting``). Only at a request's first admission,
        once, and for one sequence (forks and beams come later). Returns the number of blocks
        being loaded (0: none, the group is admitted as usual or not)."""
        if group.kv_transfer.load_tried or group.metrics.first_scheduled_time is not None or len(plan) != 1:
            return 0
        kv, first = self.kv, plan[0]
        n = self.connector.get_num_new_matched_tokens(first.seq, first.num_computed_tokens)
        if n <= 0:
            return 0
        load = SlotRequest(first.seq, first.num_computed_tokens, n, first.computed_blocks)
        if kv.num_new_blocks([load]) + (kv.watermark_blocks if has_running else 0) > kv.num_free_blocks:
            return 0  # no room to load into: admitted as usual (or not) instead
        group.kv_transfer.load_tried = True
        seq = first.seq
        seq.num_computed_tokens = first.num_computed_tokens
        if kv.allocate_slots(seq, n, first.computed_blocks) is None:
            raise RuntimeError(f"allocate_slots failed loading request {group.request_id!r} after num_new_blocks "
                               "said the pool had room")
        i0, count = first.num_computed_tokens // kv.block_size, n // kv.block_size
        self.connector.update_state_after_alloc(group.request_id, kv.get_block_ids(seq.seq_id)[i0:i0 + count],
                                                seq.block_hashes[i0:i0 + count])
        self.loading[group.request_id] = group
        return count

    def finish_loads(self, output: KVConnectorOutput | None) -> list[tuple[SequenceGroup, bool]]:
        """After a step: each loading request's blocks that arrived intact become prefix-cache
        blocks and all its blocks go back to the pool. Returns ``(group, failed)`` in loading
        order, ``failed`` when blocks are missing under the ``fail`` policy. Every load issued by
        a step is answered by that step, so nobody stays in ``loading`` longer."""
        if output is not None:
            self.connector.update_connector_output(output)
        kv, bs, stats = self.kv, self.kv.block_size, self.connector.stats
        done = []
        for rid, group in self.loading.items():
            seq = group.seqs[0]
            asked = len(kv.get_block_ids(seq.seq_id)) - seq.num_computed_tokens // bs
            got = min(output.loaded.get(rid, 0), asked) if output is not None else 0
            seq.num_computed_tokens += got * bs
            kv.cache_full_blocks(seq, group.hash_key)
            kv.free(seq)
            seq.num_computed_tokens = 0
            stats.blocks_loaded += got
            stats.load_failures += asked - got
            done.append((group, got < asked and self.failure_policy == "fail"))
        self.loading.clear()
        return done

    def offer_saves(self, scheduled: list[tuple[SequenceGroup, list[SlotRequest]]]) -> KVConnectorMetadata | None:
        """Offer the connector every block this step fills up (drafts excluded: they may be
        rejected), with its chained hash; returns the step's connector metadata (the worker copies
        the blocks the connector keeps after the pass)."""
        kv = self.kv
        bs = kv.block_size
        for group, plan in scheduled:
            for r in plan:
                end = min(r.num_computed_tokens + r.num_new_tokens, r.seq.num_tokens) // bs
                start = r.num_computed_tokens // bs
                n_prompt = len(r.seq.prompt_token_ids)
                done = bool(group.kv_transfer.params) and \
                    r.num_computed_tokens < n_prompt <= r.num_computed_tokens + r.num_new_tokens
                if end <= start and not done:
                    continue
                hashes = kv.block_hashes(r.seq, group.hash_key)
                table = kv.block_tables[r.seq.seq_id]
                for i in range(start, min(end, len(hashes))):
                    self.connector.request_save(table[i].block_id, hashes[i])
                if done:  # the prompt is computed after this step: all its full blocks
                    n = n_prompt // bs
                    self.connector.prompt_done(group, [b.block_id for b in table[:n]], hashes[:n])
        return self.connector.build_connector_meta()

    def stats(self) -> dict[str, Any]:
        """The transfer counters, as ``SchedulerStats`` fields."""
        c = self.connector.stats
        return dict(num_loading_kv=len(self.loading), kv_blocks_loaded=c.blocks_loaded, kv_blocks_saved=c.blocks_saved,
                    kv_bytes_loaded=c.bytes_loaded, kv_bytes_saved=c.bytes_saved, kv_load_seconds=c.load_seconds,
                    kv_load_failures=c.load_failures)
