"""What each layer keeps per request, and how layers are grouped over one block pool (vLLM V1's
hybrid KV cache manager, in our vocabulary).

A layer's ``KVCacheSpec`` says what it can ever read: a full-attention layer every token before
the query, a sliding-window layer only the last ``sliding_window`` positions. Layers with equal
specs are cut into groups of equal size, so that one block id means the same number of bytes in
every group (a page: ``layers_per_page`` layers x ``block_size`` tokens); each group then keeps
its own block table per request over the one shared ``BlockPool``::

    Gemma 3, 18 layers: 15 sliding (window 512) + 3 full  ->  groups of 3 layers, a page = 3 layers
        group 0  full     layers  5 11 17        table: [b3][b8][b1][b9] ... every block
        group 1  sliding  layers  0  1  2        table: [--][--][b4][b7]     blocks the window left
        ...                                                               are the null block
        group 5  sliding  layers 12 13 14

A dense model is one group of every layer, exactly the single block table it always had.
A state group (``MambaSpec``) holds one block per request, the layers' states after its computed
tokens rewritten in place each step; or, with prefix caching, a block per ``block_size`` tokens
of which only the last is live (the others: states at boundaries, some cached for prefix hits).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from pagellm.utils import cdiv


@dataclass(frozen=True, slots=True)
class FullAttentionSpec:
    """A layer that reads every earlier token: a request holds a block for each ``block_size`` tokens."""

    block_size: int

    def num_skipped_tokens(self, num_computed_tokens: int) -> int:
        """Leading tokens no later query can read: none."""
        return 0

    def max_blocks_held(self, num_tokens: int, max_chunk_tokens: int) -> int:
        """The most blocks one request of ``num_tokens`` holds at once in a group of this spec."""
        return cdiv(num_tokens, self.block_size)


@dataclass(frozen=True, slots=True)
class SlidingWindowSpec:
    """A layer whose query at position ``p`` sees keys ``p - sliding_window < k <= p``: blocks wholly
    before the window of the next query go back to the pool (``remove_skipped_blocks``)."""

    block_size: int
    sliding_window: int

    def __post_init__(self) -> None:
        if self.sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1, got {self.sliding_window}")

    def num_skipped_tokens(self, num_computed_tokens: int) -> int:
        """Leading tokens that the next query (at ``num_computed_tokens``) and every later one cannot read."""
        return max(0, num_computed_tokens - self.sliding_window + 1)

    def max_blocks_held(self, num_tokens: int, max_chunk_tokens: int) -> int:
        """A chunk of up to ``max_chunk_tokens`` queries plus the window behind its first one, and
        the block the window starts in part way."""
        return min(cdiv(num_tokens, self.block_size), cdiv(self.sliding_window - 1 + max_chunk_tokens,
                                                              self.block_size) + 1)


@dataclass(frozen=True, slots=True)
class MambaSpec:
    """A state layer (Mamba2, gated DeltaNet, a short convolution): fixed-size states per request
    (``shapes`` and ``dtypes``, one each for the conv and recurrent states), no K/V per token.

    Without ``cache_states`` a request holds one block of its group, the state after its computed
    tokens, written in place each step (shared after a fork until either side writes: copy-on-write,
    as a partial block). With it (prefix caching on) the group's table has an entry per
    ``block_size`` tokens, like a one-token window's: a step's last block holds the state after its
    tokens, the block of the last boundary it crosses inside keeps the state there (``kept``; the
    others it crosses are the null block), and the block it starts in part way the state at that
    block's end. A block holding the state after ``(i + 1) * block_size`` tokens goes back to the
    pool once the request's state has moved on, hashed like a full block (cached, evictable) where
    ``caches`` says; a prefix hit of ``k`` blocks needs only block ``k - 1``,
    the state it continues from. Decodes keep every boundary; a prefill chunk its last one (the
    chunk's end, where chunks are multiples of ``block_size``).

    Of the boundary states written, those cached (``caches``) are every ``cache_interval``-th
    boundary's and every one from the prompt's last boundary on (what the same conversation's next
    turn continues from); the others go back to the pool uncached, reused first, once the state
    moves on. ``group_layers`` sets the interval so that cached states cost at most about half the
    full-attention K/V of the tokens they follow."""

    block_size: int
    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[str, ...]
    cache_states: bool = False
    cache_interval: int = 1

    def __post_init__(self) -> None:
        if self.cache_interval < 1:
            raise ValueError(f"cache_interval must be >= 1, got {self.cache_interval}")

    def num_skipped_tokens(self, num_computed_tokens: int) -> int:
        """Leading tokens whose blocks no later step reads: all but the last computed one's block."""
        return max(0, num_computed_tokens - 1) if self.cache_states else 0

    def max_blocks_held(self, num_tokens: int, max_chunk_tokens: int) -> int:
        """One; kept at boundaries, the block a step continues from and the two it writes."""
        return min(cdiv(num_tokens, self.block_size), 3) if self.cache_states else 1

    def kept(self, num_computed_tokens: int, num_tokens: int) -> set[int]:
        """The table entries past the block it starts in that a step from ``num_computed_tokens`` to
        ``num_tokens`` writes states into: its last block, and the block ending at the last boundary
        strictly inside the step."""
        bs = self.block_size
        last = (num_tokens - 1) // bs
        boundary = num_tokens // bs * bs
        return {last, boundary // bs - 1} if num_computed_tokens < boundary < num_tokens else {last}

    def caches(self, index: int, num_prompt_tokens: int) -> bool:
        """Whether block ``index`` (the state after ``(index + 1) * block_size`` tokens) is cached
        for prefix hits: at every ``cache_interval``-th boundary, and from the last boundary before
        the prompt's last token on (a re-sent or extended prompt's hit; every decode boundary)."""
        last = (num_prompt_tokens - 1) // self.block_size
        return (index + 1) % self.cache_interval == 0 or index + 1 >= last


KVCacheSpec = FullAttentionSpec | SlidingWindowSpec | MambaSpec


@dataclass(frozen=True, slots=True)
class KVCacheGroupSpec:
    """Layers that share one block table per request (their spec and their model layer indices)."""

    spec: KVCacheSpec
    layer_ids: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class KVCacheConfig:
    """The groups over one pool; a page holds ``layers_per_page`` layers' K/V of ``block_size`` tokens."""

    groups: tuple[KVCacheGroupSpec, ...]
    layers_per_page: int

    @property
    def specs(self) -> list[KVCacheSpec]:
        return [g.spec for g in self.groups]

    @property
    def is_single_full(self) -> bool:
        """One group of full attention: the plain paged cache (every feature applies)."""
        return len(self.groups) == 1 and isinstance(self.groups[0].spec, FullAttentionSpec)

    def page_slot(self, layer: int) -> tuple[int, int]:
        """``(group, position in the page)`` of model layer ``layer``."""
        for g, group in enumerate(self.groups):
            if layer in group.layer_ids:
                return g, group.layer_ids.index(layer)
        raise ValueError(f"layer {layer} is in no KV cache group")

    def describe(self, bytes_per_layer_token: int) -> str:
        """One line per group kind for the start-up log: layers, window, bytes a token costs."""
        parts: list[str] = []
        for g in self.groups:
            s = g.spec
            kind = f"sliding window {s.sliding_window}" if isinstance(s, SlidingWindowSpec) else \
                f"state {list(s.shapes)}" if isinstance(s, MambaSpec) else "full attention"
            parts.append(f"group {len(parts)}: {kind}, layers {list(g.layer_ids)}")
        page = self.layers_per_page * bytes_per_layer_token
        return f"{len(self.groups)} KV cache group(s) of {self.layers_per_page} layer(s), {page} bytes a token " \
               f"in each group's block; " + "; ".join(parts)


def group_layers(layer_windows: list[int | None | MambaSpec | bool], block_size: int,
                 hybrid: bool = True) -> KVCacheConfig:
    """Group layers by spec (``None``: full attention, an int: the layer's sliding window, a
    ``MambaSpec``: a state layer's, ``False``: a layer that keeps nothing, Nemotron-H's MLP layers:
    in no group).

    Every kind's layers are cut into groups of the smallest kind's layer count, in layer order;
    full-attention groups come first (group 0 is what KV transfer and the invariants call "the"
    block table), state groups last. ``hybrid=False`` (``disable_hybrid_kv_cache_manager``): one
    full-attention group of every layer, as before windows freed anything (not for state layers).
    """
    kept = [(i, w) for i, w in enumerate(layer_windows) if w is not False]
    if not kept:
        raise ValueError("a model with KV has at least one layer that keeps K/V or a state")
    states = any(isinstance(w, MambaSpec) for _, w in kept)
    if not hybrid and states:
        raise ValueError("state layers need KV cache groups: disable_hybrid_kv_cache_manager cannot apply")
    if not hybrid or all(w is None for _, w in kept):
        return KVCacheConfig((KVCacheGroupSpec(FullAttentionSpec(block_size), tuple(i for i, _ in kept)),), len(kept))
    kinds: dict[int | None | MambaSpec, list[int]] = {}
    for i, w in kept:
        assert not isinstance(w, bool)
        kinds.setdefault(w, []).append(i)
    size = min(len(ids) for ids in kinds.values())
    groups: list[KVCacheGroupSpec] = []

    def order(w: int | None | MambaSpec) -> tuple[int, int]:
        return (2, 0) if isinstance(w, MambaSpec) else (w is not None, w or 0)

    # A cached boundary state costs one page in each state group where a block of tokens costs one in
    # each full-attention group: every 2 x (state groups / full groups)-th boundary keeps the states
    # at about half the full K/V (Qwen3.5: 3 state groups to 1 full, a boundary in 6 cached).
    n_groups = {w: cdiv(len(ids), size) for w, ids in kinds.items()}
    full = n_groups.get(None, 0)
    interval = cdiv(2 * sum(n for w, n in n_groups.items() if isinstance(w, MambaSpec)), max(full, 1))
    for w in sorted(kinds, key=order):
        spec: KVCacheSpec = replace(w, cache_interval=interval) if isinstance(w, MambaSpec) and w.cache_states \
            else w if isinstance(w, MambaSpec) \
            else FullAttentionSpec(block_size) if w is None else SlidingWindowSpec(block_size, w)
        ids = kinds[w]
        groups.extend(KVCacheGroupSpec(spec, tuple(ids[i:i + size])) for i in range(0, len(ids), size))
    return KVCacheConfig(tuple(groups), size)
