"""The draft model of speculative decoding (``method="draft_model"``), run by the target's worker.

Its paged K/V cache has the target's block count and block size, so the target's block tables and
slot mapping address it as they are: every step the draft model runs over the same flat batch as
the target (prompt chunks, decodes, verified drafts), which keeps its K/V in step with the
target's through chunking, prefix hits (a cached block holds both models' K/V for its tokens),
copy-on-write, swap (the same block copies are applied) and recomputation. After the target has
sampled, the draft model decodes ``k`` tokens greedily from each sampling sequence's last emitted
token, writing their K/V in the lookahead slots the scheduler gave that sequence; the next step
verifies them (one-hot proposals: exact under the rejection sampler).
"""

from __future__ import annotations

import torch

from pagellm.attention.metadata import AttentionMetadata
from pagellm.attention.torch_paged import TorchPagedAttention
from pagellm.models.decoder import DecoderForCausalLM
from pagellm.worker.decode_graph import DecodeGraphCapture


class DraftRunner:
    """Runs the draft model over the target's batches, then proposes ``k`` tokens per sequence."""

    def __init__(self, model: DecoderForCausalLM, attn_backend: TorchPagedAttention,
                 kv_caches: list[tuple[torch.Tensor, torch.Tensor]], block_size: int, device: torch.device,
                 max_positions: int) -> None:
        self.model = model
        self.attn_backend = attn_backend
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.device = device
        self.max_positions = max_positions
        self.graphs = DecodeGraphCapture(model)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor,
                decode_lens: list[int], decode_block_tables: list[list[int]],
                chunks: list[tuple[int, int, list[int]]], decode_order: list[int]) -> None:
        """The target's step over the draft's cache (its K/V written; no logits needed).
        ``input_ids`` and ``positions`` are in the target's flat order, its decodes in
        ``decode_order``: the draft's backend must order them the same way."""
        meta = self.attn_backend.build_metadata(decode_lens, decode_block_tables, chunks, self.block_size,
                                                self.device)
        if meta.decode_order != decode_order:  # another backend grouping: permute the decode rows
            n = len(decode_order)
            where = {j: i for i, j in enumerate(decode_order)}
            perm = [where[j] for j in meta.decode_order] + list(range(n, len(input_ids)))
            idx = torch.tensor(perm, dtype=torch.long, device=self.device)
            input_ids, positions, slot_mapping = input_ids[idx], positions[idx], slot_mapping[idx]
        meta.slot_mapping = slot_mapping
        self._run(input_ids, positions, meta)

    def propose(self, starts: list[tuple[int, int, int, list[int], int]]) -> dict[int, tuple[int, list[int]]]:
        """``(seq_id, last token, its position P, block ids, k)`` -> ``seq_id -> (P, drafts)``:
        up to ``k`` greedy tokens each, one batched decode per draft position, as far as the
        sequence's slots (and the model's positions) go."""
        bs = self.block_size
        out: dict[int, tuple[int, list[int]]] = {}
        live = []
        for seq_id, _token, pos, blocks, k in starts:
            k = min(k, len(blocks) * bs - pos, self.max_positions - pos)
            if k > 0:
                live.append((seq_id, pos, blocks, k))
                out[seq_id] = (pos, [])
        tokens = {seq_id: token for seq_id, token, *_ in starts}
        for j in range(max((k for *_, k in live), default=0)):
            rows = [(seq_id, pos + j, blocks) for seq_id, pos, blocks, k in live if j < k]
            meta = self.attn_backend.build_metadata([p + 1 for _, p, _ in rows], [b for *_, b in rows], [], bs,
                                                    self.device)
            order = [rows[i] for i in meta.decode_order]
            meta.slot_mapping = torch.tensor([b[p // bs] * bs + p % bs for _, p, b in order], dtype=torch.long,
                                             device=self.device)
            ids = torch.tensor([tokens[s] for s, _, _ in order], dtype=torch.long, device=self.device)
            pos_t = torch.tensor([p for _, p, _ in order], dtype=torch.long, device=self.device)
            hidden = self._run(ids, pos_t, meta)
            nxt = self.model.compute_logits(hidden).argmax(dim=-1).tolist()
            for (seq_id, _, _), t in zip(order, nxt, strict=True):
                tokens[seq_id] = t
                out[seq_id][1].append(t)
        return out

    def _run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        hidden = self.graphs.forward(input_ids, positions, self.kv_caches, meta)
        return hidden if hidden is not None else self.model(input_ids, positions, self.kv_caches, meta)
