"""Sampler behaviour: seeded reproducibility, filters, penalties, logprobs, parameter validation."""

from __future__ import annotations

import math

import pytest
import torch

from pagellm import LLMEngine, SamplingParams
from pagellm.config import EngineArgs
from pagellm.kernels import sampling as sampling_kernel
from pagellm.sampling.sampler import SamplingRow, apply_penalties, draw_cpu, draw_native, sample, target_probs

from conftest import require_cpu_kernel, run_to_completion


@pytest.fixture(scope="module")
def engine(tiny_llama):
    return LLMEngine.from_engine_args(EngineArgs(model=tiny_llama, kv_cache_memory="16MiB"))


def _run(engine, requests):
    for rid, prompt, params in requests:
        engine.add_request(rid, {"prompt_token_ids": prompt}, params)
    return run_to_completion(engine)


PROMPT = [11, 222, 3333, 4444, 555]


def test_seeded_sampling_is_reproducible_across_batches(engine):
    params = SamplingParams(temperature=1.0, top_p=0.9, top_k=200, seed=42, max_tokens=20, ignore_eos=True)
    alone = _run(engine, [("x", PROMPT, params)])["x"].outputs[0].token_ids
    others = [(f"o{i}", [7 + i] * (3 + 17 * i), SamplingParams(temperature=0.7, max_tokens=5 + 7 * i,
                                                                 seed=i if i % 2 else None)) for i in range(5)]
    crowded = _run(engine, others[:2] + [("x", PROMPT, params)] + others[2:])["x"].outputs[0].token_ids
    assert alone == crowded
    other_seed = _run(engine, [("y", PROMPT, params.clone(seed=43))])["y"].outputs[0].token_ids
    assert other_seed != alone


def test_top_k_1_equals_greedy(engine):
    greedy = _run(engine, [("g", PROMPT, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))])
    topk1 = _run(engine, [("k", PROMPT, SamplingParams(temperature=0.8, top_k=1, max_tokens=16, ignore_eos=True))])
    assert greedy["g"].outputs[0].token_ids == topk1["k"].outputs[0].token_ids


def test_logprobs_are_the_models_log_softmax(tiny_llama):
    import transformers

    # float32, the oracle's numerics: ``auto`` may pick bfloat16 GEMMs on this machine.
    engine = LLMEngine.from_engine_args(EngineArgs(model=tiny_llama, kv_cache_memory="16MiB", dtype="float32"))
    try:
        out = _run(engine, [("l", PROMPT, SamplingParams(temperature=0, max_tokens=3, logprobs=4, ignore_eos=True))])
    finally:
        engine.shutdown()
    comp = out["l"].outputs[0]
    hf = transformers.AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32)
    with torch.no_grad():
        ref = hf(torch.tensor([PROMPT])).logits[0, -1].log_softmax(-1)
    first = comp.logprobs[0]
    top = ref.topk(4)
    assert list(first)[:4] == top.indices.tolist()
    for tok, val in zip(top.indices.tolist(), top.values.tolist(), strict=True):
        assert math.isclose(first[tok].logprob, val, abs_tol=1e-4)
    assert first[comp.token_ids[0]].rank == 1
    assert math.isclose(comp.cumulative_logprob, sum(lp[t].logprob for lp, t in zip(comp.logprobs, comp.token_ids,
                                                                                     strict=True)), abs_tol=1e-5)


def _rows(params, outputs=None, prompt=None):
    return [SamplingRow(params, prompt or [], outputs or [], None)]


@pytest.fixture
def sampling_kernel_built() -> None:
    require_cpu_kernel(sampling_kernel.available, "sampling kernel")


needs_sampling_kernel = pytest.mark.usefixtures("sampling_kernel_built")
DRAWS = [pytest.param(draw_native, id="native"), pytest.param(draw_cpu, id="cpu")]


def _require_draw(draw) -> None:
    """The kernel's draw needs the kernel: a failed build fails the test, as everywhere here."""
    if draw is draw_cpu:
        require_cpu_kernel(sampling_kernel.available, "sampling kernel")


@needs_sampling_kernel
def test_engine_on_cpu_samples_through_the_kernel(engine):
    from pagellm.sampling import sampler as sampler_module

    calls = []
    real = sampler_module.draw_cpu

    def spy(logits, rows):
        calls.append(len(rows))
        return real(logits, rows)

    sampler_module.draw_cpu = spy
    try:
        _run(engine, [("s", PROMPT, SamplingParams(temperature=0.9, top_p=0.9, max_tokens=4, ignore_eos=True))])
    finally:
        sampler_module.draw_cpu = real
    assert calls == [1, 1, 1, 1]


@pytest.mark.parametrize("draw", DRAWS)
def test_top_p_min_p_and_top_k_filter_the_right_tokens(draw):
    _require_draw(draw)
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    logits = probs.log()
    torch.manual_seed(0)
    for params, allowed in [
        (SamplingParams(temperature=1.0, top_p=0.7), {0, 1}),
        (SamplingParams(temperature=1.0, min_p=0.5), {0, 1}),
        (SamplingParams(temperature=1.0, top_k=3), {0, 1, 2}),
        (SamplingParams(temperature=1.0, top_p=0.1), {0}),
    ]:
        seen = {sample(logits.clone(), _rows(params), draw=draw).token_ids[0] for _ in range(300)}
        assert seen == allowed, params


@pytest.mark.parametrize("draw", DRAWS)
def test_unfiltered_sampling_follows_the_distribution(draw):
    _require_draw(draw)
    probs = torch.tensor([[0.6, 0.3, 0.1]])
    gen = torch.Generator().manual_seed(0)
    counts = [0, 0, 0]
    row = [SamplingRow(SamplingParams(temperature=1.0), [], [], gen)]
    for _ in range(3000):
        counts[sample(probs.log(), row, draw=draw).token_ids[0]] += 1
    for c, p in zip(counts, probs[0].tolist(), strict=True):
        assert abs(c / 3000 - p) < 0.04


def test_a_row_without_top_p_keeps_its_tail_beside_a_row_with_top_p():
    """In float32 the running sum of a sorted 49k distribution reaches 1 long before its tail, so
    ``top_p = 1`` must mean no filter at all, not ``mass before >= 1``."""
    logits = torch.randn(2, 49_157, generator=torch.Generator().manual_seed(0)) * 5
    probs = target_probs(logits, [SamplingParams(temperature=1.0, top_p=0.5), SamplingParams(temperature=1.0)])
    assert (probs[1] > 0).all()
    assert (probs[0] > 0).sum() < 49_157


def _random_params(rng: torch.Generator, vocab: int) -> SamplingParams:
    pick = torch.rand(5, generator=rng).tolist()
    return SamplingParams(
        temperature=0.2 + 1.5 * pick[0],
        top_k=int(1 + pick[1] * vocab * 1.2) if pick[1] < 0.6 else -1,  # some past the vocabulary: off
        top_p=0.05 + 0.95 * pick[2] if pick[2] < 0.7 else 1.0,
        min_p=0.3 * pick[3] if pick[3] < 0.4 else 0.0)


@needs_sampling_kernel
@pytest.mark.parametrize("vocab", [7, 100, 49_157])
def test_sampling_kernel_keeps_the_distribution_the_pytorch_filters_keep(vocab):
    """The kernel's final distribution per row (top-k, top-p, min-p without sorting) against
    ``target_probs`` (sorts): the same tokens kept and the same probabilities, for random logits
    (some -inf, as a grammar or ``min_tokens`` leaves them) and random parameters."""
    rng = torch.Generator().manual_seed(vocab)
    rows = 24
    logits = torch.randn(rows, vocab, generator=rng) * (1 + 4 * torch.rand(rows, 1, generator=rng))
    logits[torch.rand(rows, vocab, generator=rng) < 0.1] = float("-inf")
    params = [_random_params(rng, vocab) for _ in range(rows)]
    expected = target_probs(logits.clone(), params)
    got = torch.empty(rows, vocab)
    tokens = sampling_kernel.sample_rows(logits, [p.temperature for p in params],
                                         [p.top_k if 0 < p.top_k < vocab else 0 for p in params],
                                         [p.top_p for p in params], [p.min_p for p in params],
                                         torch.rand(rows, dtype=torch.float64, generator=rng), probs_out=got)
    for r in range(rows):
        assert torch.equal(got[r] > 0, expected[r] > 0), (r, params[r])
        torch.testing.assert_close(got[r], expected[r], rtol=1e-4, atol=1e-6)
        assert expected[r, tokens[r]] > 0


@needs_sampling_kernel
def test_speculative_verification_on_cpu_gets_the_same_distribution_without_sorting():
    """``target_probs_cpu`` (the rejection sampler's on CPU) equals ``target_probs``, a row with no
    finite logit included (it goes through torch)."""
    from pagellm.sampling.sampler import target_probs_cpu

    logits = torch.randn(3, 1000, generator=torch.Generator().manual_seed(5)) * 3
    logits[1] = float("-inf")
    params = [SamplingParams(temperature=0.7, top_p=0.8), SamplingParams(temperature=1.0),
              SamplingParams(temperature=1.3, top_k=20, min_p=0.01)]
    torch.testing.assert_close(target_probs_cpu(logits, params), target_probs(logits.clone(), params),
                               rtol=1e-4, atol=1e-6, equal_nan=True)


@needs_sampling_kernel
def test_a_filter_the_kernel_lacks_sends_its_rows_to_the_reference(monkeypatch):
    """A filter added to ``FILTERS`` but not to the kernel's declared set (here: rows at temperature
    0.9 keep only even tokens) changes those rows' distribution exactly as the reference does, in
    sampling and in the rejection sampler's target; other rows stay on the kernel."""
    from pagellm.sampling import sampler as sampler_module

    def even_only(logits, params):
        keep = torch.tensor([p.temperature == 0.9 for p in params])[:, None] & (torch.arange(logits.shape[1]) % 2 == 1)
        return logits.masked_fill(keep, float("-inf"))

    monkeypatch.setattr(sampler_module, "FILTERS", sampler_module.FILTERS + [
        sampler_module.Filter("even_only", lambda p, vocab: p.temperature == 0.9, even_only)])
    logits = torch.randn(3, 500, generator=torch.Generator().manual_seed(2)) * 2
    params = [SamplingParams(temperature=0.9, top_p=0.9), SamplingParams(temperature=1.0, top_k=50),
              SamplingParams(temperature=0.9)]
    expected = target_probs(logits.clone(), params)
    assert (expected[[0, 2], 1::2] == 0).all() and (expected[1, 1::2] > 0).any()
    torch.testing.assert_close(sampler_module.target_probs_cpu(logits, params), expected, rtol=1e-4, atol=1e-6)
    gens = [torch.Generator().manual_seed(j) for j in range(3)]
    rows = [SamplingRow(p, [], [], g) for p, g in zip(params, gens, strict=True)]
    drawn = torch.stack([draw_cpu(logits, rows) for _ in range(200)])
    assert (drawn[:, [0, 2]] % 2 == 0).all() and (drawn[:, 1] % 2 == 1).any()


@needs_sampling_kernel
def test_sampling_kernel_draw_is_the_inverse_cdf():
    """Evenly spaced uniforms must land on each token in proportion to its probability: with N of
    them, token i is drawn within one of N * p_i times (exact inverse-CDF sampling)."""
    probs = torch.tensor([0.05, 0.0, 0.4, 0.25, 0.3, 0.0])
    n = 1000
    logits = probs.log().expand(n, -1).contiguous()
    u = (torch.arange(n, dtype=torch.float64) + 0.5) / n
    tokens = sampling_kernel.sample_rows(logits, [1.0] * n, [0] * n, [1.0] * n, [0.0] * n, u)
    counts = torch.bincount(tokens, minlength=len(probs))
    assert (counts - n * probs).abs().max() <= 1, counts
    # The draw follows the token order: small u first token, large u the last token with mass.
    assert tokens[0] == 0 and tokens[-1] == 4


@needs_sampling_kernel
def test_sampling_kernel_rows_without_a_finite_logit_fall_back_to_pytorch():
    logits = torch.tensor([[float("-inf")] * 4, [0.0, 1.0, float("nan"), 2.0], [0.0, 5.0, 1.0, 2.0]])
    u = torch.tensor([0.5, 0.5, 0.999], dtype=torch.float64)
    assert sampling_kernel.sample_rows(logits, [1.0] * 3, [0] * 3, [1.0] * 3, [0.0] * 3, u)[:2].tolist() == [-1, -1]
    rows = [SamplingRow(SamplingParams(temperature=1.0, top_k=1), [], [], None) for _ in range(3)]
    assert draw_cpu(logits, rows)[2] == 1  # top_k=1: the maximum; the other rows come back from torch


@needs_sampling_kernel
def test_sampling_kernel_names_bad_arguments():
    logits = torch.zeros(2, 5)
    u = torch.rand(2, dtype=torch.float64)
    with pytest.raises(ValueError, match="top_ps"):
        sampling_kernel.sample_rows(logits, [1.0] * 2, [0] * 2, [1.0], [0.0] * 2, u)
    with pytest.raises(ValueError, match="temperatures"):
        sampling_kernel.sample_rows(logits, [1.0, 0.0], [0] * 2, [1.0] * 2, [0.0] * 2, u)
    with pytest.raises(ValueError, match="uniforms"):
        sampling_kernel.sample_rows(logits, [1.0] * 2, [0] * 2, [1.0] * 2, [0.0] * 2, u.float())


def test_penalties_match_their_definitions():
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0]])
    out = logits.clone()
    params = SamplingParams(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25)
    apply_penalties(out, [SamplingRow(params, [0], [1, 1, 2], None)])
    expected = torch.tensor([[2.0 / 2, -1.0 * 2 - 2 * 0.5 - 0.25, 0.5 / 2 - 0.5 - 0.25, 3.0]])
    torch.testing.assert_close(out, expected)


def test_min_tokens_bans_eos_and_stop_ids():
    logits = torch.tensor([[0.0, 0.0, 10.0, 9.0, 1.0]])
    params = SamplingParams(temperature=0, min_tokens=2, stop_token_ids=[3], eos_token_id=2)
    assert sample(logits, _rows(params, outputs=[4])).token_ids == [4]
    assert sample(logits, _rows(params, outputs=[4, 4])).token_ids == [2]


@pytest.mark.parametrize("field,value", [
    ("temperature", -0.1), ("top_p", 0.0), ("top_p", 1.5), ("max_tokens", 0), ("n", 0), ("top_k", -2),
    ("min_p", 1.5), ("presence_penalty", 3.0), ("repetition_penalty", 0.0), ("min_tokens", -1),
    ("logprobs", -1), ("best_of", 0), ("stop", [""]),
])
def test_invalid_sampling_params_name_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_unknown_sampling_keyword_raises_value_error_naming_it():
    with pytest.raises(ValueError, match="temprature"):
        SamplingParams(temprature=0.5)
