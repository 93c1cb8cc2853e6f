"""The OpenAI-compatible server, driven by the official ``openai`` client and raw HTTP: outputs,
streaming, usage, errors, auth, abort on disconnect, metrics, engine death."""

from __future__ import annotations

import json
import socket
import threading
import time

import httpx
import openai
import pytest
import uvicorn

from pagellm import LLM, SamplingParams
from pagellm.config import EngineArgs
from pagellm.engine.async_llm import AsyncLLM
from pagellm.entrypoints.openai_server import build_app

KEY = "sk-test"
NAME = "tiny"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Server:
    def __init__(self, engine: AsyncLLM, api_key: str | None, **kwargs) -> None:
        self.port = _free_port()
        config = uvicorn.Config(build_app(engine, NAME, api_key, **kwargs), host="127.0.0.1", port=self.port,
                                log_level="warning")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline, "server did not start"
            time.sleep(0.05)
        self.url = f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)


@pytest.fixture(scope="module", params=["thread", "core-process"])
def served(tiny_llama, request):
    """The server over the engine on a thread of this process (AsyncLLM) and over an engine core
    process (AsyncEngineClient, ``pagellm serve``'s default): every test below runs against both."""
    from pagellm.engine.core_client import AsyncEngineClient

    args = EngineArgs(model=tiny_llama, kv_cache_memory="16MiB", max_model_len=256, scheduling_policy="priority")
    engine = AsyncLLM.from_engine_args(args) if request.param == "thread" else AsyncEngineClient.start(args)
    srv = _Server(engine, KEY)  # type: ignore[arg-type]
    yield srv, engine
    srv.stop()
    engine.shutdown()


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=served[0].url + "/v1", api_key=KEY, max_retries=0, timeout=60)


def _idle(engine, timeout: float = 10.0) -> None:
    """No request left anywhere and every KV block free (read from the block pool in this process,
    or from the stats of a core process)."""
    deadline = time.monotonic() + timeout
    while True:
        s = engine.get_stats_now()
        if isinstance(engine, AsyncLLM):
            kv = engine.engine.kv_cache_manager
            free = kv.num_free_blocks == kv.num_blocks
        else:
            free = s["kv_cache_usage"] == 0
        if s["num_running"] + s["num_waiting"] + s["num_swapped"] == 0 and free:
            return
        assert time.monotonic() < deadline, f"requests or blocks left behind: {s}"
        time.sleep(0.05)


def test_models_health_version(served, client):
    srv, _ = served
    assert [m.id for m in client.models.list().data] == [NAME]
    assert httpx.get(srv.url + "/health").status_code == 200
    assert httpx.get(srv.url + "/version").json()["version"]


def test_completion_equals_offline_greedy(tiny_llama, client, served):
    prompt = "The quick brown fox"
    out = client.completions.create(model=NAME, prompt=prompt, max_tokens=12, temperature=0, extra_body={
        "ignore_eos": True})
    ref = LLM(tiny_llama, kv_cache_memory="16MiB").generate(prompt, SamplingParams(temperature=0, max_tokens=12,
                                                                                   ignore_eos=True), use_tqdm=False)
    assert out.choices[0].text == ref[0].outputs[0].text
    assert out.usage.completion_tokens == 12 and out.usage.prompt_tokens == len(ref[0].prompt_token_ids)
    assert out.choices[0].finish_reason == "length"
    _idle(served[1])


def test_chat_streaming_with_usage_only_in_the_last_chunk(client, served):
    kw = dict(model=NAME, messages=[{"role": "user", "content": "Hello!"}], max_tokens=10, temperature=0,
              extra_body={"ignore_eos": True})
    whole = client.chat.completions.create(**kw)
    chunks = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert all(c.usage is None for c in chunks[:-1]) and chunks[-1].usage.completion_tokens == 10
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    _idle(served[1])


def test_raw_sse_ends_with_done(served):
    srv, _ = served
    with httpx.stream("POST", srv.url + "/v1/completions", headers={"Authorization": f"Bearer {KEY}"},
                      json={"model": NAME, "prompt": "Hi", "max_tokens": 4, "stream": True}, timeout=60) as r:
        lines = [ln for ln in r.iter_lines() if ln]
    assert lines[-1] == "data: [DONE]" and all(ln.startswith("data: ") for ln in lines)
    assert json.loads(lines[0][6:])["object"] == "text_completion"


def test_n_and_logprobs(client):
    out = client.completions.create(model=NAME, prompt="a b c", max_tokens=5, n=2, temperature=1.0, seed=4,
                                    logprobs=2)
    assert sorted(c.index for c in out.choices) == [0, 1]
    assert all(len(c.logprobs.tokens) == len(c.logprobs.token_logprobs) for c in out.choices)
    chat = client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "x"}], max_tokens=3,
                                          logprobs=True, top_logprobs=2, temperature=0)
    assert len(chat.choices[0].logprobs.content[0].top_logprobs) == 2


def test_openai_style_errors(client, served):
    srv, _ = served
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=NAME, prompt="hello", max_tokens=10_000)
    assert "256" in e.value.message and "10000" in e.value.message
    with pytest.raises(openai.BadRequestError, match="temperature"):
        client.completions.create(model=NAME, prompt="hello", max_tokens=3, temperature=-1)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="no-such-model", prompt="hello", max_tokens=3)
    r = httpx.post(srv.url + "/v1/completions", json={"model": NAME, "prompt": "x"})
    assert r.status_code == 401 and r.json()["error"]["type"] == "AuthenticationError"
    r = httpx.post(srv.url + "/v1/completions", headers={"Authorization": f"Bearer {KEY}"}, json={"model": NAME})
    assert r.status_code == 400 and set(r.json()["error"]) == {"message", "type", "param", "code"}
    _idle(served[1])


# (the in-process engine only: its step is slowed here; tests/test_engine_core_proc.py covers the core process)
@pytest.mark.parametrize("served", ["thread"], indirect=True)
def test_client_disconnect_aborts_and_frees_blocks(served, monkeypatch):
    srv, engine = served
    assert isinstance(engine, AsyncLLM)
    step = engine.engine.step

    def slow_step():  # the tiny model would otherwise finish before the hang-up is seen
        time.sleep(0.02)
        return step()
    monkeypatch.setattr(engine.engine, "step", slow_step)
    body = {"model": NAME, "prompt": "Tell me a long story", "max_tokens": 200, "stream": True, "ignore_eos": True}
    before = engine.get_stats_now()["generation_tokens"]
    others: list[str] = []

    def other_stream() -> None:  # runs alongside, must finish normally
        with httpx.stream("POST", srv.url + "/v1/completions", headers={"Authorization": f"Bearer {KEY}"},
                          json={**body, "max_tokens": 20}, timeout=120) as r:
            others.extend(json.loads(ln[6:])["choices"][0]["finish_reason"] or "" for ln in r.iter_lines()
                          if ln.startswith("data: {"))
    t = threading.Thread(target=other_stream)
    t.start()
    with httpx.stream("POST", srv.url + "/v1/completions", headers={"Authorization": f"Bearer {KEY}"},
                      json=body, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                break  # one token arrived: hang up
    t.join(timeout=120)
    assert others and others[-1] == "length", "the other stream did not finish"
    _idle(engine, timeout=60)
    assert engine.get_stats_now()["generation_tokens"] - before < 200 + 20, "the request ran to the end: no abort"
    # Non-streaming too: the client gives up after a moment.
    before = engine.get_stats_now()["generation_tokens"]
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(srv.url + "/v1/completions", headers={"Authorization": f"Bearer {KEY}"},
                   json={**body, "stream": False, "max_tokens": 240}, timeout=0.3)
    _idle(engine, timeout=60)
    assert engine.get_stats_now()["generation_tokens"] - before < 240, "the request ran to the end: no abort"


def test_tokenize_detokenize_and_metrics(served, client):
    """Behind the API key like /v1 (only /health, /version and the OpenAPI document are public)."""
    srv, _ = served
    h = {"Authorization": f"Bearer {KEY}"}
    for method, path in (("POST", "/tokenize"), ("POST", "/detokenize"), ("GET", "/metrics")):
        r = httpx.request(method, srv.url + path, json={"prompt": "x", "tokens": [1]}, headers={"Authorization": "x"})
        assert r.status_code == 401, (path, r.text)
    assert httpx.get(srv.url + "/version").status_code == 200
    r = httpx.post(srv.url + "/tokenize", json={"prompt": "hello world", "add_special_tokens": False}, headers=h)
    ids = r.json()["tokens"]
    assert httpx.post(srv.url + "/detokenize", json={"tokens": ids}, headers=h).json()["prompt"] == "hello world"
    client.completions.create(model=NAME, prompt="metrics", max_tokens=3)
    text = httpx.get(srv.url + "/metrics", headers=h).text
    for name in ("pagellm:num_requests_running", "pagellm:kv_cache_usage_perc", "pagellm:prompt_tokens_total",
                 "pagellm:prefix_cache_hits_total", "pagellm:time_to_first_token_seconds_bucket",
                 "pagellm:e2e_request_latency_seconds_count", "pagellm:num_preemptions_total"):
        assert name in text, name


def test_speculative_decoding_streams_the_same_text_and_exports_metrics(tiny_llama):
    """Steps that emit several tokens at once stream the same text as the whole reply, which is
    the reply of an engine without speculation; the spec_decode counters are on /metrics."""
    texts = []
    for spec in (None, {"method": "suffix", "num_speculative_tokens": 4, "cost_model": False,
                        "prompt_lookup_min": 1}):
        engine = AsyncLLM.from_engine_args(EngineArgs(model=tiny_llama, kv_cache_memory="16MiB",
                                                      speculative_config=spec))
        srv = _Server(engine, None)
        try:
            c = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0, timeout=60)
            kw = dict(model=NAME, prompt="a b c a b c a b c a b", max_tokens=30, temperature=0)
            whole = c.completions.create(**kw).choices[0].text
            streamed = "".join(ch.choices[0].text for ch in c.completions.create(stream=True, **kw))
            assert streamed == whole
            texts.append(whole)
            metrics = httpx.get(srv.url + "/metrics").text
            if spec is not None:
                assert "pagellm:spec_decode_num_drafts_total" in metrics
                assert engine.engine.get_stats()["spec_num_drafts"] > 0
        finally:
            srv.stop()
            engine.shutdown()
    assert texts[0] == texts[1]


def test_dead_engine_reports_unhealthy_and_fails_requests(tiny_llama):
    engine = AsyncLLM.from_engine_args(EngineArgs(model=tiny_llama, kv_cache_memory="16MiB"))
    srv = _Server(engine, None)
    try:
        def boom():
            raise RuntimeError("worker exploded")
        engine.engine.step = boom  # type: ignore[method-assign]
        r = httpx.post(srv.url + "/v1/completions", json={"prompt": "x", "max_tokens": 3}, timeout=30)
        assert r.status_code in (500, 503)
        assert httpx.get(srv.url + "/health").status_code == 503
        r = httpx.post(srv.url + "/v1/completions", json={"prompt": "x", "max_tokens": 3}, timeout=30)
        assert r.status_code == 503
    finally:
        srv.stop()
        engine.shutdown()


def test_worker_killed_while_idle_makes_health_fail(tiny_llama):
    """A tensor-parallel worker dies between requests: /health notices at once (it asks the
    executor, not only the last step), requests get 503, shutdown leaves no worker behind."""
    import os
    import signal

    engine = AsyncLLM.from_engine_args(EngineArgs(model=tiny_llama, kv_cache_memory="16MiB", tensor_parallel_size=2))
    srv = _Server(engine, None)
    procs = engine.engine.executor.procs
    try:
        assert httpx.get(srv.url + "/health").status_code == 200
        os.kill(procs[1].pid, signal.SIGKILL)
        procs[1].wait(30)
        r = httpx.get(srv.url + "/health")
        assert r.status_code == 503 and "died" in r.json()["error"]["message"]
        r = httpx.post(srv.url + "/v1/completions", json={"prompt": "x", "max_tokens": 3}, timeout=30)
        assert r.status_code == 503
    finally:
        srv.stop()
        engine.shutdown()
    assert all(p.poll() is not None for p in procs)


def test_seed_reproducibility_and_stop_strings(client, served):
    kw = dict(model=NAME, prompt="Once upon a time", max_tokens=16, temperature=1.0, seed=123)
    a, b = client.completions.create(**kw), client.completions.create(**kw)
    assert a.choices[0].text == b.choices[0].text
    greedy = client.completions.create(model=NAME, prompt="Once upon a time", max_tokens=16, temperature=0,
                                       extra_body={"ignore_eos": True}).choices[0].text
    words = greedy.split()
    assert len(words) >= 3, greedy
    stop = words[2]
    out = client.completions.create(model=NAME, prompt="Once upon a time", max_tokens=16, temperature=0,
                                    stop=[stop], extra_body={"ignore_eos": True}).choices[0]
    assert out.finish_reason == "stop" and stop not in out.text and greedy.startswith(out.text)
    _idle(served[1])


BAD_REQUESTS = [
    ("missing prompt", {"model": NAME, "max_tokens": 3}, 400, "prompt"),
    ("wrong type", {"model": NAME, "prompt": "x", "max_tokens": "ten"}, 400, "max_tokens"),
    ("negative max_tokens", {"model": NAME, "prompt": "x", "max_tokens": -1}, 400, "max_tokens"),
    ("temperature -1", {"model": NAME, "prompt": "x", "max_tokens": 3, "temperature": -1}, 400, "temperature"),
    ("top_p 2", {"model": NAME, "prompt": "x", "max_tokens": 3, "top_p": 2}, 400, "top_p"),
    ("n 0", {"model": NAME, "prompt": "x", "max_tokens": 3, "n": 0}, 400, "n"),
    ("unknown model", {"model": "gpt-5", "prompt": "x", "max_tokens": 3}, 404, "gpt-5"),
    ("oversized prompt", {"model": NAME, "prompt": "hello " * 400, "max_tokens": 3}, 400, "context length"),
    ("token ids outside the vocabulary", {"model": NAME, "prompt": [5, 10**8], "max_tokens": 3}, 400, "vocabulary"),
    ("negative and huge token ids, nested", {"model": NAME, "prompt": [[-5, 10**12]], "max_tokens": 3}, 400,
     "vocabulary"),
    ("logprobs beyond the limit", {"model": NAME, "prompt": "x", "max_tokens": 3, "logprobs": 1_000_000}, 400,
     "logprobs"),
    ("too many stop strings", {"model": NAME, "prompt": "x", "max_tokens": 3, "stop": [str(i) for i in range(65)]},
     400, "stop"),
    ("n beyond the limit", {"model": NAME, "prompt": "x", "max_tokens": 3, "n": 100_000}, 400, "n"),
]


@pytest.mark.parametrize("name,body,status,needle", BAD_REQUESTS, ids=[b[0] for b in BAD_REQUESTS])
def test_bad_requests_get_clear_errors(served, name, body, status, needle):
    srv, engine = served
    r = httpx.post(srv.url + "/v1/completions", headers={"Authorization": f"Bearer {KEY}"}, json=body, timeout=30)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert needle in err["message"] and err["type"]
    assert 'File "' not in err["message"] and ".py" not in err["message"]  # no traceback, no server path
    ok = httpx.post(srv.url + "/v1/completions", headers={"Authorization": f"Bearer {KEY}"},
                    json={"model": NAME, "prompt": "still serving", "max_tokens": 2}, timeout=30)
    assert ok.status_code == 200
    _idle(engine)


def test_oversized_body_is_refused_unread(served):
    from pagellm.entrypoints.openai_server import MAX_BODY_BYTES

    srv, engine = served
    body = b'{"model": "tiny", "prompt": "' + b"a" * MAX_BODY_BYTES + b'"}'
    r = httpx.post(srv.url + "/v1/completions", content=body, headers={"Authorization": f"Bearer {KEY}",
                                                                       "Content-Type": "application/json"}, timeout=60)
    assert r.status_code == 413 and "exceeds the limit" in r.json()["error"]["message"]
    _idle(engine)


def test_invalid_json_and_wrong_key(served):
    srv, _ = served
    r = httpx.post(srv.url + "/v1/chat/completions", headers={"Authorization": f"Bearer {KEY}",
                                                              "Content-Type": "application/json"},
                   content=b"{not json", timeout=30)
    assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]
    r = httpx.post(srv.url + "/v1/chat/completions", headers={"Authorization": "Bearer wrong"},
                   json={"model": NAME, "messages": [{"role": "user", "content": "x"}]}, timeout=30)
    assert r.status_code == 401 and "API key" in r.json()["error"]["message"]


def test_concurrent_streams_with_random_disconnects(served):
    """32 streaming clients at once; every third hangs up after its first token. Survivors complete,
    nothing errors, the engine ends idle with every block free."""
    import asyncio
    import random

    srv, engine = served
    rng = random.Random(0)
    drop = set(rng.sample(range(32), 11))

    async def client(i: int, http: httpx.AsyncClient) -> tuple[int, str | None, int]:
        body = {"model": NAME, "prompt": f"request {i}:", "max_tokens": 24, "stream": True, "ignore_eos": True,
                "temperature": 0}
        finish, n = None, 0
        async with http.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                chunk = json.loads(line[6:])
                assert "error" not in chunk, chunk
                n += 1
                finish = chunk["choices"][0]["finish_reason"] or finish
                if i in drop:
                    return i, None, n
        return i, finish, n

    async def main():
        async with httpx.AsyncClient(base_url=srv.url, headers={"Authorization": f"Bearer {KEY}"},
                                     timeout=120) as http:
            return await asyncio.wait_for(asyncio.gather(*(client(i, http) for i in range(32))), 300)

    results = asyncio.run(main())
    survivors = [r for r in results if r[0] not in drop]
    assert len(survivors) == 21 and all(f == "length" for _, f, _ in survivors)
    _idle(engine, timeout=60)


def test_bench_serve_times_every_token_and_counts_failures(served, tmp_path):
    """``pagellm bench serve`` against a live server: every token of every request is seen (token
    counts are the server's usage), percentiles are ordered, and a refused request is a failure in
    the report, not a crash."""
    from pagellm.entrypoints import bench_serve
    from pagellm.entrypoints.cli import build_parser

    srv, engine = served
    workload = tmp_path / "w.json"
    reqs = [{"prompt_token_ids": list(range(100 + i, 130 + 3 * i)), "max_tokens": 3 + i} for i in range(4)]
    workload.write_text(json.dumps({"requests": reqs}))
    out = tmp_path / "r.json"
    common = ["bench", "serve", "--base-url", srv.url, "--quiet", "--json", str(out), "--save-requests"]
    args = build_parser().parse_args([*common, "--api-key", KEY, "--dataset-path", str(workload),
                                      "--request-rate", "40"])
    assert bench_serve.main(args) == 0
    s = json.loads(out.read_text())
    assert (s["completed"], s["failed"]) == (4, 0)
    assert s["total_input_tokens"] == sum(len(r["prompt_token_ids"]) for r in reqs)
    assert s["total_output_tokens"] == sum(r["max_tokens"] for r in reqs)
    for r, sent in zip(s["requests"], reqs, strict=True):
        assert r["output_tokens"] == sent["max_tokens"] and len(r["itl"]) == sent["max_tokens"] - 1
        assert 0 < r["ttft"] <= r["e2el"]
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2el_ms"):
        assert 0 < s[key]["p50"] <= s[key]["p90"] <= s[key]["p99"]
    _idle(engine)

    wrong_key = [*common, "--api-key", "wrong", "--num-prompts", "2", "--random-input-len", "8"]
    with pytest.raises(ValueError, match="pass --model"):  # /v1/models refused too
        bench_serve.main(build_parser().parse_args(wrong_key))
    assert bench_serve.main(build_parser().parse_args([*wrong_key, "--model", NAME])) == 1  # nothing completed
    s = json.loads(out.read_text())
    assert (s["completed"], s["failed"]) == (0, 2) and "HTTP 401" in s["errors"][0]
    with pytest.raises(ValueError, match="--num-prompts must be >= 1"):
        bench_serve.main(build_parser().parse_args([*common, "--num-prompts", "0"]))


def test_async_llm_builds_on_its_loop_thread_raises_build_errors_and_times_steps(tiny_llama):
    with pytest.raises(ValueError, match="block_size"):  # raised on the loop thread, re-raised here
        AsyncLLM.from_engine_args(EngineArgs(model=tiny_llama, block_size=0))
    engine = AsyncLLM.from_engine_args(EngineArgs(model=tiny_llama, kv_cache_memory="16MiB"))
    try:
        import asyncio

        async def one() -> int:
            last = None
            async for out in engine.generate({"prompt_token_ids": [5, 6, 7]},
                                             SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), "t0"):
                last = out
            return len(last.outputs[0].token_ids)

        assert asyncio.run(one()) == 4
        it = engine.get_stats_now().iteration
        assert it.steps >= 4 and it.model_seconds > 0 and it.schedule_seconds > 0 and it.output_seconds > 0
    finally:
        engine.shutdown()


def test_chat_content_parts_roles_and_tokenize_errors(served, client):
    """OpenAI content parts (what the SDK, agent frameworks and vllm bench serve's openai-chat send)
    give what the same text as a string gives; developer is system's newer name; other roles, non-text
    parts and empty conversations are 400s naming the field."""
    srv, engine = served
    kw = dict(model=NAME, max_tokens=8, temperature=0, extra_body={"ignore_eos": True})
    text = "Count to three."
    plain = client.chat.completions.create(messages=[{"role": "user", "content": text}], **kw)
    parts = client.chat.completions.create(messages=[{"role": "user", "content": [{"type": "text", "text": text}]}],
                                           **kw)
    assert parts.choices[0].message.content == plain.choices[0].message.content
    dev = client.chat.completions.create(messages=[{"role": "developer", "content": "Be brief."},
                                                   {"role": "user", "content": text}], **kw)
    sysm = client.chat.completions.create(messages=[{"role": "system", "content": "Be brief."},
                                                    {"role": "user", "content": text}], **kw)
    assert dev.choices[0].message.content == sysm.choices[0].message.content
    h = {"Authorization": f"Bearer {KEY}"}
    for messages, needle in (([{"role": "wizard", "content": "hi"}], "messages[0].role"),
                             ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
                              "messages[0].content[0]"),
                             ([], "messages must not be empty")):
        r = httpx.post(srv.url + "/v1/chat/completions", headers=h, json={"model": NAME, "messages": messages},
                       timeout=30)
        assert r.status_code == 400 and needle in r.json()["error"]["message"], r.text
    r = httpx.post(srv.url + "/tokenize", json={"model": None, "prompt": None, "messages": []}, headers=h, timeout=30)
    assert r.status_code == 400 and "messages" in r.json()["error"]["message"], r.text
    text_parts = [{"type": "text", "text": text}]
    r = httpx.post(srv.url + "/tokenize", json={"messages": [{"role": "user", "content": text_parts}]}, headers=h,
                   timeout=30)
    assert r.status_code == 200 and r.json()["count"] > 0
    _idle(engine)


def test_langchain_chat_openai_against_the_server(served, client):
    """A framework nobody here wrote (issue 21): LangChain's ``ChatOpenAI`` pointed at the server
    gets the same greedy reply as the ``openai`` SDK, whole and streamed, with usage and finish
    reason read from the response (``langchain-openai`` is in the dev set)."""
    import langchain_openai as lc
    from langchain_core.messages import HumanMessage, SystemMessage

    srv, engine = served
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a color."}]
    ref = client.chat.completions.create(model=NAME, messages=messages, max_tokens=8, temperature=0,
                                         extra_body={"ignore_eos": True})
    chat = lc.ChatOpenAI(base_url=srv.url + "/v1", api_key=KEY, model=NAME, temperature=0, max_tokens=8,
                         max_retries=0, timeout=60, extra_body={"ignore_eos": True}, stream_usage=True)
    lc_messages = [SystemMessage("You are terse."), HumanMessage("Name a color.")]
    reply = chat.invoke(lc_messages)
    assert reply.content == ref.choices[0].message.content
    assert reply.response_metadata["finish_reason"] == "length"
    assert reply.usage_metadata["output_tokens"] == 8
    chunks = list(chat.stream(lc_messages))
    assert "".join(c.content for c in chunks) == ref.choices[0].message.content
    assert sum(c.usage_metadata["output_tokens"] for c in chunks if c.usage_metadata) == 8
    _idle(engine)


def test_stream_polls_for_a_disconnect_at_most_once_per_interval(monkeypatch):
    """``_stream``'s fallback: ``Request.is_disconnected`` is asked only once ``DISCONNECT_POLL_S``
    has passed (each call costs a cancel scope), and a disconnect it sees ends the stream and
    closes the engine's output stream (which aborts the request)."""
    import asyncio
    import types

    from pagellm.entrypoints import serving_engine

    class FakeRequest:
        def __init__(self, gone_after: int) -> None:
            self.calls, self.gone_after = 0, gone_after

        async def is_disconnected(self) -> bool:
            self.calls += 1
            return self.calls > self.gone_after

    closed = []

    async def outputs():
        try:
            for i in range(10):
                yield types.SimpleNamespace(finished=False, i=i)
        finally:
            closed.append(True)

    server = types.SimpleNamespace(metrics=types.SimpleNamespace(record=lambda out: None))

    async def run(request: FakeRequest) -> list[int]:
        return [o.i async for o in serving_engine.OpenAIServing._stream(server, outputs(), "r", request)]

    monkeypatch.setattr(serving_engine, "DISCONNECT_POLL_S", 3600.0)
    quiet = FakeRequest(gone_after=0)
    assert asyncio.run(run(quiet)) == list(range(10)) and quiet.calls == 0 and closed == [True]
    monkeypatch.setattr(serving_engine, "DISCONNECT_POLL_S", 0.0)
    closed.clear()
    gone = FakeRequest(gone_after=3)
    assert asyncio.run(run(gone)) == [0, 1, 2] and gone.calls == 4 and closed == [True]


def test_aborts_and_adds_wait_a_step_not_a_request(tiny_llama):
    """Callers must not starve behind the engine loop: a lock taken around each step let the loop
    re-take it before a waiting caller woke, so a client's abort waited out its request (seen in CI
    as a disconnected request running to its end). An abort lands within a step or two, and a
    request cancelled before its add ran is never added."""
    import asyncio

    engine = AsyncLLM.from_engine_args(EngineArgs(model=tiny_llama, kv_cache_memory="16MiB"))
    step = engine.engine.step

    def slow_step():  # a step long enough that a waiting caller is always there when it ends
        time.sleep(0.02)
        return step()
    engine.engine.step = slow_step
    params = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
    try:
        async def abort_while_running() -> tuple[int, int]:
            gen = engine.generate({"prompt_token_ids": [5, 6, 7]}, params, "r0")
            await gen.__anext__()  # running now
            late = asyncio.ensure_future(engine.generate({"prompt_token_ids": [8, 9]}, params, "r1").__anext__())
            await asyncio.sleep(0)  # its add is waiting for the step to end
            late.cancel()
            steps = engine.get_stats_now().iteration.steps
            await gen.aclose()  # the client went away: abort
            return steps, engine.get_stats_now().iteration.steps
        polling = threading.Event()

        def poll() -> None:  # what ``_idle`` and a Prometheus scrape do meanwhile
            while not polling.wait(0.01):
                engine.get_stats_now()
        poller = threading.Thread(target=poll)
        poller.start()
        try:
            at_abort, after_abort = asyncio.run(abort_while_running())
        finally:
            polling.set()
            poller.join()
        assert after_abort - at_abort <= 3, f"the abort waited {after_abort - at_abort} steps"
        _idle(engine, timeout=30)
        assert engine.get_stats_now()["generation_tokens"] < 20, "a request ran on after its client left"
    finally:
        engine.shutdown()


def test_batched_completions_equal_each_prompt_alone(served, client):
    """An evaluation harness's batched request (vLLM's and OpenAI's list of prompts): prompt i's
    choices are i * n ... i * n + n - 1, each as the prompt alone gives it; usage sums them; a bad
    prompt is a 400 naming its index with nothing left running."""
    srv, engine = served
    prompts = ["The quick brown fox", "a b c", "Once upon a time"]
    kw = dict(model=NAME, max_tokens=4, temperature=0, logprobs=2, echo=True, n=2, extra_body={"ignore_eos": True})
    batched = client.completions.create(prompt=prompts, **kw)
    alone = [client.completions.create(prompt=p, **kw) for p in prompts]
    assert [c.index for c in batched.choices] == list(range(6))
    for i, one in enumerate(alone):
        for j in range(2):
            got, ref = batched.choices[2 * i + j], one.choices[j]
            assert got.text == ref.text and got.logprobs.tokens == ref.logprobs.tokens
            assert got.logprobs.token_logprobs == ref.logprobs.token_logprobs  # (the same floats)
    assert batched.usage.prompt_tokens == sum(o.usage.prompt_tokens for o in alone)
    assert batched.usage.completion_tokens == sum(o.usage.completion_tokens for o in alone) == 24

    chunks = list(client.completions.create(prompt=prompts, stream=True, stream_options={"include_usage": True},
                                            **{**kw, "logprobs": None}))
    texts: dict[int, str] = {}
    for c in chunks[:-1]:
        texts[c.choices[0].index] = texts.get(c.choices[0].index, "") + c.choices[0].text
    assert texts == {c.index: c.text for c in batched.choices}
    assert chunks[-1].choices == [] and chunks[-1].usage.total_tokens == batched.usage.total_tokens

    ids = [[5, 17, 33, 2, 9], [7, 8]]
    out = client.completions.create(model=NAME, prompt=ids, max_tokens=3, temperature=0)
    assert [c.text for c in out.choices] == [client.completions.create(model=NAME, prompt=p, max_tokens=3,
                                                                       temperature=0).choices[0].text for p in ids]
    for stream in (False, True):
        r = httpx.post(srv.url + "/v1/completions", headers={"Authorization": f"Bearer {KEY}"}, timeout=30,
                       json={"model": NAME, "prompt": [[5], [5, 10**8]], "max_tokens": 3, "stream": stream})
        assert r.status_code == 400 and r.json()["error"]["message"].startswith("prompt 1: "), r.text
    _idle(engine)


def test_unknown_routes_and_methods_get_openai_error_bodies(served):
    srv, _ = served
    r = httpx.post(srv.url + "/v1/no-such-route", json={})
    assert r.status_code == 404 and r.json()["error"]["message"] == "Invalid URL (POST /v1/no-such-route)"
    r = httpx.get(srv.url + "/v1/completions")
    assert r.status_code == 405 and set(r.json()["error"]) == {"message", "type", "param", "code"}
    assert "POST" in r.headers["allow"]
