"""The disk connector as a prefix cache that survives restarts: time to first token of a request
whose 2,048-token prefix an earlier engine computed, with the disk cache vs without, same run.

1. An engine with ``DiskConnector`` serves one request with the prefix (saving its blocks) and
   shuts down.
2. Turns, ``--repeats`` times: a fresh engine with the same store ("after a restart"), and a
   fresh engine without it, each serving one request with the same prefix and a new suffix
   (``max_tokens=1``): TTFT is from ``add_request`` to the first token, start-up excluded.
   Their first tokens are compared as well.

    python benchmarks/kv_transfer.py
    python benchmarks/kv_transfer.py --prefix-tokens 4096 --repeats 3

The issue's other measurement, the prefill/decode split over TCP against one engine, needs the
``TcpConnector``, which is not built yet (docs/kv_transfer.md).
"""

from __future__ import annotations

import argparse
import random
import shutil
import statistics
import tempfile
import time


def one_request(store: str | None, prompt: list[int], args: argparse.Namespace) -> tuple[float, int, dict]:
    from pagellm import LLMEngine, SamplingParams
    from pagellm.config import EngineArgs

    kvt = None if store is None else {"kv_connector": "DiskConnector", "kv_connector_extra_config": {"path": store}}
    eng = LLMEngine.from_engine_args(EngineArgs(model=args.model, kv_transfer_config=kvt, max_model_len=8192))
    try:
        t0 = time.perf_counter()
        eng.add_request("r", {"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=1,
                                                                          ignore_eos=True))
        token = None
        while token is None:
            for out in eng.step():
                if out.outputs[0].token_ids:
                    token = out.outputs[0].token_ids[0]
        ttft = time.perf_counter() - t0
        while eng.has_unfinished_requests():
            eng.step()
        stats = eng.get_stats()
        eng.executor.collective_rpc("kv_wait_for_save")
    finally:
        eng.shutdown()
    return ttft, token, stats


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="default: the bundled SmolLM2-135M-Instruct GGUF")
    ap.add_argument("--prefix-tokens", type=int, default=2048)
    ap.add_argument("--suffix-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    from pagellm.kernels.machine import cpu_info

    print(f"machine: {cpu_info().summary()}")
    rng = random.Random(0)
    prefix = [rng.randrange(100, 40000) for _ in range(args.prefix_tokens)]

    def prompt() -> list[int]:
        return prefix + [rng.randrange(100, 40000) for _ in range(args.suffix_tokens)]

    store = tempfile.mkdtemp(prefix="pagellm-kv-bench-")
    try:
        _, _, stats = one_request(store, prompt(), args)
        print(f"first engine saved {stats['kv_blocks_saved']} blocks, {stats['kv_bytes_saved'] / 2**20:.1f} MiB")
        disk, cold = [], []
        for i in range(args.repeats):
            p = prompt()
            t_disk, tok_disk, s = one_request(store, p, args)
            t_cold, tok_cold, _ = one_request(None, p, args)
            disk.append(t_disk)
            cold.append(t_cold)
            print(f"  round {i + 1}: after a restart with the disk cache {t_disk * 1e3:7.1f} ms "
                  f"(loaded {s['kv_blocks_loaded']} blocks in {s['kv_load_seconds'] * 1e3:.1f} ms), "
                  f"without {t_cold * 1e3:7.1f} ms; first tokens {'equal' if tok_disk == tok_cold else 'DIFFER'}")
        d, c = statistics.median(disk), statistics.median(cold)
        print(f"TTFT, {args.prefix_tokens}-token prefix + {args.suffix_tokens} new tokens, median of {args.repeats}: "
              f"disk cache {d * 1e3:.1f} ms, none {c * 1e3:.1f} ms: {c / d:.2f}x lower")
    finally:
        shutil.rmtree(store, ignore_errors=True)


if __name__ == "__main__":
    main()
