"""Speculative decoding end to end: the rejection sampler's distribution, the proposers, and
engines whose greedy outputs must not change when drafts are verified (every proposer, several
k, under memory pressure, chunking, prefix hits, stops inside accepted runs)."""

from __future__ import annotations

import math
import random

import pytest
import torch
from test_scheduling_invariance import _kwargs

from pagellm import LLMEngine, SamplingParams
from pagellm.config import EngineArgs, SpeculativeConfig, resolve_model_source
from pagellm.sampling import rejection_sampler
from pagellm.sampling.rejection_sampler import DraftSpan, rejection_sample
from pagellm.sampling.sampler import SamplingRow
from pagellm.sequence import Sequence
from pagellm.spec_decode.proposers import NgramProposer, SuffixProposer

from conftest import build_tiny_checkpoint, require_bf16_kernel, run_to_completion
from test_hf_parity import engine_greedy, random_prompts

MAX_TOKENS = 24


# ---------------------------------------------------------------------- the rejection sampler
def _chi2_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson's test of ``counts`` against ``probs`` (cells with p > 0; none may fall outside)."""
    support = probs > 0
    assert counts[~support].sum() == 0, "a token outside the target's support was emitted"
    n = counts.sum()
    expected = probs[support].double() * n
    stat = ((counts[support].double() - expected) ** 2 / expected).sum()
    df = int(support.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), stat / 2))


def reference_probs(logits: list[float], params: SamplingParams, prompt: list[int], output: list[int]) -> list[float]:
    """The distribution a sampled token must follow, in float64, written from the documented rules
    (not the product's code): repetition penalty over the distinct prompt and output tokens
    (a positive logit divided by it, a negative one multiplied), frequency and presence penalties
    over the output's counts; then temperature; top-k (the k largest, ties at the k-th kept);
    top-p (a token is dropped when the mass of the likelier ones already reaches top_p); min-p
    (dropped when its probability is below min_p times the largest)."""
    x = [float(v) for v in logits]
    vocab = len(x)
    if params.repetition_penalty != 1.0:
        for t in set(prompt) | set(output):
            x[t] = x[t] / params.repetition_penalty if x[t] > 0 else x[t] * params.repetition_penalty
    for t in set(output):
        x[t] -= params.frequency_penalty * output.count(t) + params.presence_penalty
    x = [v / params.temperature for v in x]
    keep = set(range(vocab))
    if 0 < params.top_k < vocab:
        kth = sorted(x, reverse=True)[params.top_k - 1]
        keep = {t for t in keep if x[t] >= kth}

    def softmax(tokens: set[int]) -> dict[int, float]:
        top = max(x[t] for t in tokens)
        e = {t: math.exp(x[t] - top) for t in tokens}
        z = sum(e.values())
        return {t: v / z for t, v in e.items()}
    if params.top_p < 1.0:
        probs = softmax(keep)
        before = 0.0
        kept = set()
        for t in sorted(keep, key=lambda t: -probs[t]):
            if before < params.top_p:
                kept.add(t)
            before += probs[t]
        keep = kept
    if params.min_p > 0.0:
        probs = softmax(keep)
        best = max(probs.values())
        keep = {t for t in keep if probs[t] >= params.min_p * best}
    probs = softmax(keep)
    return [probs.get(t, 0.0) for t in range(vocab)]


VERIFIER_PARAMS = {
    "temperature+top_p": SamplingParams(temperature=0.8, top_p=0.9),
    "top_k+min_p": SamplingParams(temperature=1.3, top_k=5, min_p=0.05),
    "penalties": SamplingParams(temperature=0.7, repetition_penalty=1.3, presence_penalty=0.5,
                                frequency_penalty=0.4),
}
PROMPT = [1, 3, 3]


def _run_verifier(trials: int, draft_model: bool, params: SamplingParams, seed: int = 0):
    """``trials`` verifications of one drafted token over fixed logits; returns the first emitted
    token's counts, the second's given the draft was accepted, and the reference distributions
    of the first position and (one-hot drafts) of the second."""
    torch.manual_seed(seed)
    vocab = 8
    logits = torch.randn(2, vocab) * 1.5
    p0 = reference_probs(logits[0].tolist(), params, PROMPT, [])
    q = torch.softmax(torch.randn(vocab), -1) if draft_model else None
    gen = torch.Generator().manual_seed(seed)
    first = torch.zeros(vocab, dtype=torch.long)
    second = torch.zeros(vocab, dtype=torch.long)
    fixed_draft = sorted(range(vocab), key=lambda t: -p0[t])[1]  # a likely but not the likeliest token
    second_ref: dict[int, list[float]] = {}
    for _ in range(trials):
        d = int(torch.multinomial(q, 1, generator=gen)) if q is not None else fixed_draft
        rows = [SamplingRow(params, PROMPT, [], gen), SamplingRow(params, PROMPT, [d], gen)]
        (out,) = rejection_sample(logits.clone(), rows, [DraftSpan(0, [d], None if q is None else q[None])])
        first[out.token_ids[0]] += 1
        if len(out.token_ids) == 2:
            assert out.token_ids[0] == d
            second[out.token_ids[1]] += 1
            second_ref[d] = reference_probs(logits[1].tolist(), params, PROMPT, [d])
    # The second position's target depends on the accepted draft (penalties see it): with one-hot
    # drafts there is one; a draft model's second tokens mix several, and are not compared.
    p1 = torch.tensor(second_ref[fixed_draft], dtype=torch.float64) if not draft_model else None
    return first, second, torch.tensor(p0, dtype=torch.float64), p1


@pytest.mark.parametrize("name", VERIFIER_PARAMS)
@pytest.mark.parametrize("draft_model", [False, True], ids=["one-hot drafts", "draft-model q"])
def test_rejection_sampler_keeps_the_target_distribution(draft_model, name):
    params = VERIFIER_PARAMS[name]
    first, second, p0, p1 = _run_verifier(6000, draft_model, params)
    assert _chi2_pvalue(first, p0) > 1e-3
    if p1 is not None:  # the bonus token, after an acceptance
        assert second.sum() > 500 and _chi2_pvalue(second, p1) > 1e-3


def test_reference_distribution_is_not_a_plain_softmax():
    """Each parameter set changes the distribution (so the chi-square tests above test the rules)."""
    logits = (torch.randn(8, generator=torch.Generator().manual_seed(0)) * 1.5).tolist()
    plain = torch.softmax(torch.tensor(logits, dtype=torch.float64), -1)
    for name, params in VERIFIER_PARAMS.items():
        ref = torch.tensor(reference_probs(logits, params, PROMPT, [3]), dtype=torch.float64)
        assert (ref - plain).abs().max() > 0.02, name


def test_chi_square_catches_a_verifier_that_skips_the_residual(monkeypatch):
    """The mutant resamples from p itself after a rejection: the draft's token is then over-represented."""
    monkeypatch.setattr(rejection_sampler, "residual", lambda p, d, q: p)
    first, _, p0, _ = _run_verifier(6000, False, VERIFIER_PARAMS["temperature+top_p"])
    assert _chi2_pvalue(first, p0) < 1e-6


def test_chi_square_catches_penalties_that_ignore_the_accepted_draft(monkeypatch):
    """The mutant verifies the bonus position as if the draft were not in the output yet: its
    penalties then miss the draft, and the second token's distribution is off."""
    real = rejection_sampler.process_logits

    def mutant(logits, rows, greedy_and_lse):
        rows = [SamplingRow(r.params, r.prompt_token_ids, [], r.generator) for r in rows]
        return real(logits, rows, greedy_and_lse)
    monkeypatch.setattr(rejection_sampler, "process_logits", mutant)
    _, second, _, p1 = _run_verifier(6000, False, VERIFIER_PARAMS["penalties"])
    assert p1 is not None and _chi2_pvalue(second, p1) < 1e-6


def test_greedy_verification_seeds_and_logprobs():
    torch.manual_seed(3)
    logits = torch.randn(4, 50)
    greedy = logits.argmax(-1).tolist()
    params = SamplingParams(temperature=0, logprobs=2)
    rows = [SamplingRow(params, [1], [], None) for _ in range(4)]
    # Drafts: right, right, wrong -> two accepted, then the target's token at the third position.
    drafts = [greedy[0], greedy[1], (greedy[2] + 1) % 50]
    (out,) = rejection_sample(logits, rows, [DraftSpan(0, drafts)])
    assert out.token_ids == greedy[:3]
    lp = torch.log_softmax(logits, -1)
    assert out.logprobs == pytest.approx([float(lp[i, t]) for i, t in enumerate(greedy[:3])], abs=1e-5)
    assert all(len(top) >= 2 for top in out.top_logprobs)
    (out,) = rejection_sample(logits, rows, [DraftSpan(0, greedy[:3])])
    assert out.token_ids == greedy  # all accepted: the bonus token from the last row
    hot = SamplingParams(temperature=1.0, seed=5)

    def seeded():
        g = torch.Generator().manual_seed(5)
        return rejection_sample(logits, [SamplingRow(hot, [1], [], g) for _ in range(4)],
                                [DraftSpan(0, drafts)])[0].token_ids
    assert seeded() == seeded()


# ---------------------------------------------------------------------- proposers
def test_ngram_proposes_the_continuation_of_the_latest_match():
    prop = NgramProposer(SpeculativeConfig(method="ngram", prompt_lookup_min=2, prompt_lookup_max=3))
    seq = Sequence(0, [1, 2, 3, 4, 5, 9, 2, 3, 6, 7, 8], [1, 2, 3])
    # "2 3" occurs at 1-2 and 6-7; "1 2 3" at 0-2: the longest match wins, then the latest.
    assert prop.propose(seq, 3) == [4, 5, 9]
    seq.output_token_ids += [4, 5]  # grows: the index catches up incrementally
    assert prop.propose(seq, 2) == [9, 2]
    assert prop.propose(Sequence(1, [1, 2, 3], [7]), 3) == []
    # 8k tokens of context: each token is indexed once, so a step's lookup does not rescan it.
    long = Sequence(2, [random.Random(0).randrange(100) for _ in range(8192)], [])
    prop.propose(long, 5)
    index = prop._index[2]
    assert index.indexed == 8191
    long.output_token_ids.append(3)
    prop.propose(long, 5)
    assert index.indexed == 8192


def test_suffix_proposer_learns_from_finished_outputs():
    cfg = SpeculativeConfig(method="suffix", suffix_min_probability=0.3, suffix_cache_requests=2)
    prop = SuffixProposer(cfg)
    done = Sequence(0, [50, 51], [10, 11, 12, 13, 14])
    prop.request_finished([done])
    fresh = Sequence(1, [99, 50, 51], [10, 11])  # the same opening as the finished output
    assert prop.propose(fresh, 3) == [12, 13, 14]
    own = Sequence(2, [7, 8, 9, 1, 7, 8], [])  # the request's own history: "7 8" was followed by 9
    assert prop.propose(own, 2) == [9, 1]
    for i in range(3):  # past suffix_cache_requests, the oldest output's counts are removed
        prop.request_finished([Sequence(10 + i, [60 + i], [70 + i, 71 + i])])
    assert prop.propose(Sequence(3, [99, 50, 51], [10, 11]), 3) == []
    assert prop.global_counts.maps[1].get(hash((11,))) is None


# ---------------------------------------------------------------------- engines
@pytest.fixture(scope="module")
def tiny(ckpt_root):
    path = build_tiny_checkpoint(ckpt_root, "llama")
    # Prompts that repeat themselves, so that prompt lookup finds matches.
    rng = random.Random(5)
    prompts = []
    for n in (3, 20, 45, 90, 130, 7):
        head = [rng.randrange(3, 49152) for _ in range(n)]
        prompts.append(head + head[: n // 2])
    return path, prompts, engine_greedy(path, prompts, MAX_TOKENS)[0]


def _spec(method: str, k: int, **extra) -> dict:
    return {"method": method, "num_speculative_tokens": k, "cost_model": False, "prompt_lookup_min": 1, **extra}


@pytest.mark.parametrize("method", ["ngram", "suffix"])
@pytest.mark.parametrize("k", [1, 3, 5])
def test_greedy_outputs_are_identical_with_speculation(tiny, method, k):
    path, prompts, ref = tiny
    got, engine = engine_greedy(path, prompts, MAX_TOKENS, speculative_config=_spec(method, k))
    assert got == ref
    stats = engine.get_stats()
    # (A random model rarely repeats itself: its drafts are mostly refused. Accepted runs are
    # covered by the oracle proposer below and by SmolLM2 in the next test.)
    assert stats["spec_num_drafts"] > 0, "nothing was verified"
    assert len(stats["spec_accepted_per_pos"]) <= k


@pytest.mark.parametrize("arch", ["mistral", "gemma2"])
def test_speculation_on_windowed_models_changes_nothing(ckpt_root, arch):
    """Verification steps of several tokens per sequence through a sliding window of 24 (and Gemma
    2's soft-caps), the model drafting for itself (its own windowed layers in the draft's cache):
    every draft accepted, the same greedy tokens as without speculation."""
    path = build_tiny_checkpoint(ckpt_root, arch)
    prompts = random_prompts(4, seed=9, lo=20, hi=90)
    ref, _ = engine_greedy(path, prompts, MAX_TOKENS)
    got, engine = engine_greedy(path, prompts, MAX_TOKENS,
                                speculative_config={"method": "draft_model", "model": path,
                                                    "num_speculative_tokens": 3, "cost_model": False})
    assert got == ref
    stats = engine.get_stats()
    assert stats["spec_num_draft_tokens"] > 20 and stats["spec_num_accepted_tokens"] == stats["spec_num_draft_tokens"]


COPY_PROMPT = ("Repeat this list exactly:\n1. apples, 2. pears, 3. plums, 4. cherries, 5. grapes, 6. lemons, "
               "7. limes, 8. figs, 9. dates, 10. kiwis\nThe list again:\n1.")


@pytest.mark.slow
@pytest.mark.parametrize("method", ["ngram", "suffix", "draft_model"])
def test_smollm2_greedy_is_identical_with_speculation(method):
    """The bundled model in its default numerics, on the parity prompts and a copying prompt:
    the same tokens with k = 1, 3, 5, and drafts really accepted."""
    from test_hf_parity import SMOL_PROMPTS

    def greedy(**kw):
        engine = LLMEngine.from_engine_args(EngineArgs(model=None, kv_cache_memory="256MiB", **kw))
        tok = engine.get_tokenizer()
        params = SamplingParams(temperature=0, max_tokens=32)
        for i, p in enumerate([*SMOL_PROMPTS, COPY_PROMPT]):
            engine.add_request(str(i), {"prompt_token_ids": tok.encode(p)}, params)
        done = run_to_completion(engine)
        return [done[str(i)].outputs[0].token_ids for i in range(len(SMOL_PROMPTS) + 1)], engine

    ref, _ = greedy()
    extra = {"model": resolve_model_source(None).path} if method == "draft_model" else {}  # SmolLM2 for itself
    for k in (1, 3, 5):
        got, engine = greedy(speculative_config=_spec(method, k, **extra))
        assert got == ref, k
        assert engine.get_stats()["spec_num_accepted_tokens"] > 0


class OracleProposer:
    """Proposes the reference continuation with one token in three corrupted: long accepted runs,
    and rejections at every position."""

    def __init__(self, prompts, refs):
        self.ref = {tuple(p): r for p, r in zip(prompts, refs, strict=True)}
        self.rng = random.Random(0)

    def propose(self, seq, k):
        ref = self.ref[tuple(seq.prompt_token_ids)]
        n = seq.num_output_tokens
        return [t if self.rng.random() < 0.7 else t + 1 for t in ref[n:n + k]]

    def request_finished(self, seqs):
        pass


def oracle_run(engine, prompts, ref):
    """Greedy outputs of ``prompts`` with the oracle proposer drafting."""
    engine._spec.proposer = OracleProposer(prompts, ref)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(str(i), {"prompt_token_ids": p}, params)
    done = run_to_completion(engine)
    return [done[str(i)].outputs[0].token_ids for i in range(len(prompts))]


@pytest.mark.parametrize("config", ["tight_cache", "tight_swap", "tight_cache_and_chunks", "block_size_1",
                                    "chunk_every_prompt"])
def test_speculation_under_pressure_changes_nothing(tiny, config):
    path, prompts, ref = tiny
    kwargs = _kwargs(config, prompts)
    engine = LLMEngine.from_engine_args(EngineArgs(model=path, dtype="float32", kv_cache_memory="64MiB",
                                                   speculative_config=_spec("ngram", 4), **kwargs))
    assert oracle_run(engine, prompts, ref) == ref
    stats = engine.get_stats()
    assert 0 < stats["spec_num_accepted_tokens"] < stats["spec_num_draft_tokens"]
    if config.startswith("tight"):
        assert engine.scheduler.num_preemptions > 0
    kv = engine.kv_cache_manager
    assert kv.num_free_blocks == kv.num_blocks and kv.cpu_pool.num_free_blocks == kv.cpu_pool.num_usable_blocks


def test_prefix_hits_stop_strings_and_max_tokens_inside_accepted_runs(tiny, monkeypatch):
    """Requests sharing a prefix (hits), stop strings and max_tokens that fall inside a run of
    accepted drafts: token ids, text, finish and stop reasons as without speculation."""
    path, prompts, _ = tiny
    cuts = []  # (tokens kept, tokens the run had appended): the stop string did fall inside a run
    truncate = Sequence.truncate_output
    monkeypatch.setattr(Sequence, "truncate_output",
                        lambda seq, keep: (cuts.append((keep, seq.num_output_tokens)), truncate(seq, keep))[1])
    shared = prompts[4]
    group = [shared + [5, 6, 7], shared + [8, 9], shared]
    base = LLMEngine.from_engine_args(EngineArgs(model=path, dtype="float32", kv_cache_memory="64MiB"))
    tok = base.get_tokenizer()
    ref_ids = engine_greedy(path, group, 40)[0]
    # A stop string from the middle of the first request's text; the others end by max_tokens.
    text = tok.decode(ref_ids[0], True)
    stop = text[len(text) // 2: len(text) // 2 + 3]
    params = [SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop=[stop]),
              SamplingParams(temperature=0, max_tokens=13, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=17, ignore_eos=True, logprobs=1)]

    def run(engine):
        for i, (p, sp) in enumerate(zip(group, params, strict=True)):
            engine.add_request(str(i), {"prompt_token_ids": p}, sp)
        done = run_to_completion(engine)
        return [(c.token_ids, c.text, c.finish_reason, c.stop_reason, c.cumulative_logprob,
                 None if c.logprobs is None else [list(d) for d in c.logprobs])
                for c in (done[str(i)].outputs[0] for i in range(3))]

    want = run(base)
    spec = LLMEngine.from_engine_args(EngineArgs(model=path, dtype="float32", kv_cache_memory="64MiB",
                                                 speculative_config=_spec("ngram", 5)))
    spec._spec.proposer = OracleProposer(group, ref_ids)
    spec._spec.proposer.rng = random.Random(1)
    got = run(spec)
    assert [g[:4] for g in got] == [w[:4] for w in want]
    assert want[0][2] == "stop" and want[1][2] == "length"
    for g, w in zip(got, want, strict=True):
        assert g[4] == pytest.approx(w[4], abs=1e-4) and g[5] == w[5]
    assert spec.get_stats()["spec_num_accepted_tokens"] > 0
    assert spec.scheduler.prefix_cache_stats.hits > 0
    assert cuts and all(keep < n for keep, n in cuts) and len(got[0][0]) == cuts[0][0]


def test_sampling_parallel_samples_and_beams_with_speculation(tiny):
    path, prompts, _ = tiny
    engine = LLMEngine.from_engine_args(EngineArgs(model=path, dtype="float32", kv_cache_memory="64MiB",
                                                   speculative_config=_spec("suffix", 3)))
    engine.add_request("n", {"prompt_token_ids": prompts[3]},
                       SamplingParams(n=3, temperature=0.8, top_p=0.9, seed=1, max_tokens=20, ignore_eos=True,
                                      logprobs=0))
    done = run_to_completion(engine)
    outs = done["n"].outputs
    assert len(outs) == 3 and all(len(o.token_ids) == 20 == len(o.logprobs) for o in outs)
    kv = engine.kv_cache_manager
    assert kv.num_free_blocks == kv.num_blocks
    # Beams never draft: the same result as an engine without speculation.
    from pagellm.sampling_params import BeamSearchParams

    def beams(eng):
        eng.add_request("b", {"prompt_token_ids": prompts[2]}, BeamSearchParams(beam_width=3, max_tokens=8))
        return [o.token_ids for o in run_to_completion(eng)["b"].outputs]
    base = LLMEngine.from_engine_args(EngineArgs(model=path, dtype="float32", kv_cache_memory="64MiB"))
    assert beams(engine) == beams(base)


def test_speculation_across_processes(tiny):
    """Drafts reach out-of-process workers in the step diff and the accepted ones come back:
    tensor-parallel ranks in worker processes give the same tokens."""
    path, prompts, ref = tiny
    engine = LLMEngine.from_engine_args(EngineArgs(model=path, dtype="float32", kv_cache_memory="64MiB",
                                                   tensor_parallel_size=2, distributed_executor_backend="mp",
                                                   speculative_config=_spec("ngram", 3)))
    try:
        assert oracle_run(engine, prompts, ref) == ref
        assert engine.get_stats()["spec_num_accepted_tokens"] > 0
    finally:
        engine.shutdown()


@pytest.mark.parametrize("config", [None, "tight_cache", "tight_swap", "tight_cache_and_chunks", "block_size_1"])
def test_a_model_drafting_for_itself_is_always_right(tiny, config):
    """The draft model's cache follows the target's through chunking, recomputation, swap and
    prefix hits (the same block ids, the same block copies): the tiny model drafting for itself
    must then propose exactly the target's greedy tokens, every time, and change nothing."""
    path, prompts, ref = tiny
    kwargs = _kwargs(config, prompts) if config else {}
    got, engine = engine_greedy(path, prompts, MAX_TOKENS, **kwargs,
                                speculative_config={"method": "draft_model", "model": path,
                                                    "num_speculative_tokens": 3, "cost_model": False})
    assert got == ref
    stats = engine.get_stats()
    assert stats["spec_num_draft_tokens"] > 20 and stats["spec_num_accepted_tokens"] == stats["spec_num_draft_tokens"]
    if config and config.startswith("tight"):
        assert engine.scheduler.num_preemptions > 0
    assert engine.executor.worker.draft_cache is not None


def test_another_tiny_model_drafts_and_bad_draft_models_are_errors(tiny, ckpt_root):
    path, prompts, ref = tiny
    other = build_tiny_checkpoint(ckpt_root, "qwen3")
    got, engine = engine_greedy(path, prompts, MAX_TOKENS, speculative_config={
        "method": "draft_model", "model": other, "num_speculative_tokens": 4, "cost_model": False})
    assert got == ref and engine.get_stats()["spec_num_drafts"] > 0
    with pytest.raises(ValueError, match="model"):
        EngineArgs(model=path, speculative_config={"method": "draft_model"}).create_engine_config()
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        EngineArgs(model=path, tensor_parallel_size=2,
                   speculative_config={"method": "draft_model", "model": other}).create_engine_config()


def test_bfloat16_greedy_is_identical_with_speculation(tiny):
    """Verified positions run as decode rows: with batch-invariant GEMMs even the faster numerics
    give the same tokens as without speculation."""
    require_bf16_kernel()
    path, prompts, _ = tiny
    ref, _ = engine_greedy(path, prompts, MAX_TOKENS, dtype="bfloat16")
    got, engine = engine_greedy(path, prompts, MAX_TOKENS, dtype="bfloat16", speculative_config=_spec("ngram", 4))
    assert got == ref and engine.get_stats()["spec_num_drafts"] > 0


def test_bad_speculative_config_is_a_clear_error(tiny):
    path = tiny[0]
    for bad, field in (({"method": "medusa"}, "method"), ({"num_speculative_tokens": 0}, "num_speculative_tokens"),
                       ({"prompt_lookup_min": 4, "prompt_lookup_max": 2}, "prompt_lookup_min"),
                       ({"nope": 1}, "nope"), ("{not json", "JSON")):
        with pytest.raises(ValueError, match=field):
            EngineArgs(model=path, speculative_config=bad).create_engine_config()
