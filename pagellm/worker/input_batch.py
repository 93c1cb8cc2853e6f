"""The persistent input batch: one row per running sequence, kept across steps (vLLM V1's ``InputBatch``).

A step changes little of a running batch: each decode appends one token and, every
``block_size`` tokens, one block. Rebuilding the block tables from the scheduler's lists costs a
nested ``torch.tensor`` per step; here each sequence keeps a row of a persistent int64 table,
updated from the step's delta (the block ids appended since the last step, or the whole row where
the list was replaced: preemption, swap-in, a copy-on-write of the last block). The decodes of a
step occupy rows ``0 .. B-1`` in the step's order, so their block table is a contiguous view
(``table[:B]``) handed to the attention kernels and the decode graph as is::

    rows:    0: seq 7  [12 13 14  0 ...]     decodes this step: 7, 3  ->  table[:2]
             1: seq 3  [ 4  9  0  0 ...]
             2: seq 5  [ 2  0  0  0 ...]     (running, not decoding this step)

A row's entries past its sequence's blocks are stale or zero; the kernels read only the blocks
that ``seq_lens`` covers, so they never see them. Where the KV cache has several layer groups
(``core/kv_cache_spec.py``), each group has such a table (``tables [groups, rows, width]``), its
rows in the same order.
"""

from __future__ import annotations

from array import array

import torch

from pagellm.core.scheduler_output import ScheduledSequence
from pagellm.sampling.sampler import SamplingRow


class InputBatch:
    """Rows of block ids (and cached sampling rows) by sequence, persistent across steps."""

    def __init__(self, rows: int = 8, width: int = 16, num_groups: int = 1) -> None:
        self.tables = torch.zeros(num_groups, rows, width, dtype=torch.int64)
        self._np = self.tables.numpy()
        self.seq_ids: list[int] = []  # row -> sequence
        self.row_of: dict[int, int] = {}
        # Per group, row -> its block ids as last applied (the delta's base).
        self._blocks: list[list[list[int]]] = [[] for _ in range(num_groups)]
        self._sampling: dict[int, SamplingRow] = {}
        # A decode step's input ids, positions, slots and context lengths (one row each): filled in
        # place, handed out as views that live until the next step fills them.
        self.step_buffers = torch.zeros(4, rows, dtype=torch.int64)
        self._step_view = _flat_int64_view(self.step_buffers)

    @property
    def num_rows(self) -> int:
        return len(self.seq_ids)

    @property
    def block_table(self) -> torch.Tensor:
        """Group 0's table ``[rows, width]``."""
        return self.tables[0]

    def remove(self, seq_ids: list[int]) -> None:
        """Drop finished sequences; the rows after each move up (order is kept)."""
        gone = {s for s in seq_ids if s in self.row_of}
        for s in seq_ids:
            self._sampling.pop(s, None)
        if not gone:
            return
        keep = [r for r, s in enumerate(self.seq_ids) if s not in gone]
        self._reorder(keep)

    def decode_table(self, seqs: list[ScheduledSequence]) -> torch.Tensor:
        """The block table of ``seqs`` (this step's decodes, in flat order): ``[B, width]``, a
        contiguous view of rows ``0 .. B-1`` after bringing those sequences there."""
        ids = [s.seq_id for s in seqs]
        for s in seqs:
            if s.seq_id not in self.row_of:
                self._add(s.seq_id)
        if self.seq_ids[:len(ids)] != ids:
            first = [self.row_of[i] for i in ids]
            taken = set(first)
            self._reorder(first + [r for r in range(self.num_rows) if r not in taken])
        groups = len(self._blocks)
        for row, s in enumerate(seqs):
            self._apply(row, s.block_ids, 0)
            if groups > 1:
                assert s.group_block_ids is not None and len(s.group_block_ids) == groups
                for g in range(1, groups):
                    self._apply(row, s.group_block_ids[g], g)
        return self.tables[0, :len(ids)]

    def group_tables(self, n: int) -> torch.Tensor:
        """Every group's table of the first ``n`` rows, ``[groups, n, width]`` (after ``decode_table``):
        a view, each group's rows contiguous."""
        return self.tables[:, :n]

    def step_rows(self, *columns: list[int], device: torch.device) -> tuple[torch.Tensor, ...]:
        """``columns`` (equal lengths, at most 4) as int64 tensors on ``device``: views of the step
        buffers on a CPU (no allocation), copies of them elsewhere."""
        n = len(columns[0])
        if n > self.step_buffers.shape[1]:
            self.step_buffers = torch.zeros(4, max(n, 2 * self.step_buffers.shape[1]), dtype=torch.int64)
            self._step_view = _flat_int64_view(self.step_buffers)
        self._write_columns(columns)
        views = self.step_buffers[:len(columns), :n]
        if device.type != "cpu":
            views = views.to(device)
        return tuple(views.unbind(0))

    def advance(self, *columns: list[int]) -> None:
        """The next pass of the plain decodes ``step_rows`` last filled (multi-step): new columns into
        the same buffers, so the views it handed out (and the metadata holding them) read them."""
        self._write_columns(columns)

    def _write_columns(self, columns: tuple[list[int], ...]) -> None:
        # Through a flat memoryview: with the caches cold after a forward pass, numpy's per-call
        # dispatch costs more than the copy at a batch's sizes.
        stride, view = self.step_buffers.shape[1], self._step_view
        for k, col in enumerate(columns):
            view[k * stride:k * stride + len(col)] = array("q", col)

    def sampling_row(self, s: ScheduledSequence, seq_id: int, generator: torch.Generator | None) -> SamplingRow:
        """The sampler's row for ``seq_id`` (made once; the lists it holds are the scheduler's own)."""
        row = self._sampling.get(seq_id)
        if row is None or row.params is not s.sampling_params or row.output_token_ids is not s.output_token_ids \
                or row.prompt_token_ids is not s.prompt_token_ids or row.generator is not generator:
            row = self._sampling[seq_id] = SamplingRow(s.sampling_params, s.prompt_token_ids, s.output_token_ids,
                                                       generator)
        return row

    def _add(self, seq_id: int) -> None:
        r = self.num_rows
        if r == self.tables.shape[1]:
            self._resize(2 * r, self.tables.shape[2])
        self.seq_ids.append(seq_id)
        for blocks in self._blocks:
            blocks.append([])
        self.row_of[seq_id] = r

    def _apply(self, row: int, block_ids: list[int], group: int = 0) -> None:
        """Row ``row`` of ``group`` holds ``block_ids`` after this: the appended ids only, where the
        row's are a prefix."""
        have = self._blocks[group][row]
        n = len(have)
        if block_ids == have:
            return
        if len(block_ids) > self.tables.shape[2]:
            self._resize(self.tables.shape[1], max(len(block_ids), 2 * self.tables.shape[2]))
        if len(block_ids) >= n and block_ids[:n] == have:
            self._np[group, row, n:len(block_ids)] = block_ids[n:]
            have.extend(block_ids[n:])
        else:
            self._np[group, row, :len(block_ids)] = block_ids
            self._blocks[group][row] = list(block_ids)

    def _reorder(self, rows: list[int]) -> None:
        """The rows ``rows`` become rows ``0 ..`` in that order; the others are dropped."""
        n = len(rows)
        self.tables[:, :n] = self.tables[:, torch.tensor(rows, dtype=torch.long)]
        self.seq_ids = [self.seq_ids[r] for r in rows]
        self._blocks = [[blocks[r] for r in rows] for blocks in self._blocks]
        self.row_of = {s: i for i, s in enumerate(self.seq_ids)}

    def _resize(self, rows: int, width: int) -> None:
        old = self.tables
        self.tables = torch.zeros(old.shape[0], rows, width, dtype=torch.int64)
        self.tables[:, :old.shape[1], :old.shape[2]] = old
        self._np = self.tables.numpy()

    def check_invariants(self) -> None:
        """Every row holds its sequence's block ids as last applied in every group, and the index
        matches the rows (raised, not asserted: the checks run under ``python -O`` too)."""
        index = {s: i for i, s in enumerate(self.seq_ids)}
        if self.row_of != index or any(not len(b) == len(self.seq_ids) <= self.tables.shape[1] for b in self._blocks):
            raise AssertionError(f"rows {self.seq_ids} and index {self.row_of} disagree")
        for g, blocks in enumerate(self._blocks):
            for r, ids in enumerate(blocks):
                row = self._np[g, r, :len(ids)].tolist()
                if row != ids:
                    raise AssertionError(f"group {g} row {r} holds {row}, not {ids}")


def _flat_int64_view(t: torch.Tensor) -> memoryview:
    """A contiguous int64 tensor's elements as one flat memoryview (writes land in the tensor)."""
    return t.numpy().data.cast("B").cast("q")
