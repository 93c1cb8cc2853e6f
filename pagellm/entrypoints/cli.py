"""The ``pagellm`` command: ``generate`` (batched, offline) and ``chat`` (interactive, streamed)."""

from __future__ import annotations

import argparse
import logging
import sys
from typing import Any

from pagellm.config import EngineArgs, as_cli_message
from pagellm.entrypoints import tool_calls
from pagellm.entrypoints.chat_utils import MediaConnector
from pagellm.lora_request import LoRARequest
from pagellm.sampling_params import SamplingParams


def _add_sampling_args(p: argparse.ArgumentParser, default_max_tokens: int) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=default_max_tokens)
    g.add_argument("--min-tokens", type=int, default=0)
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--min-p", type=float, default=0.0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--presence-penalty", type=float, default=0.0)
    g.add_argument("--frequency-penalty", type=float, default=0.0)
    g.add_argument("--repetition-penalty", type=float, default=1.0)
    g.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    g.add_argument("--ignore-eos", action="store_true")


def _sampling_params(args: argparse.Namespace) -> SamplingParams:
    return SamplingParams(
        max_tokens=args.max_tokens, min_tokens=args.min_tokens, temperature=args.temperature, top_p=args.top_p,
        top_k=args.top_k, min_p=args.min_p, seed=args.seed, presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty, repetition_penalty=args.repetition_penalty,
        stop=args.stop, ignore_eos=args.ignore_eos,
    )


def cmd_generate(args: argparse.Namespace) -> int:
    params = _sampling_params(args)
    llm = _make_llm(args)
    if args.chat_format:
        outs = llm.chat([[{"role": "user", "content": p}] for p in args.prompts], params, use_tqdm=not args.quiet)
    else:
        outs = llm.generate(args.prompts, params, use_tqdm=not args.quiet)
    for prompt, out in zip(args.prompts, outs, strict=True):
        c = out.outputs[0]
        print(f"\n=== {prompt!r}  [{len(c.token_ids)} tokens, finish_reason={c.finish_reason}]")
        print(c.text)
    return 0


def _make_llm(args: argparse.Namespace) -> Any:
    from pagellm.entrypoints.llm import LLM

    chat_template = None
    if getattr(args, "chat_template", None):
        with open(args.chat_template) as f:
            chat_template = f.read()
    return LLM(chat_template=chat_template, **EngineArgs.from_cli_args(args).to_dict())


def cmd_chat(args: argparse.Namespace) -> int:
    llm = _make_llm(args)
    engine = llm.llm_engine
    tok = engine.get_tokenizer()
    params = _sampling_params(args)
    history: list[dict[str, str]] = []
    if args.system:
        history.append({"role": "system", "content": args.system})
    print("pagellm chat — empty line or Ctrl-D to quit, /reset to clear the conversation", file=sys.stderr)
    turn = 0
    while True:
        try:
            user = input("\n> ")
        except EOFError:
            break
        if not user.strip():
            break
        if user.strip() == "/reset":
            history = history[:1] if args.system else []
            continue
        history.append({"role": "user", "content": user})
        rid = f"chat-{turn}"
        turn += 1
        engine.add_request(rid, tok.chat_prompt(history), params)
        printed = 0
        reply = ""
        try:
            while engine.has_unfinished_requests():
                for out in engine.step():
                    reply = out.outputs[0].text
                    sys.stdout.write(reply[printed:])
                    sys.stdout.flush()
                    printed = len(reply)
        except KeyboardInterrupt:
            engine.abort_request(rid)
        print()
        history.append({"role": "assistant", "content": reply})
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pagellm", description="pagellm: paged-KV LLM inference on CPU and CUDA")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate completions for one or more prompts (batched)")
    gen.add_argument("prompts", nargs="+", help="prompt strings")
    gen.add_argument("--chat-format", action="store_true", help="wrap each prompt as a user message (chat template)")
    gen.add_argument("--quiet", action="store_true", help="no progress bar")
    _add_sampling_args(gen, default_max_tokens=64)
    EngineArgs.add_cli_args(gen, skip=("seed",))
    chat = sub.add_parser("chat", help="interactive chat in the terminal, tokens printed as they arrive")
    chat.add_argument("--system", default=None, help="system prompt")
    chat.add_argument("--chat-template", default=None, help="Jinja chat template file (default: the model's)")
    _add_sampling_args(chat, default_max_tokens=512)
    EngineArgs.add_cli_args(chat, skip=("seed",))
    srv = sub.add_parser("serve", help="OpenAI-compatible HTTP server (/v1/completions, /v1/chat/completions, ...)")
    srv.add_argument("model_tag", nargs="?", default=None, help="model (same as --model; default: the bundled one)")
    srv.add_argument("--host", default="127.0.0.1")
    srv.add_argument("--port", type=int, default=8000)
    srv.add_argument("--api-key", default=None, help="require this bearer token (default: $PAGELLM_API_KEY)")
    srv.add_argument("--chat-template", default=None, help="Jinja chat template file (default: the model's)")
    srv.add_argument("--engine-core-process", action=argparse.BooleanOptionalAction, default=True,
                     help="run the engine in a process of its own, the HTTP server in this one (default); "
                          "--no-engine-core-process: a thread of this process")
    srv.add_argument("--chat-template-content-format", choices=("auto", "string", "openai"), default="auto",
                     help="how OpenAI content parts reach the chat template: string (text parts joined; auto) "
                          "or openai (the list of parts)")
    srv.add_argument("--exit-on-engine-death", action="store_true",
                     help="exit with status 1 once the engine has died (for systemd / Kubernetes to restart it) "
                          "instead of answering 503")
    srv.add_argument("--lora-modules", nargs="+", default=[], metavar="NAME=PATH",
                     help="LoRA adapters (PEFT directories) to serve from the start, each picked by a request's "
                          "model field (needs --enable-lora; more with POST /v1/load_lora_adapter)")
    srv.add_argument("--tool-call-parser", choices=sorted(tool_calls.PARSERS), default=None,
                     help="how the model writes tool calls, for tool_choice auto (vLLM's names; default: hermes, "
                          "Qwen's <tool_call> tags; llama3_json: Llama 3.x; mistral: [TOOL_CALLS])")
    srv.add_argument("--enable-auto-tool-choice", action="store_true",
                     help="accepted for vLLM's command lines: tool_choice auto is always on here")
    srv.add_argument("--api-server-count", type=int, default=1,
                     help="HTTP server processes sharing the port, each a client of the one engine core")
    EngineArgs.add_cli_args(srv, skip=("served_model_name",))
    srv.add_argument("--served-model-name", default=None, help="model id clients use (default: the model path)")
    bench = sub.add_parser("bench", help="benchmarks against a running server")
    bench_sub = bench.add_subparsers(dest="bench_command", required=True)
    from pagellm.entrypoints import bench_serve

    bench_serve.add_args(bench_sub.add_parser(
        "serve", help="load an OpenAI-compatible server with streaming requests; TTFT / TPOT / ITL / E2E, tok/s",
        description=bench_serve.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter))
    proxy = sub.add_parser("proxy", help="one OpenAI-compatible endpoint over a prefill and a decode server "
                                         "(disaggregated prefill/decode with TcpConnector; docs/kv_transfer.md)")
    proxy.add_argument("--prefill", required=True, help="the prefill server's base URL, e.g. http://10.0.0.1:8100")
    proxy.add_argument("--decode", required=True, help="the decode server's base URL, e.g. http://10.0.0.2:8200")
    proxy.add_argument("--decode-kv", required=True, metavar="HOST:PORT",
                       help="the decode engine's KV receiver (its kv_connector_extra_config host and port), as the "
                            "prefill engine reaches it")
    proxy.add_argument("--host", default="127.0.0.1")
    proxy.add_argument("--port", type=int, default=8000)
    trace = sub.add_parser("trace", help="render a step trace (--trace-out) as one self-contained HTML page")
    trace.add_argument("trace_file", help="Chrome Trace JSON written by --trace-out or fetched from /debug/trace")
    trace.add_argument("-o", "--output", default=None, help="HTML file (default: TRACE_FILE with .html)")
    return parser


def _media(engine_args: EngineArgs) -> MediaConnector:
    return MediaConnector(engine_args.allowed_local_media_path, engine_args.allow_remote_media)


def cmd_serve(args: argparse.Namespace) -> int:
    import os

    from pagellm.engine.core_client import AsyncEngineClient, keep_torch_out
    from pagellm.engine.protocol import EngineClient
    from pagellm.entrypoints.openai_server import serve

    if args.model_tag is not None:
        args.model = args.model_tag
    chat_template = None
    if args.chat_template:
        with open(args.chat_template) as f:
            chat_template = f.read()
    engine_args = EngineArgs.from_cli_args(args)
    name = args.served_model_name or args.model or "SmolLM2-135M-Instruct"
    api_key = args.api_key or os.environ.get("PAGELLM_API_KEY")
    if args.api_server_count < 1:
        raise ValueError(f"--api-server-count must be >= 1, got {args.api_server_count}")
    if args.api_server_count > 1:
        if not args.engine_core_process:
            raise ValueError("--api-server-count > 1 needs the engine core process (drop --no-engine-core-process)")
        if args.lora_modules:
            raise ValueError("--lora-modules with --api-server-count > 1: load them with POST /v1/load_lora_adapter")
        return _serve_many(args, engine_args, chat_template, name, api_key)
    loras = _lora_modules(args.lora_modules, engine_args)
    engine: EngineClient
    if args.engine_core_process:
        keep_torch_out()  # this process only serves HTTP
        engine = AsyncEngineClient.start(engine_args, chat_template)
    else:  # the engine on a thread of this process (which then imports torch)
        from pagellm.engine.async_llm import AsyncLLM

        engine = AsyncLLM.from_engine_args(engine_args, chat_template)
    try:
        for lora in loras:  # checked before the server listens: a bad path stops it with the reason
            engine.lora("add", lora)
    except ValueError:
        engine.shutdown()
        raise
    serve(engine, name, args.host, args.port, api_key,
          chat_template_content_format=args.chat_template_content_format,
          exit_on_engine_death=args.exit_on_engine_death, media=_media(engine_args),
          reasoning_parser=engine_args.reasoning_parser, tool_call_parser=args.tool_call_parser)
    return 0


def _lora_modules(specs: list[str], engine_args: EngineArgs) -> list[LoRARequest]:
    """``--lora-modules name=path ...`` as LoRA requests with ids 1, 2, ..."""
    if specs and not engine_args.enable_lora:
        raise ValueError("--lora-modules needs --enable-lora")
    out = []
    for i, spec in enumerate(specs):
        name, sep, path = spec.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"--lora-modules expects NAME=PATH, got {spec!r}")
        out.append(LoRARequest(name, i + 1, path))
    return out


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def _serve_many(args: argparse.Namespace, engine_args: EngineArgs, chat_template: str | None, name: str,
                api_key: str | None) -> int:
    """One engine core process and ``--api-server-count`` HTTP server processes on one port; runs
    until interrupted or until any of them exits, then stops the rest."""
    import multiprocessing
    import os
    import shutil
    import signal
    import time

    from pagellm.engine.core_proc import core_addresses, start_engine_core
    from pagellm.entrypoints.openai_server import run_api_server

    tmp, input_addr, output_addrs = core_addresses(args.api_server_count)
    core = start_engine_core(engine_args, chat_template, input_addr, output_addrs)
    # The API servers' latency histograms, summed over the processes at every /metrics scrape.
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = os.path.join(tmp, "prometheus")
    os.makedirs(os.environ["PROMETHEUS_MULTIPROC_DIR"])
    ctx = multiprocessing.get_context("spawn")
    servers = [ctx.Process(target=run_api_server, name=f"pagellm-api-server-{i}",
                           args=(i, input_addr, addr, core.pid, name, args.host, args.port, api_key,
                                 args.chat_template_content_format, args.exit_on_engine_death,
                                 _media(engine_args), engine_args.reasoning_parser, args.tool_call_parser))
               for i, addr in enumerate(output_addrs)]
    for p in servers:
        p.start()
    signal.signal(signal.SIGTERM, _interrupt)  # `kill` stops everything as Ctrl-C does
    try:
        while core.is_alive() and all(p.is_alive() for p in servers):
            time.sleep(0.5)
    except KeyboardInterrupt:
        pass
    finally:
        for p in servers:
            if p.is_alive():
                p.terminate()  # uvicorn's graceful shutdown
        for p in servers:
            p.join(timeout=30)
        if core.is_alive():
            core.terminate()
            core.join(timeout=30)
        shutil.rmtree(tmp, ignore_errors=True)
    return 0 if core.exitcode in (0, -signal.SIGTERM) else 1


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    args = build_parser().parse_args(argv)
    try:
        if args.command == "generate":
            return cmd_generate(args)
        if args.command == "serve":
            return cmd_serve(args)
        if args.command == "trace":
            from pagellm.entrypoints import trace_html

            trace_html.main(args.trace_file, args.output or args.trace_file.removesuffix(".json") + ".html")
            return 0
        if args.command == "proxy":
            from pagellm.entrypoints import disagg_proxy

            return disagg_proxy.main(args)
        if args.command == "bench":
            from pagellm.entrypoints import bench_serve

            return bench_serve.main(args)
        return cmd_chat(args)
    except (ValueError, FileNotFoundError) as e:
        print(f"pagellm: error: {as_cli_message(str(e))}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
