"""The ``"cuda"`` attention backend: every decode and every prefill chunk through one Triton kernel
(``triton_attention.py``) that reads the block tables in place; K/V written with ``index_copy_``.

Decodes form one ``DECODE_KERNEL`` group, chunks one ``PREFILL_KERNEL`` group; each carries its
kernel inputs (``AttentionGroup.kernel_args``), built once per step on the device. The decodes'
keys are split into partitions across programs (flash-decoding: a lone decode is otherwise one
program per KV head); a chunk already has a program per tile of its rows. Layers with a
sliding window or a logit soft-cap take the same kernel. Chosen by ``select_attention_backend``
for a cache on a CUDA device; on a CPU it runs only under ``TRITON_INTERPRET=1`` (the tests).
"""

from __future__ import annotations

from collections.abc import Callable
from itertools import accumulate

import torch

from pagellm.attention import triton_attention
from pagellm.attention.metadata import AttentionGroup, AttentionKind, AttentionMetadata
from pagellm.attention.torch_paged import TorchPagedAttention, _padded_block_table
from pagellm.layers.rotary import ApplyRotary

CACHE_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
MIN_BLOCK_SIZE = 16  # (tl.dot's smallest tile on a GPU)


class CudaPagedAttention(TorchPagedAttention):
    name = "cuda"

    def __init__(self) -> None:
        super().__init__()
        for kind in (AttentionKind.DECODE_KERNEL, AttentionKind.PREFILL_KERNEL):
            self.impls[kind] = self._kernel
            self.windowed_impls[kind] = self._kernel_windowed

    @classmethod
    def for_cache(cls, key_cache: torch.Tensor, query_dtype: torch.dtype) -> CudaPagedAttention:
        if key_cache.dtype not in CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype {str(key_cache.dtype).removeprefix('torch.')} is not supported on "
                             "CUDA (float32, float16 or bfloat16)")
        return cls()

    # ------------------------------------------------------------------ metadata
    @staticmethod
    def _group(kind: AttentionKind, start: int, lens: list[int], q_lens: list[int], tables: list[list[int]],
               block_size: int, device: torch.device, split: bool = False) -> AttentionGroup:
        if device.type == "cuda" and block_size < MIN_BLOCK_SIZE:
            raise ValueError(f"block_size={block_size}: the CUDA backend needs at least {MIN_BLOCK_SIZE} "
                             "(its kernel multiplies one block's keys as a tile)")
        table = _padded_block_table(lens, tables, block_size).to(device=device, dtype=torch.int32)
        q_start = torch.tensor(list(accumulate(q_lens, initial=start)), dtype=torch.int32, device=device)
        seq_lens = torch.tensor(lens, dtype=torch.int32, device=device)
        parts = -(-max(lens) // triton_attention.partition_size(block_size)) if split else 1
        return AttentionGroup(kind, start, start + sum(q_lens), len(lens), max(q_lens), table, None,
                              kernel_args=(table, q_start, seq_lens, max(q_lens), parts))

    def _decode_groups(self, decode_lens: list[int], decode_block_tables: list[list[int]], block_size: int,
                       device: torch.device) -> tuple[list[AttentionGroup], list[int]]:
        if not decode_lens:
            return [], []
        n = len(decode_lens)
        group = self._group(AttentionKind.DECODE_KERNEL, 0, decode_lens, [1] * n, decode_block_tables, block_size,
                            device, split=True)
        return [group], list(range(n))

    def _chunk_groups(self, groups: list[AttentionGroup], start: int, chunks: list[tuple[int, int, list[int]]],
                      block_size: int, device: torch.device) -> int:
        if not chunks:
            return start
        group = self._group(AttentionKind.PREFILL_KERNEL, start, [c + q for c, q, _ in chunks],
                            [q for _, q, _ in chunks], [ids for _, _, ids in chunks], block_size, device)
        groups.append(group)
        return group.token_end

    # ------------------------------------------------------------------ forward
    def rotary_and_write_kv(self, rotary: Callable[..., tuple[torch.Tensor, torch.Tensor]], query: torch.Tensor,
                            key: torch.Tensor, value: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                            kv_cache: tuple[torch.Tensor, torch.Tensor],
                            meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor, bool]:
        """One Triton kernel rotates the query and key heads and writes the key and value heads into
        the cache, where the layer's rotary op runs in Triton and takes these tensors."""
        if not (isinstance(rotary, ApplyRotary) and rotary.use_triton and rotary.triton_takes(query, key, rope)
                and value.stride(2) == 1):
            return super().rotary_and_write_kv(rotary, query, key, value, rope, kv_cache, meta)
        from pagellm.kernels import triton_ops

        triton_ops.rotary_and_write_kv(query, key, value, *rope, kv_cache[0], kv_cache[1], meta.slot_mapping)
        return query, key, True

    @staticmethod
    def _kernel(out: torch.Tensor, grp: AttentionGroup, query: torch.Tensor, key: torch.Tensor | None,
                value: torch.Tensor | None, key_cache: torch.Tensor, value_cache: torch.Tensor, block_size: int,
                scale: float) -> None:
        CudaPagedAttention._kernel_windowed(out, grp, query, key_cache, value_cache, block_size, scale, None, None)

    @staticmethod
    def _kernel_windowed(out: torch.Tensor, grp: AttentionGroup, query: torch.Tensor, key_cache: torch.Tensor,
                         value_cache: torch.Tensor, block_size: int, scale: float, window: int | None,
                         softcap: float | None) -> None:
        if grp.kernel_args is None:
            raise ValueError(f"a {grp.kind.name} group of the cuda backend needs its kernel_args")
        table, q_start, seq_lens, max_query_len, num_partitions = grp.kernel_args
        hq, d = query.shape[1], query.shape[2]
        if query.stride(2) != 1:
            query = query.contiguous()
        triton_attention.paged_attention(out.view(-1, hq, d), query, key_cache, value_cache, table, q_start, seq_lens,
                                         max_query_len, block_size, scale, window, softcap, num_partitions)
