"""The step trace: its events reconstruct the engine's own counters, each step's counts match the
scheduler's state, waiting requests carry the reason they were left out, the HTML page renders in
a real browser, the server serves the live buffer, and the per-step log line."""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
from collections import Counter

import httpx
import pytest
from test_server import _Server

from pagellm import LLM, LLMEngine, SamplingParams
from pagellm.config import EngineArgs
from pagellm.core.step_decisions import LeftOut
from pagellm.engine.async_llm import AsyncLLM
from pagellm.entrypoints.trace_html import reduce_trace, render_html

from conftest import build_tiny_checkpoint, run_to_completion
from test_hf_parity import random_prompts

ARTIFACTS = os.path.join(os.path.dirname(__file__), "artifacts")


@pytest.fixture(scope="module")
def tiny(ckpt_root):
    return build_tiny_checkpoint(ckpt_root, "llama"), random_prompts(10, seed=7, hi=150)


def _engine(path, **kw) -> LLMEngine:
    kw.setdefault("kv_cache_memory", "64MiB")
    return LLMEngine.from_engine_args(EngineArgs(model=path, dtype="float32", trace=True, **kw))


def _submit(engine, prompts, max_tokens=24):
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(str(i), {"prompt_token_ids": p}, params)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_trace_events_reconstruct_the_engine_counters(tiny, mode):
    path, prompts = tiny
    shared = prompts[3][:40]
    prompts = prompts + [shared + [7, 8, 9], shared + [10, 11]]  # prefix hits
    engine = _engine(path, num_gpu_blocks_override=16, max_num_batched_tokens=64, preemption_mode=mode)
    _submit(engine, prompts)
    engine.abort_request("1")
    done = {}
    steps = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
        steps += 1
        # Every step's counts are the scheduler's own view, which check_invariants vouches for.
        engine.scheduler.check_invariants()
        last = [e for e in engine.tracer.events if e.get("cat") == "step"][-1]["args"]
        sched, kv = engine.scheduler, engine.kv_cache_manager
        assert (last["running"], last["waiting"], last["swapped"]) == (
            len(sched.running), len(sched.waiting), len(sched.swapped))
        assert last["free_blocks"] == kv.num_free_blocks
    trace = engine.get_trace()
    events = trace["traceEvents"]
    instants = Counter(e["name"] for e in events if e["ph"] == "i")
    preempts = [e["args"] for e in events if e["ph"] == "i" and e["name"] == "preempt"]
    s = engine.scheduler
    assert s.num_preemptions > 0 and instants["preempt"] == s.num_preemptions
    assert sum(p["mode"] == "swap" for p in preempts) == s.num_swap_outs
    assert instants["swap in"] == s.num_swap_ins
    assert (mode == "swap") == (s.num_swap_outs > 0)
    admits = [e["args"] for e in events if e["ph"] == "i" and e["name"] == "admit"]
    assert sum(a["prefix_hit_tokens"] for a in admits) == s.prefix_cache_stats.hits > 0
    finishes = [e["args"] for e in events if e["ph"] == "i" and e["name"] in ("finish", "abort")]
    assert len(finishes) == len(prompts) and sum(f["reason"] == "abort" for f in finishes) == 1
    assert sum(f["output_tokens"] for f in finishes if f["reason"] != "abort") == sum(
        len(o.outputs[0].token_ids) for rid, o in done.items() if rid != "1")
    step_events = [e for e in events if e.get("cat") == "step"]
    assert len(step_events) == engine.iteration_stats.steps == steps
    stats = engine.get_stats()
    computed = sum(e["args"]["prefill_tokens"] + e["args"]["decode_tokens"] for e in step_events)
    assert computed >= stats["prompt_tokens"] + stats["generation_tokens"] - len(done)
    # Every request's async track opens and closes: queued -> prefill -> decode -> end.
    opened = Counter((e["id"], e["name"]) for e in events if e["ph"] == "b")
    closed = Counter((e["id"], e["name"]) for e in events if e["ph"] == "e")
    assert opened == closed and {name for _, name in opened} == {"request", "queued", "prefill", "decode"}


def test_left_out_reasons(tiny):
    path, prompts = tiny
    cases = {LeftOut.MAX_NUM_SEQS: dict(max_num_seqs=1), LeftOut.TOKEN_BUDGET: dict(max_num_batched_tokens=16),
             LeftOut.NO_FREE_BLOCKS: dict(num_gpu_blocks_override=16, watermark=0.0),
             LeftOut.PRIORITY: dict(max_num_seqs=1, scheduling_policy="priority")}
    for reason, kw in cases.items():
        engine = _engine(path, **kw)
        _submit(engine, prompts[:5], 8)
        seen: Counter = Counter()
        while engine.has_unfinished_requests():
            engine.step()
            seen.update(engine.scheduler.last_decisions.left_out.values())
        assert seen[reason] > 0, (reason, seen)


def test_trace_off_records_nothing_and_the_log_line(tiny, caplog):
    path, prompts = tiny
    engine = LLMEngine.from_engine_args(EngineArgs(model=path, kv_cache_memory="64MiB", log_step_details=True))
    assert engine.tracer is None and engine.get_trace() is None
    with caplog.at_level(logging.INFO, logger="pagellm.engine.llm_engine"):
        _submit(engine, prompts[:3], 4)
        run_to_completion(engine)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("step ")]
    assert len(lines) == engine.iteration_stats.steps and "prefill" in lines[0] and "KV" in lines[0]
    quiet = LLMEngine.from_engine_args(EngineArgs(model=path, kv_cache_memory="64MiB"))
    _submit(quiet, prompts[:2], 2)
    run_to_completion(quiet)
    assert quiet.tracer is None and quiet.scheduler.last_decisions is None


def test_llm_writes_the_trace_file_and_bad_paths_are_errors(tiny, tmp_path):
    path, prompts = tiny
    out = tmp_path / "trace.json"
    with LLM(path, trace=str(out), kv_cache_memory="64MiB") as llm:
        llm.generate([{"prompt_token_ids": p} for p in prompts[:3]], SamplingParams(max_tokens=4), use_tqdm=False)
        assert json.loads(out.read_text())["traceEvents"] and llm.get_trace() is not None
    with pytest.raises(ValueError, match="trace_out"):
        EngineArgs(model=path, trace_out=str(tmp_path / "no" / "such" / "dir" / "t.json")).create_engine_config()


def test_the_page_renders_in_a_real_browser(tiny, tmp_path):
    """Debian's chromium (``make test`` installs it) runs the page's script; the DOM it leaves has
    one lane per request and one marker per preemption and swap-in; a screenshot is kept."""
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        pytest.skip("chromium is not installed (make test installs Debian's where it can)")
    path, prompts = tiny
    engine = _engine(path, num_gpu_blocks_override=16, max_num_batched_tokens=64, preemption_mode="swap")
    _submit(engine, prompts)
    run_to_completion(engine)
    trace = engine.get_trace()
    page = tmp_path / "trace.html"
    page.write_text(render_html(trace))
    assert "http://" not in page.read_text().replace("http://www.w3.org/2000/svg", "")  # nothing fetched
    flags = ["--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", "--window-size=1260,900"]
    dom = subprocess.run([chromium, *flags, "--dump-dom", page.as_uri()], capture_output=True, text=True,
                         timeout=120).stdout
    assert 'data-rendered="yes"' in dom
    reduced = reduce_trace(trace)
    assert dom.count('class="lane"') == len(prompts) == len(reduced["lanes"])
    n_markers = engine.scheduler.num_preemptions + engine.scheduler.num_swap_ins
    assert n_markers > 0 and dom.count('class="marker ') == n_markers
    for chart in ('id="queues"', 'id="kv"', 'id="batch"', 'id="markers"', 'id="lanes"'):
        assert chart in dom
    os.makedirs(ARTIFACTS, exist_ok=True)
    shot = os.path.join(ARTIFACTS, "step_trace.png")
    subprocess.run([chromium, *flags, f"--screenshot={shot}", page.as_uri()], capture_output=True, timeout=120)
    assert os.path.getsize(shot) > 10_000


def test_server_serves_the_live_trace_only_when_on(tiny):
    path, _ = tiny
    for on in (False, True):
        engine = AsyncLLM.from_engine_args(EngineArgs(model=path, kv_cache_memory="16MiB", trace=on))
        srv = _Server(engine, "key")
        try:
            assert httpx.get(srv.url + "/debug/trace").status_code == 401
            h = {"Authorization": "Bearer key"}
            httpx.post(srv.url + "/v1/completions", headers=h,
                       json={"model": "tiny", "prompt": "hello", "max_tokens": 3}).raise_for_status()
            r = httpx.get(srv.url + "/debug/trace", headers=h)
            if on:
                assert r.status_code == 200 and any(e.get("cat") == "step" for e in r.json()["traceEvents"])
            else:
                assert r.status_code == 404 and "--trace" in r.json()["error"]["message"]
        finally:
            srv.stop()
            engine.shutdown()
