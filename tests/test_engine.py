"""Engine behaviour: bad input is rejected without harming other requests; stops; the LLM API."""

from __future__ import annotations

import resource

import pytest
import torch

from pagellm import LLM, LLMEngine, SamplingParams
from pagellm.config import EngineArgs

from conftest import run_to_completion

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def engine(tiny_llama):
    return LLMEngine.from_engine_args(EngineArgs(model=tiny_llama, kv_cache_memory="16MiB", max_model_len=256))


@pytest.fixture(scope="module")
def llm(tiny_llama):
    return LLM(tiny_llama, kv_cache_memory="16MiB")


def test_bad_requests_raise_and_engine_keeps_serving(engine):
    engine.add_request("good", {"prompt_token_ids": [5, 6, 7]}, GREEDY)
    cases = [
        ({"prompt_token_ids": []}, "empty"),
        ("", "empty"),
        ({"prompt_token_ids": [1] * 300}, "max_model_len"),
        ({"prompt_token_ids": [5, 10**7]}, "vocabulary"),
        ({"prompt_token_ids": [5, -1]}, "vocabulary"),
        ({"foo": 1}, "prompt"),
    ]
    for prompt, msg in cases:
        with pytest.raises(ValueError, match=msg):
            engine.add_request(f"bad-{msg}", prompt, GREEDY)
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("good", [1, 2], GREEDY)
    done = run_to_completion(engine)
    assert list(done) == ["good"] and len(done["good"].outputs[0].token_ids) == 12


def test_prompt_that_can_never_fit_in_the_cache(tiny_llama):
    eng = LLMEngine.from_engine_args(EngineArgs(model=tiny_llama, num_gpu_blocks_override=4, block_size=4,
                                                num_cpu_blocks_override=4))
    assert eng.max_model_len == 16  # capped to the cache's 16 token slots
    with pytest.raises(ValueError):
        eng.add_request("big", {"prompt_token_ids": [3] * 40}, GREEDY)
    eng.add_request("ok", {"prompt_token_ids": [3] * 10}, SamplingParams(temperature=0, max_tokens=100))
    out = run_to_completion(eng)["ok"].outputs[0]
    assert len(out.token_ids) == 6 and out.finish_reason == "length"


def test_unknown_engine_argument_is_rejected(tiny_llama):
    with pytest.raises(TypeError, match="max_num_seq"):
        LLM(tiny_llama, max_num_seq=4)
    with pytest.raises(ValueError, match="block_size"):
        LLM(tiny_llama, block_size=0)
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        LLM(tiny_llama, kv_cache_dtype="fp8")


def test_abort_frees_everything(engine):
    engine.add_request("a", {"prompt_token_ids": list(range(3, 60))}, GREEDY)
    engine.add_request("b", {"prompt_token_ids": [9, 9, 9]}, GREEDY)
    engine.step()
    engine.abort_request("a")
    engine.scheduler.check_invariants()
    done = run_to_completion(engine)
    assert list(done) == ["b"]


def _greedy_text(llm, prompt, **kw):
    return llm.generate(prompt, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, **kw),
                        use_tqdm=False)[0].outputs[0]


def test_stop_strings(llm):
    prompt = "The quick brown fox"
    full = _greedy_text(llm, prompt)
    stop = full.text[len(full.text) // 2: len(full.text) // 2 + 3]
    assert stop.strip() and stop in full.text
    cut = _greedy_text(llm, prompt, stop=[stop, "never-appears-xyz"])
    assert cut.text == full.text[: full.text.index(stop)]
    assert cut.finish_reason == "stop" and cut.stop_reason == stop
    assert len(cut.token_ids) < len(full.token_ids)
    kept = _greedy_text(llm, prompt, stop=stop, include_stop_str_in_output=True)
    assert kept.text == full.text[: full.text.index(stop) + len(stop)]
    # A stop string completed by the very last allowed token still ends with "stop", text cut.
    tail = full.text[-2:]
    assert tail.strip() and full.text.index(tail) == len(full.text) - 2
    last = _greedy_text(llm, prompt, stop=[tail])
    assert (last.text, last.finish_reason, last.stop_reason) == (full.text[:-2], "stop", tail)


def test_stop_token_ids_and_min_tokens(llm):
    prompt = "Hello there"
    full = _greedy_text(llm, prompt)
    target = full.token_ids[3]
    first = full.token_ids.index(target)
    out = _greedy_text(llm, prompt, stop_token_ids=[target])
    assert out.token_ids == full.token_ids[: first + 1] and out.stop_reason == target and out.finish_reason == "stop"
    out = _greedy_text(llm, prompt, stop_token_ids=[target], min_tokens=first + 2)
    assert target not in out.token_ids[: first + 2]


def test_generate_keeps_input_order_and_accepts_all_prompt_forms(llm):
    tok = llm.get_tokenizer()
    prompts = ["a much longer prompt " * 8, {"prompt_token_ids": tok.encode("short")}, {"prompt": "mid size"}]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (3, 9, 5)]
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [3, 9, 5]
    assert outs[1].prompt_token_ids == tok.encode("short") and outs[2].prompt == "mid size"
    assert all(o.finished and o.outputs[0].finish_reason == "length" for o in outs)
    assert outs[0].metrics.first_token_time >= outs[0].metrics.arrival_time
    with pytest.raises(ValueError, match="sampling_params"):
        llm.generate(["a", "b"], params, use_tqdm=False)


def test_text_equals_full_decode(llm):
    out = _greedy_text(llm, "Numbers: 1 2 3")
    assert out.text == llm.get_tokenizer().decode(out.token_ids, skip_special_tokens=True)


def test_chat_applies_the_template(llm):
    tok = llm.get_tokenizer()
    conv = [{"role": "user", "content": "Say hi"}]
    out = llm.chat(conv, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)[0]
    expected = tok.apply_chat_template(conv, tokenize=False, add_generation_prompt=True)
    assert out.prompt == expected
    assert out.prompt_token_ids == tok.encode(expected, add_special_tokens=False)
    two = llm.chat([conv, conv], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in two] == [out.outputs[0].token_ids] * 2


def test_cli_generate(tiny_llama, capsys):
    from pagellm.entrypoints.cli import main

    rc = main(["generate", "Hello", "--model", tiny_llama, "--max-tokens", "5", "--ignore-eos", "--quiet",
               "--kv-cache-memory", "16MiB"])
    out = capsys.readouterr().out
    assert rc == 0 and "5 tokens, finish_reason=length" in out
    assert main(["generate", "Hello", "--model", tiny_llama, "--temperature", "-1", "--quiet"]) == 2
    assert "temperature" in capsys.readouterr().err
    # An engine argument the error names is the flag the command line takes, not the Python keyword.
    assert main(["generate", "Hello", "--model", tiny_llama, "--max-model-len", "99999", "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "--max-model-len 99999 exceeds" in err and "max_model_len=" not in err


def test_priority_without_priority_policy_is_rejected(engine):
    with pytest.raises(ValueError, match="priority"):
        engine.add_request("p", [5, 6], GREEDY, priority=1)
    assert not engine.has_unfinished_requests()


def test_bfloat16_engine_runs(tiny_llama):
    llm = LLM(tiny_llama, dtype="bfloat16", kv_cache_memory="16MiB")
    assert llm.llm_engine.model_info.dtype == "bfloat16"
    outs = llm.generate([{"prompt_token_ids": [5] * n} for n in (3, 40, 17)],
                        SamplingParams(temperature=0, max_tokens=9, ignore_eos=True), use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [9, 9, 9]
    assert llm.llm_engine.kv_cache_manager.num_free_blocks == llm.llm_engine.kv_cache_manager.num_blocks


def test_unchunked_prefill_runs_long_prompts_whole(tiny_llama):
    # The default long_prefill_token_threshold (512) must not apply when prompts cannot be chunked.
    eng = LLMEngine.from_engine_args(EngineArgs(model=tiny_llama, kv_cache_memory="16MiB", enable_chunked_prefill=False,
                                                max_num_batched_tokens=1024))
    assert eng.max_model_len == 1024
    eng.add_request("long", {"prompt_token_ids": [7] * 700}, GREEDY)
    eng.add_request("short", {"prompt_token_ids": [7] * 5}, GREEDY)
    with pytest.raises(ValueError, match="max_model_len"):
        eng.add_request("too-long", {"prompt_token_ids": [7] * 1100}, GREEDY)
    done = run_to_completion(eng)
    assert sorted(done) == ["long", "short"]


def test_worker_state_of_finished_sequences_is_dropped(engine):
    runner = engine.executor.worker.model_runner
    params = SamplingParams(temperature=1.0, seed=3, max_tokens=50, ignore_eos=True)
    engine.add_request("s1", [5, 6, 7], params)
    engine.add_request("s2", [5, 6, 8], params.clone(max_tokens=2))
    engine.step()
    engine.step()
    assert len(runner.generators) == 2 and runner.input_batch.num_rows == 2  # (rows: the decodes')
    engine.abort_request("s1")
    run_to_completion(engine)
    engine.step()  # idle: nothing to run, but the finished ids still reach the worker
    assert runner.generators == {} and runner.input_batch.num_rows == 0 and not runner.input_batch._sampling


def test_decode_steps_from_the_persistent_batch_equal_the_general_layout(tiny_llama, monkeypatch):
    """The steady-decode path (``_prepare_decodes``) lays a step out as ``prepare_inputs``' general
    path does: the same tokens and logprobs, bit for bit, under preemption, finishes and arrivals."""
    from pagellm.worker.model_runner import ModelRunner

    prompts = [[5 + i, 6, 7 + 2 * i] * (1 + i % 3) for i in range(6)]
    params = [SamplingParams(temperature=0, max_tokens=24 + 5 * i, ignore_eos=True, logprobs=1) for i in range(6)]

    real = ModelRunner._plain_decodes

    def run(plain_decodes: bool) -> tuple[list, int]:
        taken = []
        monkeypatch.setattr(ModelRunner, "_plain_decodes",
                            lambda self, seqs: (taken.append(x := plain_decodes and real(self, seqs)), x)[1])
        eng = LLMEngine.from_engine_args(EngineArgs(model=tiny_llama, dtype="float32", kv_cache_memory="64KiB",
                                                    max_num_seqs=4, block_size=16))
        try:
            for i, (p, sp) in enumerate(zip(prompts, params, strict=True)):
                eng.add_request(str(i), p, sp)
            done = run_to_completion(eng)
            assert eng.scheduler.num_preemptions > 0  # (the cache was tight: rows were rewritten)
        finally:
            eng.shutdown()
        outs = [(c.token_ids, c.cumulative_logprob, [list(d.items()) for d in c.logprobs or []])
                for c in (done[str(i)].outputs[0] for i in range(6))]
        return outs, sum(taken)

    general, n_general = run(False)
    persistent, n_persistent = run(True)
    assert n_general == 0 and n_persistent > 20
    assert persistent == general


def test_priority_policy_serves_lower_values_first(tiny_llama):
    eng = LLMEngine.from_engine_args(EngineArgs(model=tiny_llama, kv_cache_memory="16MiB", swap_space=0.01,
                                                scheduling_policy="priority", max_num_seqs=1))
    order = []
    for rid, prio in (("late", 2), ("first", 0), ("second", 1)):
        eng.add_request(rid, {"prompt_token_ids": [5, 6, 7]}, GREEDY, priority=prio)
    while eng.has_unfinished_requests():
        order += [o.request_id for o in eng.step() if o.finished]
        eng.scheduler.check_invariants()
    assert order == ["first", "second", "late"]
    stats = eng.get_stats()
    assert {"num_swapped", "num_swap_outs", "num_swap_ins", "cpu_cache_usage"} <= set(stats)


def test_swap_preemption_is_reported_per_request(tiny_llama):
    # Two requests that cannot both fit: the newer is swapped out, then back in.
    eng = LLMEngine.from_engine_args(EngineArgs(model=tiny_llama, num_gpu_blocks_override=6, block_size=4,
                                                num_cpu_blocks_override=8, preemption_mode="swap",
                                                enable_prefix_caching=False))
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    eng.add_request("a", {"prompt_token_ids": [5] * 10}, params)
    eng.add_request("b", {"prompt_token_ids": [6] * 10}, params)
    done = run_to_completion(eng)
    assert done["b"].metrics.num_swaps == 1 and done["a"].metrics.num_swaps == 0
    assert eng.get_stats()["num_swap_outs"] == 1 and eng.get_stats()["num_swap_ins"] == 1
    assert all(len(o.outputs[0].token_ids) == 10 for o in done.values())


def test_no_swap_space_preempts_by_recompute(tiny_llama):
    # swap_space=0: no CPU blocks at all (an empty swap tensor), so even preemption_mode="swap"
    # has to recompute; the same two requests as above still both finish.
    eng = LLMEngine.from_engine_args(EngineArgs(model=tiny_llama, num_gpu_blocks_override=6, block_size=4,
                                                swap_space=0, preemption_mode="swap", enable_prefix_caching=False))
    assert eng.num_cpu_blocks == 0
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    eng.add_request("a", {"prompt_token_ids": [5] * 10}, params)
    eng.add_request("b", {"prompt_token_ids": [6] * 10}, params)
    done = run_to_completion(eng)
    assert eng.get_stats()["num_swap_outs"] == 0
    assert sum(o.metrics.num_preemptions for o in done.values()) >= 1
    assert all(len(o.outputs[0].token_ids) == 10 for o in done.values())


def test_start_up_heap_is_frozen_until_shutdown(tiny_llama):
    import gc

    gc.unfreeze()
    engine = LLMEngine.from_engine_args(EngineArgs(model=tiny_llama, kv_cache_memory="16MiB"))
    try:
        # The engine's own long-lived objects are out of the collector's walk while it serves...
        assert gc.get_freeze_count() > 0 and gc.isenabled()
    finally:
        engine.shutdown()
    # ... and collectable again once it is shut down (an in-process engine must not leak).
    assert gc.get_freeze_count() == 0


def test_a_step_hook_sees_every_point_of_every_step_in_order(tiny_llama):
    """The one seam for features (engine/step_hooks.py): a hook registered with the engine is called
    at each point of each step in order, with the scheduler's requests; what it attaches in
    ``decorate_step`` reaches the worker (a mark on each row, checked in the runner); it hears of
    the request's end once."""
    from pagellm.engine.step_hooks import StepHook

    eng = LLMEngine.from_engine_args(EngineArgs(model=tiny_llama, kv_cache_memory="16MiB", max_model_len=256))
    calls: list[str] = []

    class Recorder(StepHook):
        def before_schedule(self):
            calls.append("before_schedule")
            return []

        def decorate_step(self, so, requests):
            assert all(s.request_id in requests for s in so.scheduled)
            calls.append(f"decorate:{','.join(s.request_id for s in so.scheduled)}")
            for s in so.scheduled:
                s.lora_slot = -7  # a mark the worker's batch carries

        def after_model(self, so, out, model_seconds):
            assert model_seconds > 0 and out.sampled  # (the workers' output, not yet applied)
            calls.append("after_model")
            return []

        def after_update(self, updated):
            calls.append(f"after_update:{','.join(g.request_id for g in updated)}")

        def after_outputs(self, out):
            calls.append("after_outputs")

        def request_finished(self, group):
            calls.append(f"finished:{group.request_id}")

    runner = eng.executor.worker.model_runner
    marks: list[int] = []
    real = runner.prepare_inputs

    def spy(so):
        marks.extend(s.lora_slot for s in so.scheduled)
        return real(so)

    runner.prepare_inputs = spy
    eng.hooks.append(Recorder())
    try:
        eng.add_request("a", [5, 6, 7], SamplingParams(max_tokens=3, ignore_eos=True))
        run_to_completion(eng)
    finally:
        del runner.prepare_inputs  # (the spy closes over the runner: no cycle left behind)
        eng.shutdown()
    step = ["before_schedule", "decorate:a", "after_model", "after_update:a"]
    assert calls == step + ["after_outputs"] + step + ["after_outputs"] + step + ["finished:a", "after_outputs"]
    assert marks == [-7, -7, -7]


@pytest.mark.parametrize("kw", [{}, {"speculative_config": {"method": "ngram"}}, {"enable_lora": True},
                                {"kv_transfer_config": {"kv_connector": "DiskConnector"}}],
                         ids=["plain", "spec", "lora", "kv_transfer"])
def test_a_dropped_engine_is_freed(tiny_llama, tmp_path, kw):
    """No reference cycle through the engine: its start-up objects are frozen out of the cyclic
    collector (gc.freeze), so a cycle would keep its weights and KV cache alive for good (a
    leak that ran the whole suite out of memory once)."""
    import gc
    import weakref

    if "kv_transfer_config" in kw:
        kw = {"kv_transfer_config": {"kv_connector": "DiskConnector",
                                     "kv_connector_extra_config": {"path": str(tmp_path)}}}
    eng = LLMEngine.from_engine_args(EngineArgs(model=tiny_llama, kv_cache_memory="16MiB", **kw))
    eng.add_request("a", [5, 6, 7, 5, 6, 7], SamplingParams(max_tokens=4, ignore_eos=True))
    run_to_completion(eng)
    ref = weakref.ref(eng)
    del eng
    gc.collect()
    assert ref() is None, [type(r).__name__ for r in gc.get_referrers(ref())]


def _faults_writing(t: torch.Tensor) -> int:
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    t.view(torch.uint8).fill_(0)
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before


def test_default_kv_budget_is_no_larger_than_the_sequences_can_fill(tiny_llama):
    """The default 2 GiB budget shrinks to what max_num_seqs sequences of max_model_len tokens fill
    (plus one block), and its pages fault in as blocks are written; a budget the user names is
    kept, and faulted in at start-up (reserved)."""
    with LLM(tiny_llama, max_model_len=64, max_num_seqs=3) as llm:
        assert llm.llm_engine.num_blocks == 3 * 64 // 16 + 1
        out = llm.generate([{"prompt_token_ids": [5] * 40}] * 3, SamplingParams(temperature=0, max_tokens=20,
                                                                                 ignore_eos=True), use_tqdm=False)
        assert [len(o.outputs[0].token_ids) for o in out] == [20] * 3
    with LLM(tiny_llama, max_model_len=64, max_num_seqs=3, kv_cache_memory="1MiB") as llm:
        kv = llm.llm_engine.executor.worker.cache_engine.kv
        assert llm.llm_engine.num_blocks == 2**20 // (kv.nbytes // llm.llm_engine.num_blocks) > 13
    with LLM(tiny_llama, max_model_len=1024, max_num_seqs=256) as llm:  # the default budget: untouched
        kv = llm.llm_engine.executor.worker.cache_engine.kv
        assert kv.nbytes >= 16 * 2**20 and _faults_writing(kv) >= kv.nbytes // 2**21 // 2
    with LLM(tiny_llama, max_model_len=1024, max_num_seqs=256, kv_cache_memory="32MiB") as llm:  # reserved
        kv = llm.llm_engine.executor.worker.cache_engine.kv
        assert kv.nbytes >= 16 * 2**20 and _faults_writing(kv) <= 2
