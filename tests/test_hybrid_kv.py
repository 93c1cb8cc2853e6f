"""The hybrid KV cache manager: layer groups, sliding-window groups that give back what their window
left, prefix hits every group serves, swap / fork / copy-on-write across groups, and random traffic
over mixed groups with every invariant checked after every step. Expected block ids and counts
are worked out here from the window rule (a query at p reads keys p - window < k <= p)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagellm.core.kv_cache_manager import AllocStatus, KVCacheManager, SlotRequest, _group_key
from pagellm.core.kv_cache_spec import FullAttentionSpec, MambaSpec, SlidingWindowSpec, group_layers
from pagellm.sequence import Sequence
from pagellm.utils import cdiv

from conftest_core import TRAFFIC, drive, make_group, make_scheduler

BS = 4


def gemma3_windows(num_layers: int, window: int, every: int = 6) -> list[int | None]:
    """Gemma 3's pattern: every ``every``-th layer global, the others sliding."""
    return [None if (i + 1) % every == 0 else window for i in range(num_layers)]


def test_group_layers_cuts_kinds_into_equal_groups():
    cfg = group_layers(gemma3_windows(18, 512), BS)
    assert cfg.layers_per_page == 3
    assert [g.layer_ids for g in cfg.groups] == [(5, 11, 17), (0, 1, 2), (3, 4, 6), (7, 8, 9), (10, 12, 13),
                                                 (14, 15, 16)]
    assert cfg.specs == [FullAttentionSpec(BS)] + [SlidingWindowSpec(BS, 512)] * 5
    assert cfg.page_slot(13) == (4, 2)
    dense = group_layers([None] * 4, BS)
    assert len(dense.groups) == 1 and dense.layers_per_page == 4 and dense.is_single_full
    mistral = group_layers([64] * 4, BS)  # every layer windowed: one sliding group
    assert mistral.specs == [SlidingWindowSpec(BS, 64)] and mistral.layers_per_page == 4
    off = group_layers(gemma3_windows(18, 512), BS, hybrid=False)
    assert off.is_single_full and off.layers_per_page == 18
    alternating = group_layers([8, None] * 3, BS)  # Gemma 2
    assert [g.layer_ids for g in alternating.groups] == [(1, 3, 5), (0, 2, 4)]
    # Nemotron-H: MLP layers keep nothing (False), in no group, no slot of a page
    mamba = MambaSpec(BS, ((4, 8, 8),), ("float32",))
    nemo = group_layers([mamba, False, None, False, mamba, False], BS)
    assert [g.layer_ids for g in nemo.groups] == [(2,), (0,), (4,)] and nemo.layers_per_page == 1
    with pytest.raises(ValueError, match="layer 1 is in no KV cache group"):
        nemo.page_slot(1)
    assert group_layers([None, False, None], BS).groups[0].layer_ids == (0, 2)
    with pytest.raises(ValueError, match="at least one layer"):
        group_layers([False, False], BS)


def hybrid_manager(num_blocks=64, window=8, num_cpu_blocks=0, caching=True) -> KVCacheManager:
    return KVCacheManager(num_blocks, BS, caching, num_cpu_blocks,
                          kv_cache_config=group_layers([window, None], BS))


def run_prefill(mgr: KVCacheManager, seq: Sequence, chunk: int) -> None:
    """Compute ``seq``'s known tokens in chunks, as the scheduler would, caching full blocks."""
    while seq.num_computed_tokens < seq.num_tokens:
        n = min(chunk, seq.num_tokens - seq.num_computed_tokens)
        assert mgr.allocate_slots(seq, n) is not None
        seq.num_computed_tokens += n
        mgr.cache_full_blocks(seq)
        mgr.check_invariants()


def test_sliding_group_frees_what_its_window_left():
    mgr = hybrid_manager(window=8)
    null = mgr.null_block
    assert null is not None and null.block_id == 0 and mgr.num_blocks == 63
    seq = Sequence(1, list(range(100, 140)))  # 40 tokens, 10 blocks
    run_prefill(mgr, seq, chunk=6)
    full, sliding = mgr.group_tables[0][1], mgr.group_tables[1][1]
    assert len(full) == len(sliding) == 10 and null not in full
    # The last allocation came at num_computed_tokens = 36: the next query at 36 reads keys 29..36,
    # so blocks 0..6 (positions 0..27) had gone.
    assert [b is null for b in sliding] == [True] * 7 + [False] * 3
    assert mgr.num_free_blocks == 63 - 10 - 3
    # Decode: at 40 the window is 33..40, block 8 on; blocks 7 goes back, one block added per group.
    seq.append_token(7, -0.1, None)
    assert mgr.allocate_slots(seq, 1) is not None
    assert [b is null for b in mgr.group_tables[1][1]] == [True] * 8 + [False] * 3
    mgr.check_invariants()
    mgr.free(seq)
    mgr.check_invariants()
    assert mgr.num_free_blocks == mgr.num_blocks


def test_prefix_hit_needs_only_the_window_blocks():
    mgr = hybrid_manager(window=8)
    a = Sequence(1, list(range(200, 233)))  # 33 tokens: 8 full blocks cached in both groups' lives
    run_prefill(mgr, a, chunk=33)
    # One 33-token chunk: nothing was skipped before it ran; blocks 0..7 are full and cached.
    mgr.free(a)
    b = Sequence(2, list(range(200, 233)) + [9, 9, 9])
    hit = mgr.get_computed_blocks(b)
    assert len(hit) == 8  # (36 - 1) // 4 = 8 blocks, all cached in both groups
    # From position 32 the window reads 25..32: blocks 6 and 7 of the sliding group, nulls before.
    assert [blk is mgr.null_block for blk in hit.groups[1]] == [True] * 6 + [False] * 2
    b.num_computed_tokens = 32
    assert mgr.allocate_slots(b, 4, hit) is not None
    mgr.check_invariants()
    assert mgr.group_tables[0][2][:8] == hit.groups[0]


def test_prefix_hit_shrinks_to_where_the_window_blocks_survive():
    mgr = hybrid_manager(window=8)
    a = Sequence(1, list(range(300, 341)))  # 41 tokens, computed in chunks: the sliding group frees
    run_prefill(mgr, a, chunk=4)
    mgr.free(a)
    # Both groups cached blocks 0..9 (each block is full and cached before the window passes it);
    # freed ones are evictable: evict the sliding group's blocks 8 and 9 by hand.
    pool = mgr.block_pool
    for i in (8, 9):
        blk = pool.get_cached_block(_group_key(a.block_hashes[i], 1))
        assert blk is not None and blk.block_hash is not None and blk.ref_cnt == 0
        pool.free_block_queue.remove(blk)  # evicted: unhashed, at the free list's head
        del pool.cached_block_hash_to_block[blk.block_hash]
        blk.block_hash = None
        pool.free_block_queue.appendleft(blk)
    mgr.check_invariants()
    b = Sequence(2, list(range(300, 341)) + [1, 1, 1])
    hit = mgr.get_computed_blocks(b)
    # k = 10 needs sliding blocks 8, 9 (window from 40 reads 33..40); k = 9 needs 7, 8; k = 8 needs
    # 6, 7 (from 32: 25..32): the longest hit both groups serve is 8 blocks.
    assert len(hit) == 8 and all(blk is not mgr.null_block for blk in hit.groups[1][6:])


def test_swap_and_fork_carry_every_group():
    mgr = hybrid_manager(num_blocks=32, window=8, num_cpu_blocks=16)
    seq = Sequence(1, list(range(30)))
    run_prefill(mgr, seq, chunk=5)
    before = [list(t[1]) for t in mgr.group_tables]
    held = {b.block_id for t in before for b in t if b is not mgr.null_block}
    assert mgr.can_swap_out([seq]) == AllocStatus.OK
    pairs = mgr.swap_out([seq])
    assert sorted(d for d, _ in pairs) == sorted(held)  # the null block is never copied
    assert 1 not in mgr.block_tables and mgr.num_free_blocks == mgr.num_blocks
    cpu_sliding = mgr.cpu_group_tables[1][1]
    assert [b is mgr.cpu_pool.null_block for b in cpu_sliding] == [b is mgr.null_block for b in before[1]]
    mgr.check_invariants(swapped_seq_ids={1})
    back = mgr.swap_in([seq])
    # Blocks whose hash is still cached on the device come back without a copy.
    assert len(back) <= len(pairs) and {c for c, _ in back} <= {c for _, c in pairs}
    mgr.check_invariants(live_seq_ids={1})
    assert [b is mgr.null_block for b in mgr.group_tables[1][1]] == [b is mgr.null_block for b in before[1]]
    child = seq.fork(2)
    assert child.num_computed_tokens == seq.num_computed_tokens == 30
    mgr.fork(seq, child)
    mgr.check_invariants(live_seq_ids={1, 2})
    # The next token of each goes into block 7 (position 30), shared: copied in both groups.
    for s in (seq, child):
        s.append_token(3, -0.1, None)
    assert mgr.allocate_slots(child, 1) is not None
    copies = mgr.take_copies()
    assert len(copies) == 2
    mgr.check_invariants(live_seq_ids={1, 2})
    for s in (seq, child):
        mgr.free(s)
    mgr.check_invariants()
    assert mgr.num_free_blocks == mgr.num_blocks


def test_blocks_held_and_capacity():
    mgr = KVCacheManager(1000, 16, kv_cache_config=group_layers(gemma3_windows(18, 512), 16))
    # One full group holds every block; five sliding groups hold the window plus a chunk.
    assert mgr.max_blocks_held(32768, 2048) == 2048 + 5 * (cdiv(511 + 2048, 16) + 1)
    assert mgr.token_capacity(2048) == (999 - 5 * (cdiv(511 + 2048, 16) + 1)) * 16
    # Short sequences hold fewer sliding blocks than a whole window and chunk: all of them fit.
    small = KVCacheManager(13, 16, kv_cache_config=group_layers([64], 16))  # every layer windowed
    assert small.token_capacity(2048) == 12 * 16
    dense = KVCacheManager(10, 16)
    assert dense.token_capacity(2048) == 160


@settings(max_examples=120, deadline=None)
@given(
    TRAFFIC,
    st.integers(12, 40),
    st.sampled_from([1, 2, 4]),
    st.integers(1, 40),
    st.integers(1, 6),
    st.sampled_from([1, 3, 6, 9]),
    st.sampled_from(["recompute", "swap"]),
    st.booleans(),
)
def test_random_traffic_over_mixed_groups_keeps_invariants(ops, num_blocks, block_size, budget, max_seqs, window,
                                                           mode, caching):
    """Full and sliding groups (Gemma 2's alternation), preemption by recompute or swap, prefix
    caching on and off: ``check_invariants`` after every step (in ``drive``), nothing left held."""
    cfg = group_layers([window, None, window, None], block_size)
    sched = make_scheduler(num_blocks=num_blocks, block_size=block_size, max_model_len=10_000,
                           num_cpu_blocks=num_blocks if mode == "swap" else 0, enable_caching=caching,
                           max_num_batched_tokens=budget, max_num_seqs=max_seqs, long_prefill_token_threshold=0,
                           preemption_mode=mode, kv_cache_config=cfg)
    kv = sched.kv_cache_manager
    capacity = kv.token_capacity(budget)

    def build(rid, n, max_tokens):
        return make_group(rid, n, max_tokens=max_tokens, tokens=[(7 * i) % 13 for i in range(n)]) \
            if n + max_tokens < capacity else None

    drive(sched, ops, build, eos_every=0)


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 3), st.integers(6, 30), st.sampled_from([2, 5]))
def test_beams_and_samples_over_sliding_groups(n, prompt_len, window):
    """``n > 1`` forks and beams share blocks in every group, copy-on-write in every group."""
    cfg = group_layers([window, None], BS)
    for kw in ({"n": n + 1, "temperature": 1.0, "seed": 0}, {"beam_width": n + 1}):
        sched = make_scheduler(num_blocks=80, block_size=BS, kv_cache_config=cfg)
        sched.add_request(make_group("a", prompt_len, max_tokens=12, **kw))
        drive(sched, [], lambda *a: None)


def test_pressure_over_mixed_groups_preempts_and_frees():
    """A pool too small for two long requests at once: they preempt each other (by swap and by
    recompute) while the sliding group gives back blocks, and both still finish."""
    for mode in ("swap", "recompute"):
        cfg = group_layers([4, None], BS)
        sched = make_scheduler(num_blocks=20, block_size=BS, num_cpu_blocks=20 if mode == "swap" else 0,
                               preemption_mode=mode, kv_cache_config=cfg, max_num_batched_tokens=16)
        kv = sched.kv_cache_manager
        freed = 0
        original = kv.remove_skipped_blocks

        def counting(seq, _orig=original):
            nonlocal freed
            n = _orig(seq)
            freed += n
            return n

        kv.remove_skipped_blocks = counting  # type: ignore[method-assign]
        for i, rid in enumerate("ab"):
            sched.add_request(make_group(rid, 16, max_tokens=20, tokens=list(range(100 * i, 100 * i + 16))))
        drive(sched, [], lambda *a: None)
        assert sched.num_preemptions > 0 and freed > 0
        assert mode != "swap" or sched.num_swap_outs > 0


CONV = MambaSpec(BS, ((64, 2),), ("float32",))  # LFM2's short convolution: the last 2 inputs of 64 channels


def test_group_layers_puts_state_layers_in_groups_of_their_own():
    cfg = group_layers([CONV, CONV, None, CONV, CONV, None], BS)  # LFM2's pattern: convolutions, attention
    assert [g.layer_ids for g in cfg.groups] == [(2, 5), (0, 1), (3, 4)]
    assert cfg.specs == [FullAttentionSpec(BS), CONV, CONV] and cfg.layers_per_page == 2
    with pytest.raises(ValueError, match="state layers"):
        group_layers([CONV, None], BS, hybrid=False)


def test_state_group_holds_one_block_shared_until_written():
    mgr = KVCacheManager(32, BS, True, 16, kv_cache_config=group_layers([CONV, None], BS))
    seq = Sequence(1, list(range(30)))
    run_prefill(mgr, seq, chunk=7)
    full, state = mgr.group_tables[0][1], mgr.group_tables[1][1]
    assert len(full) == 8 and len(state) == 1 and mgr.num_free_blocks == 32 - 9
    # No prefix hits while a request has states (they are not saved at block boundaries).
    assert len(mgr.get_computed_blocks(Sequence(2, list(range(30)) + [5]))) == 0
    child = seq.fork(2)
    mgr.fork(seq, child)
    assert mgr.group_tables[1][2] == state and state[0].ref_cnt == 2
    mgr.check_invariants(live_seq_ids={1, 2})
    # The next token writes both the shared partial KV block 7 and the shared state: one copy of
    # each for whichever sequence writes first; the other then owns the originals alone.
    for s in (seq, child):
        s.append_token(3, -0.1, None)
    assert mgr.num_new_blocks([SlotRequest(child, 30, 1)]) == 2
    assert mgr.allocate_slots(child, 1) is not None
    copies = mgr.take_copies()
    assert sorted(src for src, _ in copies) == sorted([full[7].block_id, state[0].block_id])
    assert mgr.allocate_slots(seq, 1) is not None and mgr.take_copies() == []
    mgr.check_invariants(live_seq_ids={1, 2})
    pairs = mgr.swap_out([child])  # its 8 KV blocks (7 still shared: copied, not moved) and its state
    assert len(pairs) == 9 and len(mgr.cpu_group_tables[1][2]) == 1
    mgr.swap_in([child])
    for s in (seq, child):
        mgr.free(s)
    mgr.check_invariants()
    assert mgr.num_free_blocks == mgr.num_blocks


KEPT = MambaSpec(BS, ((64, 2),), ("float32",), cache_states=True)  # (the same, its states kept for prefix hits)


def test_kept_states_hold_each_steps_last_boundary_and_serve_prefix_hits():
    """Chunks of 11 over 30 tokens (block size 4): each step keeps its last block and the one of the
    last boundary inside it (the others it crosses are null), the block it starts in part way
    keeps that block's end; the blocks the state left go back to the pool, cached where
    ``MambaSpec.caches`` says; a hit takes the longest prefix whose last block is a cached state,
    and only that block of the state group."""
    mgr = KVCacheManager(40, BS, True, 0, kv_cache_config=group_layers([KEPT, None], BS))
    seq = Sequence(1, list(range(30)))
    null = mgr.null_block
    assert mgr.allocate_slots(seq, 11) is not None  # [0, 11): boundaries 4, 8 inside; 8 kept, 4 not
    state = mgr.group_tables[1][1]
    assert [b is null for b in state] == [True, False, False]
    seq.num_computed_tokens = 11
    mgr.cache_full_blocks(seq)
    assert mgr.allocate_slots(seq, 11) is not None  # [11, 22): block 2 to its end (12), 20 kept, 16 not
    assert [b is null for b in state] == [True, True, False, True, False, False]  # (block 1 went back, cached)
    seq.num_computed_tokens = 22
    mgr.cache_full_blocks(seq)
    assert mgr.allocate_slots(seq, 8) is not None  # [22, 30): block 5 to 24, 28 kept
    seq.num_computed_tokens = 30
    mgr.cache_full_blocks(seq)
    mgr.check_invariants(live_seq_ids={1})
    assert max(len([b for b in mgr.group_tables[1][1] if b is not null]), 0) <= 3
    # The boundaries whose states some step wrote are 8, 12, 20, 24, 28; one full group to one
    # state group caches every second boundary (8, 24) and those from the prompt's last on (28).
    assert mgr.specs[1].cache_interval == 2
    cached_at = {8, 24, 28}
    for length in (31, 29, 26, 21, 15, 10):
        hit = mgr.get_computed_blocks(Sequence(2, list(range(length - 1)) + [99]))
        k = max((b for b in cached_at if b <= (length - 1) // BS * BS), default=0) // BS
        assert len(hit) == k, length
        if k:
            assert [b is null for b in hit.groups[1]] == [True] * (k - 1) + [False]
    mgr.free(seq)
    mgr.check_invariants()
    assert mgr.num_free_blocks == mgr.num_blocks


def test_cached_boundary_states_cost_about_half_the_full_kv():
    """Qwen3.5's 3 DeltaNet layers to 1 full-attention layer (24 layers: groups of 6, three state
    groups to one full): a boundary in 6 is cached, and every one from the prompt's last on. A
    2,000-token prompt prefilled in 128-token chunks (every 64-token boundary's state written) then
    leaves 6 state pages cached per group (384, 768, 1,152, 1,536, 1,920, and 1,984: the last
    boundary before token 1,999) where the full group caches 31: the states' bytes are 3 x 6 / 31 of
    the full K/V's, and the pool hands out the uncached ones again first (what one request touches
    stays near what it holds). Without prefix caching the interval stays 1 (nothing is cached)."""
    bs = 64
    layers = ([MambaSpec(bs, ((64, 2),), ("float32",), cache_states=True)] * 3 + [None]) * 6
    cfg = group_layers(layers, bs)
    assert [type(s).__name__ for s in cfg.specs] == ["FullAttentionSpec"] + ["MambaSpec"] * 3
    assert {s.cache_interval for s in cfg.specs[1:]} == {6}
    assert group_layers([MambaSpec(bs, ((8,),), ("float32",))] * 3 + [None], bs).specs[1].cache_interval == 1
    mgr = KVCacheManager(200, bs, True, 0, kv_cache_config=cfg)
    seq = Sequence(1, list(range(2000)))
    touched: set[int] = set()
    while seq.num_computed_tokens < 2000:
        n = min(128, 2000 - seq.num_computed_tokens)
        new = mgr.allocate_slots(seq, n)
        assert new is not None
        touched.update(b.block_id for b in new)
        seq.num_computed_tokens += n
        mgr.cache_full_blocks(seq)
        mgr.check_invariants(live_seq_ids={1})
    cached = [sum(mgr.block_pool.get_cached_block(_group_key(h, g)) is not None for h in seq.block_hashes)
              for g in range(4)]
    assert cached == [31, 6, 6, 6]
    assert len(touched) <= 31 + 3 * (6 + 3)
    hit = mgr.get_computed_blocks(Sequence(2, list(range(1000)) + [7] * 100))
    assert len(hit) == 768 // bs  # (the longest cached boundary inside the shared 1,000 tokens)
    mgr.free(seq)
    mgr.check_invariants()
    assert len(mgr.get_computed_blocks(Sequence(3, list(range(2000)) + [7]))) == 1984 // bs


@settings(max_examples=80, deadline=None)
@given(TRAFFIC, st.integers(12, 40), st.sampled_from([1, 4]), st.integers(1, 40),
       st.sampled_from(["recompute", "swap"]), st.sampled_from([1, 2]), st.booleans())
def test_random_traffic_over_state_groups_keeps_invariants(ops, num_blocks, block_size, budget, mode, n, kept):
    """Convolution, sliding-window and full-attention groups (and ``n`` samples sharing a state
    until each writes it; states rewritten in one block, or ``kept`` at boundaries for prefix
    hits): ``check_invariants`` after every step, nothing left held."""
    conv = MambaSpec(block_size, ((64, 2),), ("float32",), cache_states=kept)
    cfg = group_layers([conv, 3, None, conv, 3, None], block_size)
    sched = make_scheduler(num_blocks=num_blocks, block_size=block_size, max_model_len=10_000,
                           num_cpu_blocks=num_blocks if mode == "swap" else 0, max_num_batched_tokens=budget,
                           max_num_seqs=4, long_prefill_token_threshold=0, preemption_mode=mode,
                           kv_cache_config=cfg)
    capacity = sched.kv_cache_manager.token_capacity(budget)

    def build(rid, length, max_tokens):
        return make_group(rid, length, max_tokens=max_tokens, n=n, temperature=1.0 if n > 1 else 0, seed=0) \
            if length + max_tokens < capacity // 2 else None

    drive(sched, ops, build)


@settings(max_examples=300, deadline=None)
@given(st.integers(0, 60), st.integers(1, 40), st.sampled_from([1, 4, 16]))
def test_a_steps_state_pieces_leave_every_kept_block_its_boundarys_state(start, n, block_size):
    """The runner's cut of a step over kept states (``worker.model_runner.state_metadata``), run on
    labels: each block the manager keeps (``MambaSpec.kept``) and the block the step starts in part
    way end the step holding the state at their block's end, the last block the state after the
    step, each piece starting from the state its first token follows."""
    from pagellm.worker.model_runner import state_metadata

    kept = MambaSpec(block_size, ((1,),), ("float32",), cache_states=True).kept(start, start + n)
    total, last = start + n, (start + n - 1) // block_size
    table = [100 + i for i in range(last + 1)]  # (a distinct block per entry; nulls are never read)
    held = {table[(start - 1) // block_size]: start} if start else {}  # block -> the tokens its state follows
    meta = state_metadata([(0, n, start, table)], block_size, cached=True)
    row = 0
    for copies, spans in meta.rounds:
        for src, dst in copies:
            held[dst] = held[src]
        for row0, rows, fresh, block in spans:
            assert row0 == row and (fresh == (start + row0 == 0))
            assert fresh or held[block] == start + row0, "a piece did not start from the state before it"
            held[block] = start + row0 + rows
            row += rows
    assert row == n and held[table[last]] == total
    ends = set(kept) | ({start // block_size} if start % block_size and (start // block_size + 1) * block_size <= total
                        else set())
    for i in ends:
        assert held[table[i]] == min(total, (i + 1) * block_size), f"block {i} does not hold its end's state"
