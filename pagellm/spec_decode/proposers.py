"""Draft proposers that need no model: they guess the next tokens from tokens already seen.

``NgramProposer`` (prompt-lookup decoding, vLLM's ``ngram``): find the latest earlier occurrence
of the context's last ``n`` tokens (``n`` from ``prompt_lookup_max`` down to ``prompt_lookup_min``)
and propose the ``k`` tokens that followed it. Input-copying work (rewrites, code edits,
summaries quoting their source) continues what it copies.

``SuffixProposer`` (SuffixDecoding, Oliaro et al. 2024): the continuation counts of every suffix
of the request's own tokens and of recent finished outputs (shared across requests: agents and
batch jobs repeat themselves); it extends the longest matching suffix with its most frequent next
token, one token at a time, while the path's estimated probability stays at least
``suffix_min_probability``. Where SuffixDecoding keeps a suffix tree, this keeps, per match length
in a geometric ladder up to ``suffix_max_depth``, a hash of the ``n`` tokens -> next-token counts:
the same lookups, a few dict entries per token, no tree to walk or prune.

Both keep per-sequence indexes that grow with the sequence (each token is indexed once), so a
lookup costs the same on an 8k-token context as on a short one.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence as Seq

from pagellm.config import SpeculativeConfig
from pagellm.sequence import Sequence


def _ladder(lo: int, hi: int) -> list[int]:
    """Match lengths tried, longest first: every length up to 4, then about x1.5 steps to ``hi``."""
    out, n = [], lo
    while n < hi:
        out.append(n)
        n = n + 1 if n < 4 else max(n + 1, n * 3 // 2)
    out.append(hi)
    return sorted(set(out), reverse=True)


class _SeqTokens:
    """A sequence's tokens (prompt + output) read without concatenating them each step."""

    __slots__ = ("prompt", "output")

    def __init__(self, seq: Sequence) -> None:
        self.prompt, self.output = seq.prompt_token_ids, seq.output_token_ids

    def __len__(self) -> int:
        return len(self.prompt) + len(self.output)

    def slice(self, start: int, end: int) -> tuple[int, ...]:
        p = len(self.prompt)
        if end <= p:
            return tuple(self.prompt[start:end])
        if start >= p:
            return tuple(self.output[start - p:end - p])
        return tuple(self.prompt[start:]) + tuple(self.output[:end - p])


class NgramIndex:
    """Latest end position of every ``n``-gram (``n`` in ``lengths``) of a growing token list."""

    __slots__ = ("lengths", "maps", "indexed")

    def __init__(self, lengths: list[int]) -> None:
        self.lengths = lengths
        self.maps: dict[int, dict[int, int]] = {n: {} for n in lengths}
        self.indexed = 0  # n-grams ending before this position are in ``maps``

    def catch_up(self, tokens: _SeqTokens, upto: int) -> None:
        """Index the n-grams ending at positions ``indexed .. upto - 1`` (in bulk: an 8k-token
        prompt's first lookup takes milliseconds, not a tenth of a second)."""
        start = self.indexed
        if upto <= start:
            return
        for n in self.lengths:
            lo = max(start - n + 1, 0)
            seg = tokens.slice(lo, upto)
            grams = zip(*(seg[i:] for i in range(n)), strict=False)  # the n-grams ending at lo + n - 1 ..
            self.maps[n].update(zip(map(hash, grams), range(lo + n - 1, upto), strict=False))
        self.indexed = upto

    def latest(self, gram: tuple[int, ...]) -> int | None:
        return self.maps[len(gram)].get(hash(gram))


class NgramProposer:
    """Prompt-lookup decoding over each sequence's prompt and output (see the module docstring)."""

    def __init__(self, config: SpeculativeConfig) -> None:
        self.lengths = list(range(config.prompt_lookup_max, config.prompt_lookup_min - 1, -1))
        self._index: dict[int, NgramIndex] = {}

    def propose(self, seq: Sequence, k: int) -> list[int]:
        tokens = _SeqTokens(seq)
        n_tok = len(tokens)
        index = self._index.get(seq.seq_id)
        if index is None:
            index = self._index[seq.seq_id] = NgramIndex(self.lengths)
        # Every n-gram that ends before the last token: the context's own suffix is not a match.
        index.catch_up(tokens, n_tok - 1)
        for n in self.lengths:
            if n_tok <= n:
                continue
            end = index.latest(tokens.slice(n_tok - n, n_tok))
            if end is not None:
                return list(tokens.slice(end + 1, min(end + 1 + k, n_tok)))
        return []

    def forget(self, seq_id: int) -> None:
        self._index.pop(seq_id, None)

    def request_finished(self, seqs: list[Sequence]) -> None:
        for seq in seqs:
            self.forget(seq.seq_id)


class SuffixCounts:
    """For each match length ``n`` in ``lengths``: hash of ``n`` tokens -> what followed them.

    A suffix seen once (most of them) stores its next token as a plain ``int``; a dict
    ``{next token: count}`` only once it has been followed twice: a third of the memory.
    """

    __slots__ = ("lengths", "maps")

    def __init__(self, lengths: list[int]) -> None:
        self.lengths = lengths
        self.maps: dict[int, dict[int, int | dict[int, int]]] = {n: {} for n in lengths}

    def add(self, tokens: Seq[int], end: int, sign: int = 1) -> None:
        """Count (``sign`` -1: uncount) ``tokens[end]`` as the continuation of each suffix ending
        at ``end - 1``."""
        nxt = tokens[end]
        for n in self.lengths:
            if end < n:
                continue
            key = hash(tuple(tokens[end - n:end]))
            m = self.maps[n]
            seen = m.get(key)
            if seen is None:
                if sign > 0:
                    m[key] = nxt
                continue
            counts = {seen: 1} if isinstance(seen, int) else seen
            c = counts.get(nxt, 0) + sign
            if c > 0:
                counts[nxt] = c
            else:
                counts.pop(nxt, None)
            if not counts:
                del m[key]
            elif len(counts) == 1 and next(iter(counts.values())) == 1:
                m[key] = next(iter(counts))
            else:
                m[key] = counts

    def continuations(self, context: Seq[int]) -> tuple[int, dict[int, int] | None]:
        """The longest suffix of ``context`` seen before, and what followed it (token -> count)."""
        for n in self.lengths:
            if len(context) >= n:
                seen = self.maps[n].get(hash(tuple(context[len(context) - n:])))
                if seen is not None:
                    return n, {seen: 1} if isinstance(seen, int) else seen
        return 0, None


class SuffixProposer:
    """SuffixDecoding over the request's own tokens and recent finished outputs (module docstring)."""

    def __init__(self, config: SpeculativeConfig) -> None:
        self.lengths = _ladder(1, config.suffix_max_depth)
        self.max_depth = config.suffix_max_depth
        self.min_prob = config.suffix_min_probability
        self.cache_requests = config.suffix_cache_requests
        self._local: dict[int, tuple[SuffixCounts, list[int]]] = {}  # seq_id -> (counts, tokens indexed)
        self.global_counts = SuffixCounts(self.lengths)
        self._recent: deque[tuple[list[int], int]] = deque()  # (tokens, first counted position)

    def _local_counts(self, seq: Sequence) -> SuffixCounts:
        entry = self._local.get(seq.seq_id)
        if entry is None:
            entry = self._local[seq.seq_id] = (SuffixCounts(self.lengths), [])
        counts, seen = entry
        p = len(seq.prompt_token_ids)
        while len(seen) < seq.num_tokens:  # index each new token once
            i = len(seen)
            seen.append(seq.prompt_token_ids[i] if i < p else seq.output_token_ids[i - p])
            if i:
                counts.add(seen, i)
        return counts

    def propose(self, seq: Sequence, k: int) -> list[int]:
        local = self._local_counts(seq)
        context = self._local[seq.seq_id][1][-self.max_depth:]
        out: list[int] = []
        prob = 1.0
        while len(out) < k:
            n_local, c_local = local.continuations(context)
            n_global, c_global = self.global_counts.continuations(context)
            # The longer match is the better evidence; equal lengths pool their counts.
            if n_local >= n_global:
                counts = dict(c_local or {})
                if n_global == n_local and c_global:
                    for t, c in c_global.items():
                        counts[t] = counts.get(t, 0) + c
            else:
                counts = dict(c_global or {})
            if not counts:
                break
            token, c = max(counts.items(), key=lambda kv: kv[1])
            prob *= c / sum(counts.values())
            if prob < self.min_prob:
                break
            out.append(token)
            context = context[1:] + [token] if len(context) >= self.max_depth else context + [token]
        return out

    def forget(self, seq_id: int) -> None:
        self._local.pop(seq_id, None)

    def request_finished(self, seqs: list[Sequence]) -> None:
        """Finished outputs join the shared counts (the oldest leave past ``suffix_cache_requests``)."""
        for seq in seqs:
            self.forget(seq.seq_id)
            if not self.cache_requests or not seq.output_token_ids:
                continue
            # The prompt's tail gives the output's first tokens their context.
            tokens = list(seq.prompt_token_ids[-self.max_depth:]) + list(seq.output_token_ids)
            first = max(1, len(tokens) - len(seq.output_token_ids))
            for end in range(first, len(tokens)):
                self.global_counts.add(tokens, end)
            self._recent.append((tokens, first))
            while len(self._recent) > self.cache_requests:
                old, first_old = self._recent.popleft()
                for end in range(first_old, len(old)):
                    self.global_counts.add(old, end, -1)


class DraftModelProposer:
    """Hands out the drafts the worker's draft model computed during the last step (proposals
    for a sequence whose last token has moved on since are stale and dropped)."""

    def __init__(self) -> None:
        self._drafts: dict[int, tuple[int, list[int]]] = {}

    def receive(self, drafts: dict[int, tuple[int, list[int]]]) -> None:
        self._drafts = drafts

    def propose(self, seq: Sequence, k: int) -> list[int]:
        pos, drafts = self._drafts.get(seq.seq_id, (-1, []))
        return drafts[:k] if pos == seq.num_tokens - 1 else []

    def request_finished(self, seqs: list[Sequence]) -> None:
        for seq in seqs:
            self._drafts.pop(seq.seq_id, None)


Proposer = NgramProposer | SuffixProposer | DraftModelProposer


def create_proposer(config: SpeculativeConfig) -> Proposer:
    if config.method == "ngram":
        return NgramProposer(config)
    if config.method == "draft_model":
        return DraftModelProposer()
    return SuffixProposer(config)
