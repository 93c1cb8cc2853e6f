"""Encoder-only models on the pooling runner: BERT and XLM-RoBERTa (``BertModel``,
``XLMRobertaModel``: sentence-transformers' embedders, BGE, E5) and their
``...ForSequenceClassification`` heads (cross-encoder rerankers).

Post-LN blocks (``LayerNorm(x + sublayer(x))``), learned absolute positions, token types, exact
(erf) GELU, and bidirectional attention: every token of a prompt attends to every other, so a
prompt must be computed whole in one step and its K/V can never be reused by another request. The
engine therefore runs these models with chunked prefill and prefix caching off (``LLMEngine``), and
the model keeps no K/V at all: each step's prompts are told apart by their positions (each starts
at 0), and each attends over its own rows. The module tree and names are HF's, so a checkpoint
loads name for name (``load_weights``)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pagellm.layers.linear import Linear


def prompt_spans(positions: torch.Tensor) -> list[tuple[int, int]]:
    """``(start, end)`` rows of each prompt of a step whose prompts run whole (each from position 0)."""
    starts = (positions == 0).nonzero().flatten().tolist()
    if not starts or starts[0] != 0:
        raise ValueError("an encoder's step must hold whole prompts (chunked prefill and prefix caching off)")
    return list(zip(starts, starts[1:] + [positions.numel()], strict=True))


class EncoderSelfAttention(nn.Module):
    """HF's ``attention.self``: the query, key and value projections."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        h = config.hidden_size
        self.num_heads = self.num_kv_heads = config.num_attention_heads
        self.head_dim = h // self.num_heads
        self.query, self.key, self.value = Linear(h, h), Linear(h, h), Linear(h, h)

    def forward(self, x: torch.Tensor, spans: list[tuple[int, int]]) -> torch.Tensor:
        t, heads, d = x.shape[0], self.num_heads, self.head_dim
        q, k, v = (p(x).view(t, heads, d).transpose(0, 1) for p in (self.query, self.key, self.value))
        out = torch.empty(heads, t, d, dtype=x.dtype, device=x.device)
        for s, e in spans:  # (each prompt over its own rows only: alone or batched, the same arithmetic)
            # (4-D: the CPU's flash kernel takes it; 3-D fell to the math path, 5x slower)
            out[:, s:e] = F.scaled_dot_product_attention(q[None, :, s:e], k[None, :, s:e], v[None, :, s:e])[0]
        return out.transpose(0, 1).reshape(t, heads * d)


class DenseLayerNorm(nn.Module):
    """HF's ``...output``: a projection, then ``LayerNorm(projected + residual)``."""

    def __init__(self, config: Any, in_features: int) -> None:
        super().__init__()
        self.dense = Linear(in_features, config.hidden_size)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self.LayerNorm(self.dense(x) + residual)


class EncoderAttention(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        self.self = EncoderSelfAttention(config)
        self.output = DenseLayerNorm(config, config.hidden_size)

    def forward(self, x: torch.Tensor, spans: list[tuple[int, int]]) -> torch.Tensor:
        return self.output(self.self(x, spans), x)


class Intermediate(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        if config.hidden_act not in ("gelu", "gelu_python"):
            raise ValueError(f"hidden_act {config.hidden_act!r} is not supported for {config.architectures[0]} "
                             "(gelu only)")
        self.dense = Linear(config.hidden_size, config.intermediate_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.gelu(self.dense(x))


class EncoderLayer(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        self.attention = EncoderAttention(config)
        self.intermediate = Intermediate(config)
        self.output = DenseLayerNorm(config, config.intermediate_size)

    @property
    def self_attn(self) -> EncoderSelfAttention:
        """(The worker's KV-cache spec reads a layer's head shape here, as on a decoder.)"""
        return self.attention.self

    def forward(self, x: torch.Tensor, spans: list[tuple[int, int]]) -> torch.Tensor:
        a = self.attention(x, spans)
        return self.output(self.intermediate(a), a)


class Embeddings(nn.Module):
    """Token, absolute position and token-type embeddings, summed, then LayerNorm. XLM-RoBERTa's
    positions start after its padding index (``position_offset``)."""

    def __init__(self, config: Any, position_offset: int) -> None:
        super().__init__()
        self.word_embeddings = nn.Embedding(config.vocab_size, config.hidden_size)
        self.position_embeddings = nn.Embedding(config.max_position_embeddings, config.hidden_size)
        self.token_type_embeddings = nn.Embedding(config.type_vocab_size, config.hidden_size)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.position_offset = position_offset

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, token_types: torch.Tensor) -> torch.Tensor:
        x = self.word_embeddings(input_ids) + self.token_type_embeddings(token_types) \
            + self.position_embeddings(positions + self.position_offset)
        return self.LayerNorm(x)


class Encoder(nn.Module):
    """HF's ``bert`` / ``roberta``: the embeddings and the layers (named ``layers`` as a decoder's)."""

    def __init__(self, config: Any, position_offset: int) -> None:
        super().__init__()
        self.embeddings = Embeddings(config, position_offset)
        self.layers = nn.ModuleList(EncoderLayer(config) for _ in range(config.num_hidden_layers))
        self.start, self.end = 0, config.num_hidden_layers

    @property
    def first_layer(self) -> EncoderLayer:
        return self.layers[0]  # type: ignore[return-value]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, token_types: torch.Tensor,
                spans: list[tuple[int, int]]) -> torch.Tensor:
        x = self.embeddings(input_ids, positions, token_types)
        for layer in self.layers:
            x = layer(x, spans)
        return x


class BertModel(nn.Module):
    """An encoder whose pooled final hidden states are the embedding (the checkpoint's pooling)."""

    is_encoder = True
    position_offset = 0
    prefix = "bert."  # (the classification checkpoints' name for the encoder)
    num_labels: int | None = None  # a classification head's outputs (the pooled vector's size)

    def __init__(self, config: Any, freq_factors: torch.Tensor | None = None, tp: Any = None, pp: Any = None) -> None:
        super().__init__()
        if (tp is not None and tp.world_size > 1) or (pp is not None and pp.num_stages > 1):
            raise ValueError(f"{config.architectures[0]}: tensor and pipeline parallelism are not supported "
                             "for encoder models")
        self.config = config
        offset = self.position_offset if not self.position_offset else (config.pad_token_id or 0) + 1
        self.model = Encoder(config, offset)
        # The separator that ends a pair's first text (token types 0 up to it, 1 after: what BERT's
        # tokenizer gives a pair); set by the loader where the head scores pairs.
        self.sep_token_id: int | None = None

    def token_types(self, input_ids: torch.Tensor, spans: list[tuple[int, int]]) -> torch.Tensor:
        types = torch.zeros_like(input_ids)
        if self.sep_token_id is None or self.config.type_vocab_size < 2:
            return types
        for s, e in spans:
            seps = (input_ids[s:e] == self.sep_token_id).nonzero().flatten()
            if seps.numel() > 1:  # a pair: the second text and its separator are type 1
                types[s + int(seps[0]) + 1:e] = 1
        return types

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: Any = None, meta: Any = None,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        spans = prompt_spans(positions)
        return self.model(input_ids, positions, self.token_types(input_ids, spans), spans)

    def classify(self, pooled: torch.Tensor) -> torch.Tensor:
        """Pooled rows through the classification head (a subclass's)."""
        raise NotImplementedError(f"{type(self).__name__} has no classification head")

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> None:
        """HF's names, the encoder's under ``prefix`` or bare; ``pooler`` (BERT's CLS projection) is
        read only by a head that uses it. Missing or unexpected names raise."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        unexpected: list[str] = []
        has_pooler = "pooler.dense.weight" in params
        for name, tensor in weights:
            target = name.removeprefix(self.prefix)
            if target.endswith("position_ids") or (target.startswith("pooler.") and not has_pooler):
                continue
            target = target.replace("encoder.layer.", "model.layers.").replace("embeddings.", "model.embeddings.", 1)
            param = params.get(target)
            if param is None or param.shape != tensor.shape:
                unexpected.append(f"{name} {tuple(tensor.shape)}")
                continue
            with torch.no_grad():
                param.copy_(tensor if isinstance(tensor, torch.Tensor) else torch.as_tensor(tensor))
            loaded.add(target)
        missing = sorted(set(params) - loaded)
        if missing or unexpected:
            raise ValueError(f"checkpoint does not match {type(self).__name__}: missing {len(missing)} {missing[:8]}, "
                             f"unexpected {len(unexpected)} {unexpected[:8]}")


class TanhHead(nn.Module):
    """``tanh(dense(x))`` (BERT's ``pooler``), then ``out_proj`` where it has one (XLM-RoBERTa's
    ``classifier``)."""

    def __init__(self, hidden: int, num_labels: int | None = None) -> None:
        super().__init__()
        self.dense = Linear(hidden, hidden)
        self.out_proj = Linear(hidden, num_labels) if num_labels is not None else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.tanh(self.dense(x))
        return x if self.out_proj is None else self.out_proj(x)


class BertForSequenceClassification(BertModel):
    """BERT's cross-encoder: the CLS row through ``pooler`` (dense + tanh), then ``classifier``."""

    def __init__(self, config: Any, freq_factors: torch.Tensor | None = None, tp: Any = None, pp: Any = None) -> None:
        super().__init__(config, freq_factors, tp, pp)
        self.num_labels = config.num_labels
        self.pooler = TanhHead(config.hidden_size)
        self.classifier = Linear(config.hidden_size, config.num_labels)

    def classify(self, pooled: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.pooler(pooled))


class XLMRobertaModel(BertModel):
    position_offset = 1  # (positions start at padding_idx + 1)
    prefix = "roberta."


class XLMRobertaForSequenceClassification(XLMRobertaModel):
    """XLM-RoBERTa's cross-encoder: the CLS row through ``classifier.dense`` + tanh, then ``out_proj``."""

    def __init__(self, config: Any, freq_factors: torch.Tensor | None = None, tp: Any = None, pp: Any = None) -> None:
        super().__init__(config, freq_factors, tp, pp)
        self.num_labels = config.num_labels
        self.classifier = TanhHead(config.hidden_size, config.num_labels)

    def classify(self, pooled: torch.Tensor) -> torch.Tensor:
        return self.classifier(pooled)
