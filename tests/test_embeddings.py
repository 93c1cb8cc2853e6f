"""``runner="pooling"``: ``LLM.embed`` and ``POST /v1/embeddings``. Every vector is HF's
``AutoModel`` last hidden state pooled in float64 by a formula written here (last token, mean,
first token; L2-normalized), under chunked prefill; batched equals alone; prefix hits stay
right; a checkpoint's sentence-transformers setup is read; the ``openai`` client's
``embeddings.create`` (float and base64) through the server."""

from __future__ import annotations

import base64
import json
import os
import shutil

import numpy as np
import openai
import pytest
import torch
import transformers

from pagellm import LLM, PoolingParams
from pagellm.config import EngineArgs

from conftest import build_tiny_checkpoint

PROMPTS = [list(range(100, 140)), [5, 9, 31, 7], list(range(300, 321)), [42], list(range(7, 70, 2))]
CHUNKED = dict(dtype="float32", runner="pooling", max_num_batched_tokens=16, long_prefill_token_threshold=8)


def hf_pooled(path: str, prompt: list[int], pooling_type: str, normalize: bool = True) -> torch.Tensor:
    model = transformers.AutoModel.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        h = model(torch.tensor([prompt])).last_hidden_state[0].double()
    v = {"LAST": h[-1], "MEAN": h.mean(0), "CLS": h[0]}[pooling_type]
    return v / v.norm() if normalize else v


def _read_json(path: str) -> dict:
    with open(path) as f:
        return json.load(f)


def test_bfloat16_pooling_without_amx(tmp_path, monkeypatch):
    """bfloat16 numerics on an AVX512-BF16 machine without AMX (or with it turned off): the
    projections on the bfloat16 dot-product kernel, prefill attention on the float32 kernel (no
    tiles); the vectors stay close to HF's float32 ones, and chunked, batched or alone they are the
    same bits."""
    from conftest import require_bf16_kernel

    require_bf16_kernel()
    monkeypatch.setenv("PAGELLM_CPU_AMX", "0")
    path = build_tiny_checkpoint(str(tmp_path), "qwen3", head_dim=64)
    llm = LLM(path, dtype="bfloat16", runner="pooling", pooler_config={"pooling_type": "MEAN"},
              max_num_batched_tokens=16, long_prefill_token_threshold=8)
    backend = llm.llm_engine.executor.worker.model_runner.attn_backend
    assert llm.llm_engine.model_info.dtype == "bfloat16" and backend.prefill_kernel and not backend.prefill_bf16_tiles
    _assert_bfloat16_mean_pooling(llm, path)


def _assert_bfloat16_mean_pooling(llm: LLM, path: str) -> None:
    """MEAN-pooled bfloat16 vectors: close to HF's float32 ones but not equal to them (bfloat16
    numerics), and chunked, batched or alone the same bits."""
    batched = _embed(llm)
    for prompt, vec in zip(PROMPTS, batched, strict=True):
        want = hf_pooled(path, prompt, "MEAN")
        got = torch.tensor(vec, dtype=torch.float64)
        assert got @ want > 0.999, (got @ want).item()
        assert (got - want).abs().max() > 1e-5  # (bfloat16 numerics, not float32's)
    assert [_embed(llm, [p])[0] for p in PROMPTS] == batched
    assert _embed(llm, PROMPTS[::-1])[::-1] == batched


def _embed(llm: LLM, prompts=PROMPTS, **kw) -> list[list[float]]:
    return [o.outputs.embedding for o in llm.embed([{"prompt_token_ids": p} for p in prompts], use_tqdm=False, **kw)]


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("pooling_type", ["LAST", "MEAN", "CLS"])
def test_each_pooling_equals_hf_and_batched_equals_alone(ckpt_root, arch, pooling_type):
    path = build_tiny_checkpoint(ckpt_root, arch)
    llm = LLM(path, pooler_config={"pooling_type": pooling_type}, **CHUNKED)
    batched = _embed(llm)
    for prompt, vec in zip(PROMPTS, batched, strict=True):
        got = torch.tensor(vec, dtype=torch.float64)
        torch.testing.assert_close(got, hf_pooled(path, prompt, pooling_type), rtol=0, atol=1e-5)
        assert abs(got.norm().item() - 1) < 1e-6
    # Alone (other chunk boundaries, a prefix hit for LAST) or in another order: the same vectors to
    # float32's resolution. Not the same bits: a chunk with no earlier context attends over its own
    # K/V (SDPA) and one after cached or earlier context over the paged blocks, which sum in
    # another order (measured: up to 2e-7; with one request at a time and no hits, bit-equal).
    for again in ([_embed(llm, [p])[0] for p in PROMPTS], _embed(llm, PROMPTS[::-1])[::-1]):
        for a, b in zip(again, batched, strict=True):
            torch.testing.assert_close(torch.tensor(a), torch.tensor(b), rtol=0, atol=1e-6)


def test_prefix_hits_where_the_pooling_allows_them(ckpt_root):
    """LAST pooling takes prefix-cache hits (the last token is always computed); MEAN must compute
    every position, so it takes none; both give the vectors they gave cold."""
    path = build_tiny_checkpoint(ckpt_root, "llama")
    long = [list(range(100, 164))]
    for pooling_type, hits in (("LAST", True), ("MEAN", False)):
        llm = LLM(path, dtype="float32", runner="pooling", pooler_config={"pooling_type": pooling_type})
        cold = _embed(llm, long)
        warm = _embed(llm, long)
        assert warm == cold
        stats = llm.llm_engine.get_stats()
        assert (stats["prefix_cache_hits"] > 0) == hits, stats["prefix_cache_hits"]


def test_a_checkpoints_pooling_setup_is_read(ckpt_root, tmp_path):
    src = build_tiny_checkpoint(ckpt_root, "llama")
    # A base model (no LM head, weights without "model."), as AutoModel saves embedding checkpoints.
    base = str(tmp_path / "st")
    transformers.AutoModel.from_pretrained(src, dtype=torch.float32).save_pretrained(base)
    transformers.AutoTokenizer.from_pretrained(src).save_pretrained(base)
    assert _read_json(os.path.join(base, "config.json"))["architectures"] == ["LlamaModel"]
    os.makedirs(os.path.join(base, "1_Pooling"))
    with open(os.path.join(base, "modules.json"), "w") as f:
        json.dump([{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
                   {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}], f)
    with open(os.path.join(base, "1_Pooling", "config.json"), "w") as f:
        json.dump({"word_embedding_dimension": 64, "pooling_mode_mean_tokens": True, "pooling_mode_cls_token": False,
                   "pooling_mode_lasttoken": False}, f)
    vec = _embed(LLM(base, dtype="float32", runner="pooling"), PROMPTS[:1])[0]
    # Mean pooling, and no Normalize module: not normalized.
    torch.testing.assert_close(torch.tensor(vec, dtype=torch.float64), hf_pooled(src, PROMPTS[0], "MEAN", False),
                               rtol=0, atol=1e-5)
    with pytest.raises(ValueError, match="base model without an LM head"):
        LLM(base, dtype="float32")
    with open(os.path.join(base, "1_Pooling", "config.json"), "w") as f:
        json.dump({"pooling_mode_max_tokens": True}, f)
    with pytest.raises(ValueError, match="pooling_mode_max_tokens.*not supported"):
        LLM(base, runner="pooling")


def test_matryoshka_dimensions_and_refusals(ckpt_root, tmp_path):
    src = build_tiny_checkpoint(ckpt_root, "llama")
    path = str(tmp_path / "mrl")
    shutil.copytree(src, path)
    cfg = _read_json(os.path.join(path, "config.json"))
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump({**cfg, "matryoshka_dimensions": [16, 32]}, f)
    llm = LLM(path, dtype="float32", runner="pooling")
    full = torch.tensor(_embed(llm, PROMPTS[:1])[0], dtype=torch.float64)
    cut = torch.tensor(_embed(llm, PROMPTS[:1], pooling_params=PoolingParams(dimensions=16))[0], dtype=torch.float64)
    torch.testing.assert_close(cut, full[:16] / full[:16].norm(), rtol=0, atol=1e-6)
    with pytest.raises(ValueError, match=r"dimensions must be one of \[16, 32\]"):
        _embed(llm, PROMPTS[:1], pooling_params=PoolingParams(dimensions=20))
    with pytest.raises(ValueError, match="does not support Matryoshka"):
        _embed(LLM(src, runner="pooling"), PROMPTS[:1], pooling_params=PoolingParams(dimensions=16))
    with pytest.raises(ValueError, match="embeds prompts"):
        llm.generate("hi")
    with pytest.raises(ValueError, match="runner='pooling'"):
        LLM(src).embed("hi")
    with pytest.raises(ValueError, match="pooling_type must be one of"):
        EngineArgs(runner="pooling", pooler_config={"pooling_type": "MAX"}).create_engine_config()


@pytest.fixture(scope="module")
def pooling_server(ckpt_root):
    from test_server import KEY, _Server

    from pagellm.engine.core_client import AsyncEngineClient

    path = build_tiny_checkpoint(ckpt_root, "llama")
    args = EngineArgs(model=path, dtype="float32", runner="pooling", pooler_config={"pooling_type": "MEAN"},
                      kv_cache_memory="16MiB", max_model_len=256)
    engine = AsyncEngineClient.start(args)  # (the engine core process, as `pagellm serve` runs it)
    srv = _Server(engine, KEY)  # type: ignore[arg-type]
    yield openai.OpenAI(base_url=srv.url + "/v1", api_key=KEY, max_retries=0, timeout=60), path
    srv.stop()
    engine.shutdown()


def test_embeddings_through_the_openai_client(pooling_server):
    client, path = pooling_server
    tok = transformers.AutoTokenizer.from_pretrained(path)
    texts = ["The capital of France is Paris.", "A paged KV cache.", "x"]
    ref = [hf_pooled(path, tok(t)["input_ids"], "MEAN") for t in texts]
    # (no encoding_format: the SDK asks for base64 and decodes it itself; "base64" asked for: we do)
    for fmt in (openai.NOT_GIVEN, "float", "base64"):
        r = client.embeddings.create(model="tiny", input=texts, encoding_format=fmt)
        assert [d.index for d in r.data] == [0, 1, 2]
        for d, want in zip(r.data, ref, strict=True):
            vec = d.embedding if fmt != "base64" else np.frombuffer(base64.b64decode(d.embedding), "<f4").tolist()
            torch.testing.assert_close(torch.tensor(vec, dtype=torch.float64), want, rtol=0, atol=1e-5)
        assert r.usage.prompt_tokens == r.usage.total_tokens == sum(len(tok(t)["input_ids"]) for t in texts)
    one = client.embeddings.create(model="tiny", input=PROMPTS[1])
    torch.testing.assert_close(torch.tensor(one.data[0].embedding, dtype=torch.float64),
                               hf_pooled(path, PROMPTS[1], "MEAN"), rtol=0, atol=1e-5)
    assert len(client.embeddings.create(model="tiny", input=[PROMPTS[0], PROMPTS[3]]).data) == 2
    for kw, param in (({"dimensions": 8}, "dimensions"), ({"input": []}, "input"), ({"input": [[10**6]]}, "input"),
                      ({"input": "a" * 3000}, "input"), ({"encoding_format": "int8"}, "encoding_format")):
        with pytest.raises(openai.BadRequestError) as e:
            client.embeddings.create(**{"model": "tiny", "input": "hi", **kw})
        assert e.value.body["param"] == param, kw
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}])
    assert "/v1/embeddings" in e.value.body["message"]


def test_bfloat16_pooling_attention_takes_bf16_tiles(tmp_path):
    """A pooling run never decodes, so in bfloat16 numerics its prefill attention takes AMX bfloat16
    tiles (a generating run keeps the kernel that sums as decodes do): the vectors stay close to
    HF's float32 ones, and chunked, batched or alone they are the same bits."""
    from conftest import require_amx_kernel

    require_amx_kernel()
    path = build_tiny_checkpoint(str(tmp_path), "qwen3", head_dim=64)  # (a head size with an AMX kernel)
    llm = LLM(path, dtype="bfloat16", runner="pooling", pooler_config={"pooling_type": "MEAN"},
              max_num_batched_tokens=16, long_prefill_token_threshold=8)
    assert llm.llm_engine.executor.worker.model_runner.attn_backend.prefill_bf16_tiles
    _assert_bfloat16_mean_pooling(llm, path)
    generating = LLM(path, dtype="bfloat16")
    assert not generating.llm_engine.executor.worker.model_runner.attn_backend.prefill_bf16_tiles
