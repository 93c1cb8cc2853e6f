"""The ``"cpu"`` attention backend: the reference backend plus the compiled CPU kernels.

Decided once, at start-up, from the cache and the model dtype (:meth:`CpuPagedAttention.for_cache`):
which kernels apply here (``cpu_kernel.py``: decode over a float32, float16 or int8 cache, with a
layer's sliding window and logit soft-cap where it has them; prefill over the same with a head size
that is a multiple of 16 up to 256 on AVX-512, windows and soft-caps included, summing as the decode kernel
does, or, for a run that never decodes, on AMX bfloat16 tiles; without the prefill kernel, a
chunk's tokens as decodes through the decode kernel; ``cpu_ops.write_kv``: the K/V write). Each
step's metadata then names the kernel groups (``DECODE_KERNEL``, ``PREFILL_KERNEL``) and
``TorchPagedAttention.forward`` runs them through the methods registered for those kinds.
Nothing is re-checked per layer except the layout the kernels need.
"""

from __future__ import annotations

from itertools import accumulate

import torch

from pagellm.attention import cpu_kernel
from pagellm.attention.metadata import AttentionGroup, AttentionKind
from pagellm.attention.torch_paged import TorchPagedAttention, _padded_block_table
from pagellm.kernels import cpu_ops


def _chunk_tables(chunks: list[tuple[int, int, list[int]]], start: int,
                  block_size: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """The chunks' padded block tables, their ``prefill_chunks`` rows (each chunk's first flat row,
    num_computed_tokens, query length) and the end of the last chunk's rows."""
    table = _padded_block_table([c + n for c, n, _ in chunks], [ids for _, _, ids in chunks], block_size)
    bounds = list(accumulate((n for _, n, _ in chunks), initial=start))
    info = torch.tensor([bounds[:-1], [c[0] for c in chunks], [c[1] for c in chunks]], dtype=torch.long)
    return table, info, bounds[-1]


class CpuPagedAttention(TorchPagedAttention):
    """Decodes through the decode kernel, prefill chunks through the prefill kernel, K/V written by
    the ``write_kv`` kernel, each only where it applies; SDPA (the reference) for the rest."""

    name = "cpu"
    # (both kernels read every chunk's K/V from the cache, the step's own included)
    cache_reading_kinds = TorchPagedAttention.cache_reading_kinds | {AttentionKind.DECODE_KERNEL,
                                                                     AttentionKind.PREFILL_KERNEL}

    def __init__(self, decode_kernel: bool, prefill_kernel: bool, write_kv_kernel: bool,
                 prefill_bf16_tiles: bool = False) -> None:
        super().__init__()
        self.decode_kernel = decode_kernel
        self.prefill_kernel = prefill_kernel
        self.write_kv_kernel = write_kv_kernel
        self.prefill_bf16_tiles = prefill_bf16_tiles
        self.impls[AttentionKind.DECODE_KERNEL] = self._decode_kernel
        self.impls[AttentionKind.PREFILL_KERNEL] = self._prefill_kernel
        self.windowed_impls[AttentionKind.DECODE_KERNEL] = self._decode_kernel_windowed
        self.windowed_impls[AttentionKind.PREFILL_KERNEL] = self._prefill_kernel_windowed

    def __repr__(self) -> str:
        return (f"CpuPagedAttention(decode_kernel={self.decode_kernel}, prefill_kernel={self.prefill_kernel}, "
                f"write_kv_kernel={self.write_kv_kernel}, prefill_bf16_tiles={self.prefill_bf16_tiles})")

    @classmethod
    def for_cache(cls, key_cache: torch.Tensor, query_dtype: torch.dtype,
                  bf16_prefill: bool = False) -> CpuPagedAttention:
        """The kernels that apply to this cache (``[num_slots, Hkv, D]``) under ``query_dtype``
        queries: they compute in float32 and build on first use (``None`` of them if they cannot).
        ``bf16_prefill``: a run that never decodes (pooling) in bfloat16 numerics, whose prefill
        chunks may take bfloat16 tiles where the machine has them."""
        f32 = query_dtype == torch.float32
        prefill = f32 and cpu_kernel.prefill_usable_for(key_cache)
        return cls(decode_kernel=f32 and cpu_kernel.usable_for(key_cache), prefill_kernel=prefill,
                   write_kv_kernel=f32 and cpu_ops.writes_kv_into(key_cache),
                   prefill_bf16_tiles=prefill and bf16_prefill and cpu_kernel.prefill_bf16_tiles_usable_for(key_cache))

    @property
    def uses_kernels(self) -> bool:
        return self.decode_kernel or self.prefill_kernel or self.write_kv_kernel

    @property
    def takes_decode_table(self) -> bool:  # type: ignore[override]
        """The decode kernel reads any table width in place (bfloat16 tiles prefill the decodes instead)."""
        return self.decode_kernel and not self.prefill_bf16_tiles

    def _decode_table_group(self, decode_lens: list[int], decode_table: torch.Tensor,
                            seq_lens: torch.Tensor | None) -> tuple[list[AttentionGroup], list[int]]:
        n = len(decode_lens)
        group = AttentionGroup(AttentionKind.DECODE_KERNEL, 0, n, n, 1, decode_table, None,
                               seq_lens=torch.tensor(decode_lens, dtype=torch.long) if seq_lens is None else seq_lens)
        return [group], list(range(n))

    # ------------------------------------------------------------------ metadata
    def _decode_groups(self, decode_lens: list[int], decode_block_tables: list[list[int]], block_size: int,
                       device: torch.device) -> tuple[list[AttentionGroup], list[int]]:
        """All decodes as one ``DECODE_KERNEL`` group: the kernel reads blocks in place, so grouping
        by length or shared prefix gains nothing. With bfloat16 tiles (a run that never decodes) a
        "decode" is a one-token prefill chunk after cached tokens, and takes the same kernel as the
        others: its numerics must not depend on where the prompt was cut."""
        if self.prefill_bf16_tiles and decode_lens:
            groups: list[AttentionGroup] = []
            chunks = [(n - 1, 1, table) for n, table in zip(decode_lens, decode_block_tables, strict=True)]
            self._chunk_groups(groups, 0, chunks, block_size, device)
            return groups, list(range(len(decode_lens)))
        if not (self.decode_kernel and decode_lens):
            return super()._decode_groups(decode_lens, decode_block_tables, block_size, device)
        table = _padded_block_table(decode_lens, decode_block_tables, block_size)
        n = len(decode_lens)
        group = AttentionGroup(AttentionKind.DECODE_KERNEL, 0, n, n, 1, table, None,
                               seq_lens=torch.tensor(decode_lens, dtype=torch.long))
        return [group], list(range(n))

    def _chunk_groups(self, groups: list[AttentionGroup], start: int, chunks: list[tuple[int, int, list[int]]],
                      block_size: int, device: torch.device) -> int:
        """All prefill chunks as one ``PREFILL_KERNEL`` group (one task per chunk, KV head and tile).

        The prefill kernel sums every score, softmax denominator and weighted value in the decode
        kernel's order (tested bit for bit), so a token's result is the same whether it was decoded
        or prefilled: a request preempted by recompute prefills the tokens it had decoded, and a
        prompt that repeats an earlier answer finds it decoded in the prefix cache or prefills it
        (a last-bit difference between the kernels once flipped a greedy token of SmolLM2).
        """
        if chunks and self.decode_kernel and not self.prefill_kernel:
            return self._chunks_as_decodes(groups, start, chunks, block_size)
        if not chunks or not self.prefill_kernel:
            return super()._chunk_groups(groups, start, chunks, block_size, device)
        table, info, end = _chunk_tables(chunks, start, block_size)
        groups.append(AttentionGroup(AttentionKind.PREFILL_KERNEL, start, end, len(chunks), 0, table, None,
                                     prefill_chunks=info))
        return end

    def _chunks_as_decodes(self, groups: list[AttentionGroup], start: int, chunks: list[tuple[int, int, list[int]]],
                           block_size: int) -> int:
        """Where the prefill kernel does not exist (no AVX-512) but the decode kernel does, every
        token of a chunk is a decode of its own position through the decode kernel: its result is
        then the bits it gets decoded, whatever the chunking (SDPA's change with the chunk's length,
        and a preemption by recompute or a speculative step flipped greedy tokens of SmolLM2)."""
        lens = [c + i + 1 for c, n, _ in chunks for i in range(n)]
        table, info, end = _chunk_tables(chunks, start, block_size)
        # (prefill_chunks marks the rows as chunks': the decode graph, which takes a step of decodes
        # whole, leaves them to the layers)
        groups.append(AttentionGroup(AttentionKind.DECODE_KERNEL, start, end, len(lens), 1,
                                     table.repeat_interleave(info[2], dim=0), None,
                                     seq_lens=torch.tensor(lens, dtype=torch.long), prefill_chunks=info))
        return end

    # ------------------------------------------------------------------ forward
    def write_kv(self, key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                 slot_mapping: torch.Tensor) -> None:
        """The kernel is a parallel row copy straight from the (strided) qkv output; ``index_copy_``
        runs on one thread and costs ~8 % of a prefill step. Heads must be contiguous in each row."""
        if self.write_kv_kernel and key.stride(1) == key.shape[2] and value.stride(1) == value.shape[2]:
            cpu_ops.write_kv(key, value, key_cache, value_cache, slot_mapping)
        else:
            super().write_kv(key, value, key_cache, value_cache, slot_mapping)

    @staticmethod
    def _decode_kernel(out: torch.Tensor, grp: AttentionGroup, query: torch.Tensor, key: torch.Tensor | None,
                       value: torch.Tensor | None, key_cache: torch.Tensor, value_cache: torch.Tensor, block_size: int,
                       scale: float) -> None:
        CpuPagedAttention._decode_kernel_windowed(out, grp, query, key_cache, value_cache, block_size, scale, None,
                                                  None)

    @staticmethod
    def _decode_kernel_windowed(out: torch.Tensor, grp: AttentionGroup, query: torch.Tensor,
                                key_cache: torch.Tensor, value_cache: torch.Tensor, block_size: int, scale: float,
                                window: int | None, softcap: float | None) -> None:
        hq, d = query.shape[1], query.shape[2]
        b = grp.batch_size
        if grp.kv_blocks is None or grp.seq_lens is None:
            raise ValueError("a DECODE_KERNEL group needs kv_blocks and seq_lens")
        q = query[grp.token_start:grp.token_end]  # rows strided in the qkv output: the kernel reads them in place
        if q.stride(2) != 1 or q.stride(1) != d:
            q = q.contiguous()
        cpu_kernel.paged_decode_attention(out[grp.token_start:grp.token_end].view(b, hq, d), q, key_cache,
                                          value_cache, grp.kv_blocks, grp.seq_lens, block_size, scale,
                                          window=window, softcap=softcap)

    def _prefill_kernel(self, out: torch.Tensor, grp: AttentionGroup, query: torch.Tensor, key: torch.Tensor | None,
                        value: torch.Tensor | None, key_cache: torch.Tensor, value_cache: torch.Tensor, block_size: int,
                        scale: float) -> None:
        self._prefill_kernel_windowed(out, grp, query, key_cache, value_cache, block_size, scale, None, None)

    def _prefill_kernel_windowed(self, out: torch.Tensor, grp: AttentionGroup, query: torch.Tensor,
                                 key_cache: torch.Tensor, value_cache: torch.Tensor, block_size: int, scale: float,
                                 window: int | None, softcap: float | None) -> None:
        # Reads every chunk's K/V (just written by forward) in place; queries stay strided. A layer with
        # a window or a soft-cap takes the float32 kernel (the AMX one has neither).
        info = grp.prefill_chunks
        if grp.kv_blocks is None or info is None:
            raise ValueError("a PREFILL_KERNEL group needs kv_blocks and prefill_chunks")
        tiles = self.prefill_bf16_tiles and window is None and softcap is None
        cpu_kernel.paged_prefill_attention(out, query, key_cache, value_cache, grp.kv_blocks, info[0], info[1],
                                           info[2], block_size, scale, bf16_tiles=tiles, window=window,
                                           softcap=softcap)
