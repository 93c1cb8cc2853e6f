"""Decode-only steps as CUDA graphs, captured per padded batch size at start-up (vLLM's
``cudagraph_capture_sizes``) and replayed: one launch for the whole forward instead of a few
hundred, which is most of a small batch's decode time on a GPU.

A graph replays fixed kernels on fixed addresses, so every input lives in a static buffer sized for
the largest batch. A step of ``n`` decodes is padded to the next captured size ``bs``: rows
``n .. bs`` are dummies that attend to one token of the *scratch block* (a cache block the block
pool never hands out) and write their K/V there, so they touch no request's cache::

    input_ids / positions / slot_mapping  [max_bs]            rows >= n: 0 / 0 / scratch slot
    block_table                           [max_bs, max_blocks] int32, rows >= n: the scratch block
    seq_lens                              [max_bs]            int32, rows >= n: 1
    query_start                           arange(max_bs + 1)  (one query per decode)

The attention kernel's key partitions are as many as the longest context the table holds (a
graph's grid is fixed); a row's partitions past its own context return at once.

Only the model's forward (embeddings to the final norm) is captured; logits and sampling run
eagerly on the ``n`` real rows. The graph's numbers are those of an eager pass over the padded batch
(the same kernels); against an eager pass over ``n`` rows they can differ in bfloat16, since cuBLAS
picks GEMM kernels by shape.
"""

from __future__ import annotations

import bisect
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch

from pagellm.attention.metadata import AttentionGroup, AttentionKind, AttentionMetadata
from pagellm.attention.torch_paged import TorchPagedAttention

logger = logging.getLogger(__name__)

MAX_DEFAULT_CAPTURE_SIZE = 256


def default_capture_sizes(max_num_seqs: int) -> list[int]:
    """vLLM's sizes, 1, 2, 4, then every 8, up to the first that holds ``max_num_seqs`` decodes."""
    sizes = [1, 2, 4, *range(8, MAX_DEFAULT_CAPTURE_SIZE + 1, 8)]
    cut = bisect.bisect_left(sizes, min(max_num_seqs, MAX_DEFAULT_CAPTURE_SIZE))
    return sizes[:cut + 1]


class Replayable(Protocol):
    def replay(self) -> None: ...


# (fn, memory pool) -> (graph, fn's output as captured, the pool for the next capture)
GraphMaker = Callable[[Callable[[], torch.Tensor], Any], tuple[Replayable, torch.Tensor, Any]]


def cuda_graph(fn: Callable[[], torch.Tensor], pool: Any) -> tuple[Replayable, torch.Tensor, Any]:
    """``fn`` captured as a CUDA graph, sharing ``pool`` with the graphs captured before it."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        out = fn()
    return graph, out, graph.pool()


class EagerReplay:
    """A stand-in for a CUDA graph where there is none (the CPU tests of the static buffers):
    ``replay`` runs ``fn`` again over the same buffers and writes into the captured output."""

    def __init__(self, fn: Callable[[], torch.Tensor]) -> None:
        self.fn = fn
        self.out = fn()

    def replay(self) -> None:
        self.out.copy_(self.fn())

    @staticmethod
    def make(fn: Callable[[], torch.Tensor], pool: object) -> tuple[Replayable, torch.Tensor, object]:
        graph = EagerReplay(fn)
        return graph, graph.out, pool


class CudaGraphRunner:
    """The captured forwards of one model over one set of caches (module docstring)."""

    def __init__(self, model: torch.nn.Module, backend: TorchPagedAttention,
                 kv_caches: list[tuple[torch.Tensor, torch.Tensor]], block_size: int, max_blocks_per_seq: int,
                 scratch_block: int, sizes: Sequence[int], device: torch.device,
                 make_graph: GraphMaker | None = None) -> None:
        if not sizes or min(sizes) < 1:
            raise ValueError(f"cudagraph_capture_sizes must be positive batch sizes, got {list(sizes)}")
        self.model, self.backend, self.kv_caches = model, backend, kv_caches
        self.block_size = block_size
        self.sizes = sorted(set(sizes))
        self.make_graph = make_graph or cuda_graph
        self.scratch_block = scratch_block
        scratch_slot = scratch_block * block_size
        max_bs = self.sizes[-1]
        self.input_ids = torch.zeros(max_bs, dtype=torch.long, device=device)
        self.positions = torch.zeros(max_bs, dtype=torch.long, device=device)
        self.slot_mapping = torch.full((max_bs,), scratch_slot, dtype=torch.long, device=device)
        self.block_table = torch.full((max_bs, max_blocks_per_seq), scratch_block, dtype=torch.int32, device=device)
        self.seq_lens = torch.ones(max_bs, dtype=torch.int32, device=device)
        self.query_start = torch.arange(max_bs + 1, dtype=torch.int32, device=device)
        self.graphs: dict[int, tuple[Replayable, torch.Tensor]] = {}
        self.num_replays = 0

    def metadata(self, bs: int) -> AttentionMetadata:
        """The attention metadata of a padded step of ``bs`` decodes, over the static buffers."""
        from pagellm.attention.triton_attention import partition_size  # (Triton: only where graphs are)

        table = self.block_table[:bs]
        parts = -(-table.shape[1] * self.block_size // partition_size(self.block_size))
        group = AttentionGroup(AttentionKind.DECODE_KERNEL, 0, bs, bs, 1, table, None,
                               kernel_args=(table, self.query_start[:bs + 1], self.seq_lens[:bs], 1, parts))
        return AttentionMetadata(self.backend, self.slot_mapping[:bs], [group], bs, self.block_size, list(range(bs)))

    @torch.inference_mode()
    def capture(self) -> None:
        """Every size, the largest first (the smaller graphs then fit in its memory pool); a warm-up
        pass before each capture compiles the Triton kernels and lets cuBLAS choose outside it."""
        start = time.perf_counter()
        pool: object = None
        for bs in reversed(self.sizes):
            meta = self.metadata(bs)

            def forward(bs: int = bs, meta: AttentionMetadata = meta) -> torch.Tensor:
                out = self.model(self.input_ids[:bs], self.positions[:bs], self.kv_caches, meta)
                assert out is not None  # (one stage: graphs are not captured under pipeline parallelism)
                return out

            forward()
            graph, out, pool = self.make_graph(forward, pool)
            self.graphs[bs] = (graph, out)
        logger.info("captured decode graphs for %d batch sizes (%d..%d) in %.1f s", len(self.sizes),
                    self.sizes[0], self.sizes[-1], time.perf_counter() - start)

    def padded_size(self, n: int) -> int | None:
        i = bisect.bisect_left(self.sizes, n)
        return self.sizes[i] if i < len(self.sizes) else None

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor | None:
        """The final hidden states of a decode-only step through its graph; ``None`` where no graph
        applies (a prefill chunk, M-RoPE rows, a batch larger than every captured size)."""
        n = input_ids.shape[0]
        bs = self.padded_size(n)
        if bs is None or positions.dim() != 1 or len(meta.groups) != 1 or meta.block_size != self.block_size:
            return None
        group = meta.groups[0]
        if group.kind != AttentionKind.DECODE_KERNEL or group.kernel_args is None or group.batch_size != n:
            return None
        table, _, seq_lens, _, _ = group.kernel_args
        if table.shape[1] > self.block_table.shape[1]:
            return None
        self.input_ids[:n].copy_(input_ids)
        self.positions[:n].copy_(positions)
        self.slot_mapping[:n].copy_(meta.slot_mapping)
        self.block_table[:n, :table.shape[1]].copy_(table)  # (columns past a row's length are never read)
        self.seq_lens[:n].copy_(seq_lens)
        if bs > n:  # the padding rows, which earlier steps may have used
            self.input_ids[n:bs].zero_()
            self.positions[n:bs].zero_()
            self.slot_mapping[n:bs].fill_(self.scratch_block * self.block_size)
            self.block_table[n:bs, 0].fill_(self.scratch_block)
            self.seq_lens[n:bs].fill_(1)
        graph, out = self.graphs[bs]
        graph.replay()
        self.num_replays += 1
        return out[:n]
