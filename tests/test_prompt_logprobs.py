"""``SamplingParams(prompt_logprobs=k)`` and the completions API's ``echo`` with ``logprobs``: every
prompt position scored as HF's ``log_softmax`` over the same prompt scores it (float64 here), under
small chunks, after a prefix-cache hit, under recompute preemption, in bounded slices."""

from __future__ import annotations

import math

import openai
import pytest
import torch
import transformers

from pagellm import LLM, SamplingParams
from pagellm.config import EngineArgs
from pagellm.engine.async_llm import AsyncLLM

from conftest import build_tiny_checkpoint

PROMPTS = [list(range(100, 140)), [5, 9, 31, 7, 7, 7, 300, 12], [42, 43]]
K = 3


def hf_log_softmax(path: str, prompt: list[int]) -> torch.Tensor:
    """Row ``j`` scores the token after prompt position ``j`` (float64)."""
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([prompt])).logits[0].double(), -1)


def check_against_hf(path: str, prompt: list[int], got) -> None:
    ref = hf_log_softmax(path, prompt)
    assert len(got) == len(prompt) and got[0] is None
    for j in range(1, len(prompt)):
        row, entry = ref[j - 1], got[j]
        token = prompt[j]
        assert abs(entry[token].logprob - row[token].item()) < 1e-4, (j, entry[token], row[token].item())
        # The rank: 1 + the tokens scored above it, up to ties within float32's error (a deep rank
        # has thousands of neighbours).
        v = row[token].item()
        assert int((row > v + 1e-4).sum()) + 1 <= entry[token].rank <= int((row > v - 1e-4).sum()) + 1
        top = row.topk(K)
        # The top-k by the reference, each within 1e-4 (a near-tie at the k-th place may swap).
        for t, v in zip(top.indices.tolist(), top.values.tolist(), strict=True):
            if v - top.values[-1].item() > 1e-4:
                assert t in entry and abs(entry[t].logprob - v) < 1e-4, (j, t)
        assert len(entry) in (K, K + 1)


@pytest.fixture(scope="module")
def path(ckpt_root):
    return build_tiny_checkpoint(ckpt_root, "llama")


def _generate(llm: LLM, prompts, k: int | None = K, max_tokens: int = 3):
    params = SamplingParams(temperature=0, max_tokens=max_tokens, prompt_logprobs=k, ignore_eos=True)
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)


def test_prompt_logprobs_equal_hf_under_small_chunks(path):
    llm = LLM(path, dtype="float32", max_num_batched_tokens=16, long_prefill_token_threshold=7)
    outs = _generate(llm, PROMPTS)
    for prompt, out in zip(PROMPTS, outs, strict=True):
        check_against_hf(path, prompt, out.prompt_logprobs)
    assert _generate(llm, PROMPTS[:1], k=None)[0].prompt_logprobs is None
    assert _generate(llm, [[42]])[0].prompt_logprobs == [None]  # (one token: nothing to score)
    zero = _generate(llm, PROMPTS[1:2], k=0)[0].prompt_logprobs
    assert [list(d) for d in zero[1:]] == [[t] for t in PROMPTS[1][1:]]  # only each actual token
    with pytest.raises(ValueError, match="prompt_logprobs must be an integer in"):
        SamplingParams(prompt_logprobs=21)


def test_a_prefix_cache_hit_is_computed_again(path):
    """vLLM's rule: a request with prompt logprobs takes no prefix-cache hit (its positions must be
    computed); the same prompt without them does hit."""
    llm = LLM(path, dtype="float32")
    prompt = PROMPTS[0]
    _generate(llm, [prompt], k=None)
    plain = _generate(llm, [prompt], k=None)[0]
    assert plain.num_cached_tokens >= 32
    scored = _generate(llm, [prompt])[0]
    assert scored.num_cached_tokens == 0
    check_against_hf(path, prompt, scored.prompt_logprobs)


def test_bounded_slices_and_recompute_preemption(path, monkeypatch):
    from pagellm.worker import model_runner

    monkeypatch.setattr(model_runner, "PROMPT_LOGPROBS_ROWS", 5)
    llm = LLM(path, dtype="float32", num_gpu_blocks_override=6, block_size=16, preemption_mode="recompute",
              max_num_batched_tokens=32)
    model = llm.llm_engine.executor.worker.model
    rows: list[int] = []
    compute = model.compute_logits
    monkeypatch.setattr(model, "compute_logits", lambda h: rows.append(h.shape[0]) or compute(h))
    prompts = [PROMPTS[0], PROMPTS[0][::-1], PROMPTS[1]]
    outs = _generate(llm, prompts, max_tokens=30)
    assert llm.llm_engine.get_stats()["num_preemptions"] > 0
    assert max(rows) <= 5 + 3  # a slice of prompt rows, or the step's sampled rows
    for prompt, out in zip(prompts, outs, strict=True):
        check_against_hf(path, prompt, out.prompt_logprobs)


@pytest.fixture(scope="module")
def client(path):
    from test_server import KEY, _Server

    engine = AsyncLLM.from_engine_args(EngineArgs(model=path, dtype="float32", kv_cache_memory="16MiB",
                                                  max_model_len=256))
    srv = _Server(engine, KEY)  # type: ignore[arg-type]
    yield openai.OpenAI(base_url=srv.url + "/v1", api_key=KEY, max_retries=0, timeout=60)
    srv.stop()
    engine.shutdown()


def test_echo_with_logprobs_through_the_openai_client(client, path):
    prompt = PROMPTS[1]
    ref = hf_log_softmax(path, prompt)
    for max_tokens, stream in ((4, False), (0, False), (0, True), (4, True)):
        kw = dict(model="tiny", prompt=prompt, max_tokens=max_tokens, echo=True, logprobs=2, temperature=0)
        if stream:
            chunks = list(client.completions.create(stream=True, **kw))
            lp = chunks[0].choices[0].logprobs
            text = "".join(c.choices[0].text for c in chunks if c.choices)
            n_out = sum(len(c.choices[0].logprobs.tokens) for c in chunks[1:] if c.choices and c.choices[0].logprobs)
            n_out += len(lp.tokens) - len(prompt)
        else:
            r = client.completions.create(**kw)
            lp, text = r.choices[0].logprobs, r.choices[0].text
            n_out = len(lp.tokens) - len(prompt)
            assert r.usage.completion_tokens == max_tokens and r.choices[0].finish_reason == "length"
        assert n_out == max_tokens, (max_tokens, stream)
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        for j in range(1, len(prompt)):
            assert math.isclose(lp.token_logprobs[j], ref[j - 1, prompt[j]].item(), abs_tol=1e-4)
            assert len(lp.top_logprobs[j]) >= 2
        assert text.startswith("".join(lp.tokens[:len(prompt)])[:5])
    r = client.completions.create(model="tiny", prompt=prompt, max_tokens=1,
                                  extra_body={"prompt_logprobs": 1})
    scored = r.choices[0].model_extra["prompt_logprobs"]
    assert scored[0] is None and math.isclose(scored[3][str(prompt[3])]["logprob"], ref[2, prompt[3]].item(),
                                              abs_tol=1e-4)
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="tiny", prompt=prompt, max_tokens=1, extra_body={"prompt_logprobs": 50})
    assert e.value.body["param"] == "prompt_logprobs"
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="tiny", prompt=prompt, max_tokens=0)
    assert e.value.body["param"] == "max_tokens"
