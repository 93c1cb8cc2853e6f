"""The engine core in its own process (``pagellm serve``'s default): the HTTP server on an
``AsyncEngineClient`` answers as the in-process engine does, loses nothing when clients leave, and
reports a dead core (503, streams ended with an error)."""

from __future__ import annotations

import asyncio
import os
import random
import signal
import time

import httpx
import openai
import pytest
from test_server import NAME, _Server

from pagellm import LLM, SamplingParams
from pagellm.config import EngineArgs
from pagellm.engine.core_client import AsyncEngineClient
from pagellm.engine.protocol import EngineDeadError

PROMPTS = ["Once upon a time", "The capital of France is", "1, 2, 3,"]


@pytest.fixture(scope="module")
def core(tiny_llama):
    client = AsyncEngineClient.start(EngineArgs(model=tiny_llama, kv_cache_memory="16MiB", max_model_len=256))
    srv = _Server(client, None)  # type: ignore[arg-type]
    yield srv, client
    srv.stop()
    client.shutdown()
    assert client.process is not None and not client.process.is_alive()


def _idle(client: AsyncEngineClient, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        s = client.get_stats_now()
        # (and nothing left in the client's output-delta state: every closed stream forgot its request)
        if s["num_running"] + s["num_waiting"] + s["num_swapped"] == 0 and s["kv_cache_usage"] == 0 \
                and len(client._deltas) == 0:
            return
        assert time.monotonic() < deadline, (f"requests or blocks left behind in the core: {dict(s)}; "
                                             f"{len(client._deltas)} requests in the client's delta state")
        time.sleep(0.05)


def _wait_healthy(url: str, proc, timeout: float = 120.0) -> None:
    """Until ``url`` answers /health with 200; fails if ``proc`` (the server) exits first."""
    deadline = time.monotonic() + timeout
    while True:
        assert proc.poll() is None, "the server exited early"
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline, "the server did not start"
        time.sleep(0.5)


def test_core_process_gives_the_in_process_greedy_text(core, tiny_llama):
    srv, client = core
    sdk = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0, timeout=60)
    llm = LLM(tiny_llama, kv_cache_memory="16MiB", max_model_len=256)
    ref = [o.outputs[0].text for o in llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=12,
                                                                          ignore_eos=True))]
    llm.llm_engine.shutdown()
    got = [sdk.completions.create(model=NAME, prompt=p, max_tokens=12, temperature=0,
                                  extra_body={"ignore_eos": True}).choices[0].text for p in PROMPTS]
    assert got == ref
    streamed = "".join(c.choices[0].text for c in sdk.completions.create(
        model=NAME, prompt=PROMPTS[0], max_tokens=12, temperature=0, stream=True, extra_body={"ignore_eos": True}))
    assert streamed == ref[0]
    r = httpx.post(srv.url + "/v1/completions", json={"model": NAME, "prompt": "x", "max_tokens": 10_000})
    assert r.status_code == 400, r.text  # rejected, the core keeps serving
    assert client.vocab_size > 0 and client.max_model_len == 256
    _idle(client)


def test_streaming_clients_that_disconnect_leave_nothing_in_the_core(core):
    srv, client = core

    async def one(i: int) -> None:
        leave_at = random.Random(i).choice([None, 1, 2, 5, 15])  # chunks read before leaving; None: all
        async with httpx.AsyncClient(timeout=60) as http:
            body = {"model": NAME, "prompt": PROMPTS[i % 3], "max_tokens": 40, "stream": True, "ignore_eos": True}
            async with http.stream("POST", srv.url + "/v1/completions", json=body) as resp:
                assert resp.status_code == 200
                n = 0
                async for line in resp.aiter_lines():
                    n += line.startswith("data:")
                    if leave_at is not None and n >= leave_at:
                        return

    async def run_all() -> None:
        await asyncio.gather(*[one(i) for i in range(32)])

    asyncio.run(run_all())
    _idle(client)


def test_killed_core_ends_streams_with_an_error_and_health_503(tiny_llama):
    client = AsyncEngineClient.start(EngineArgs(model=tiny_llama, kv_cache_memory="16MiB", max_model_len=256))
    srv = _Server(client, None)  # type: ignore[arg-type]
    try:
        assert httpx.get(srv.url + "/health").status_code == 200
        body = {"model": NAME, "prompt": "x", "max_tokens": 200, "stream": True, "ignore_eos": True}
        lines: list[str] = []
        with httpx.stream("POST", srv.url + "/v1/completions", json=body, timeout=60) as resp:
            for line in resp.iter_lines():
                lines.append(line)
                if len(lines) == 4:
                    assert client.process is not None
                    os.kill(client.process.pid, signal.SIGKILL)
        data = [x for x in lines if x.startswith("data:")]
        assert any("error" in x for x in data), data[-3:]
        assert httpx.get(srv.url + "/health").status_code == 503
        r = httpx.post(srv.url + "/v1/completions", json={"model": NAME, "prompt": "x", "max_tokens": 3})
        assert r.status_code == 503
        with pytest.raises(EngineDeadError):
            client.get_stats_now()
    finally:
        srv.stop()
        client.shutdown()


def test_two_api_servers_give_the_same_greedy_text_as_one(tiny_llama):
    """``pagellm serve --api-server-count 2``: two HTTP processes on one port, one engine core;
    every answer equals the in-process engine's, and SIGTERM stops all three processes."""
    import subprocess
    import sys

    from test_server import _free_port

    port = _free_port()
    cmd = [sys.executable, "-m", "pagellm.entrypoints.cli", "serve", tiny_llama, "--port", str(port),
           "--api-server-count", "2", "--kv-cache-memory", "16MiB", "--max-model-len", "256"]
    launcher = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        url = f"http://127.0.0.1:{port}"
        _wait_healthy(url, launcher)
        llm = LLM(tiny_llama, kv_cache_memory="16MiB", max_model_len=256)
        params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
        ref = [o.outputs[0].text for o in llm.generate(PROMPTS * 2, params)]
        llm.llm_engine.shutdown()
        got = []
        for p in PROMPTS * 2:  # a new connection each: the kernel spreads them over both processes
            r = httpx.post(url + "/v1/completions", json={"model": tiny_llama, "prompt": p, "max_tokens": 10,
                                                          "temperature": 0, "ignore_eos": True}, timeout=60)
            assert r.status_code == 200, r.text
            got.append(r.json()["choices"][0]["text"])
        assert got == ref
        # Each process observed the requests it answered; every scrape, whichever process takes it,
        # reports all of them (prometheus_client's multiprocess files).
        for _ in range(4):
            m = httpx.get(url + "/metrics", timeout=30).text
            count = [ln for ln in m.splitlines() if ln.startswith("pagellm:e2e_request_latency_seconds_count")]
            assert len(count) == 1 and float(count[0].split()[-1]) == len(PROMPTS) * 2, count
    finally:
        launcher.terminate()
        assert launcher.wait(60) == 0


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/status") as f:
            return "zombie" not in f.read()
    except FileNotFoundError:
        return False


def test_core_stops_when_the_process_that_started_it_is_killed(tiny_llama, tmp_path):
    """A front end killed with SIGKILL (no shutdown message) leaves no engine core behind."""
    import subprocess
    import sys

    script = tmp_path / "front.py"
    script.write_text(
        "import sys, time\n"
        "from pagellm.config import EngineArgs\n"
        "from pagellm.engine.core_client import AsyncEngineClient\n"
        "if __name__ == '__main__':\n"
        f"    c = AsyncEngineClient.start(EngineArgs(model={tiny_llama!r}, kv_cache_memory='16MiB'))\n"
        "    print(c.process.pid, flush=True)\n"
        "    time.sleep(600)\n")
    front = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    try:
        core_pid = int(front.stdout.readline())
        os.kill(front.pid, signal.SIGKILL)
        front.wait(30)
        deadline = time.monotonic() + 30
        while _running(core_pid):
            assert time.monotonic() < deadline, "the engine core outlived its front end"
            time.sleep(0.1)
    finally:
        if front.poll() is None:
            front.kill()


def _children(pid: int) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                        out.append(int(entry))
            except (OSError, IndexError, ValueError):
                continue
    return out


def _cmdline(pid: int) -> str:
    with open(f"/proc/{pid}/cmdline") as f:
        return f.read()


def test_exit_on_engine_death_exits_non_zero(tiny_llama):
    """``pagellm serve --exit-on-engine-death``: the engine core killed, the server exits with status 1
    (for a supervisor to restart it) instead of answering 503 forever."""
    import subprocess
    import sys

    from test_server import _free_port

    port = _free_port()
    cmd = [sys.executable, "-m", "pagellm.entrypoints.cli", "serve", tiny_llama, "--port", str(port),
           "--exit-on-engine-death", "--kv-cache-memory", "16MiB", "--max-model-len", "256"]
    server = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        _wait_healthy(f"http://127.0.0.1:{port}", server)
        cores = [pid for pid in _children(server.pid) if "spawn_main" in _cmdline(pid)]  # not the resource tracker
        assert cores, "no engine core process found"
        for pid in cores:
            os.kill(pid, signal.SIGKILL)
        assert server.wait(60) == 1
    finally:
        if server.poll() is None:
            server.kill()



@pytest.mark.parametrize("servers", [1, 2])
def test_ctrl_c_stops_every_process_cleanly(tiny_llama, servers):
    """Ctrl-C in a terminal signals the whole process group: the server, its engine core and its
    API servers stop in order, exit 0, and print no traceback."""
    import subprocess
    import sys

    from test_server import _free_port

    port = _free_port()
    cmd = [sys.executable, "-m", "pagellm.entrypoints.cli", "serve", tiny_llama, "--port", str(port),
           "--kv-cache-memory", "16MiB", "--max-model-len", "256", "--api-server-count", str(servers)]
    server = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                              start_new_session=True)
    try:
        _wait_healthy(f"http://127.0.0.1:{port}", server)
        children = _children(server.pid)
        assert children, "no engine core or API server process"
        # Torch is loaded by the engine core only: every HTTP front end (this server, or its API
        # servers, each holding a tokenizer) keeps it out.
        assert len([pid for pid in (server.pid, *children) if _maps_torch(pid)]) == 1
        os.killpg(server.pid, signal.SIGINT)
        _, err = server.communicate(timeout=60)
        assert server.returncode == 0, err[-2000:]
        assert "Traceback" not in err, err[-3000:]
        deadline = time.monotonic() + 10
        while any(os.path.exists(f"/proc/{pid}") and "zombie" not in _status(pid) for pid in children):
            assert time.monotonic() < deadline, "a child process outlived the server"
            time.sleep(0.1)
    finally:
        if server.poll() is None:
            os.killpg(server.pid, signal.SIGKILL)


def _maps_torch(pid: int) -> bool:
    with open(f"/proc/{pid}/maps") as f:
        return "libtorch" in f.read()


def _status(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/status") as f:
            return f.read().lower()
    except OSError:
        return "zombie"


def _stream_lines(url: str, body: dict, out: list[str]) -> None:
    try:
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as resp:
            out.extend(resp.iter_lines())
    except httpx.TransportError as e:  # a reset connection is a failure the test reports, not a hang
        out.append(f"transport error: {e}")


@pytest.mark.parametrize("exit_on_death", [False, True])
def test_killed_mp_worker_under_load_ends_every_stream_with_an_error(tiny_llama, exit_on_death):
    """Issue 21 (3c): ``pagellm serve`` over two mp workers (tensor parallel), eight streams in
    flight, one worker SIGKILLed. Every stream ends with an error event (none hangs, none ends as
    if complete); ``/health`` turns 503; with ``--exit-on-engine-death`` the server exits 1."""
    import subprocess
    import sys
    import threading

    from test_server import _free_port

    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "pagellm.entrypoints.cli", "serve", tiny_llama, "--port", str(port),
           "--tensor-parallel-size", "2", "--distributed-executor-backend", "mp",
           "--kv-cache-memory", "16MiB", "--max-model-len", "512"]
    server = subprocess.Popen(cmd + (["--exit-on-engine-death"] if exit_on_death else []),
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        _wait_healthy(url, server)
        cores = [pid for pid in _children(server.pid) if "spawn_main" in _cmdline(pid)]
        workers = [w for c in cores for w in _children(c) if "pagellm.executor.multiproc" in _cmdline(w)]
        assert workers, "no mp worker process found under the engine core"
        body = {"model": tiny_llama, "prompt": "x", "max_tokens": 400, "stream": True, "ignore_eos": True}
        streams: list[list[str]] = [[] for _ in range(8)]
        threads = [threading.Thread(target=_stream_lines, args=(url, body, s)) for s in streams]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 60
        while not all(sum(x.startswith("data:") for x in s) >= 2 for s in streams):
            assert time.monotonic() < deadline, "the streams did not start"
            time.sleep(0.05)
        os.kill(workers[-1], signal.SIGKILL)
        for t in threads:
            t.join(120)
            assert not t.is_alive(), "a stream still open 120 s after a worker was killed"
        for s in streams:
            data = [x for x in s if x.startswith("data:")]
            assert any('"error"' in x for x in data), data[-3:]
            ended = sum('"finish_reason":"length"' in x.replace(" ", "") for x in data)
            assert ended == 0, "a stream ended as complete"
        if exit_on_death:
            assert server.wait(60) == 1
        else:
            assert httpx.get(url + "/health").status_code == 503
            assert server.poll() is None
    finally:
        if server.poll() is None:
            server.terminate()
            server.wait(60)
