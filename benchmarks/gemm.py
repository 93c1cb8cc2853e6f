"""The packed-weight GEMM kernel (``kernels/gemm.c``) against ``F.linear`` (MKL) at the model's shapes.

One "pass" is every projection of every layer (fused qkv, o, gate_up, down) plus the LM head,
each with its own weight as in a real forward, so weights stream from memory as they do in a
step. All paths run interleaved (after a warm-up run each), best of ``--repeats``; the ratio is
F.linear's time over the kernel's, measured in the same run.

    python benchmarks/gemm.py
    python benchmarks/gemm.py --rows 1 8 64 2048
    git show REV:pagellm/kernels/gemm.c > /tmp/gemm_old.c
    python benchmarks/gemm.py --baseline-source /tmp/gemm_old.c   # an older kernel, interleaved too
    python benchmarks/gemm.py --quantized --rows 1 8 16 20   # GGUF weights: their quantized copies too
    python benchmarks/gemm.py --bf16 --int8     # GGUF weights; bf16 kernels and the int8 kernel (gemm_int8) too
"""

from __future__ import annotations

import argparse

from workload import add_shape_args, interleaved_best


def _gguf_roundtrip(w, bits: int):
    """``w`` as a GGUF file holds it in Q4_1 (``bits`` 4) or Q8_0 (8): quantized and dequantized by
    the gguf package."""
    import gguf
    import torch

    t = gguf.GGMLQuantizationType.Q4_1 if bits == 4 else gguf.GGMLQuantizationType.Q8_0
    return torch.from_numpy(gguf.dequantize(gguf.quantize(w.numpy() * 0.05, t), t).reshape(w.shape).copy())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8, 16, 32, 64, 128, 512, 2048])
    ap.add_argument("--hidden", type=int, default=576, help="default: SmolLM2-135M's shapes")
    ap.add_argument("--intermediate", type=int, default=1536)
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--baseline-source", default=None, metavar="FILE.c",
                    help="also time this version of gemm.c (same packed layout), interleaved with the others")
    ap.add_argument("--quantized", action="store_true",
                    help="weights as the bundled GGUF holds them (the layers' in Q4_1, the LM head in Q8_0, quantized "
                         "and dequantized by the gguf package), and also time their quantized copies "
                         "(gemm.pack_quantized)")
    ap.add_argument("--bf16", action="store_true",
                    help="also time the bfloat16 kernels (gemm.pack_bf16): AMX tiles where the machine has them, "
                         "and the AVX512-BF16 dot-product version")
    ap.add_argument("--int8", action="store_true",
                    help="also time the int8 kernel over the GGUF blocks (gemm_int8, quantization='gguf'); "
                         "implies --quantized")
    add_shape_args(ap)
    args = ap.parse_args()
    args.quantized |= args.int8

    import torch
    import torch.nn.functional as F

    from pagellm import kernels
    from pagellm.kernels import gemm, gemm_int8

    torch.manual_seed(0)
    h, hd = args.hidden, args.head_dim
    shapes = [((args.heads[0] + 2 * args.heads[1]) * hd, h), (h, args.heads[0] * hd),
              (2 * args.intermediate, h), (h, args.intermediate)]
    weights = [torch.randn(n, k) for _ in range(args.layers) for n, k in shapes] + [torch.randn(args.vocab, h)]
    if not gemm.usable(weights[0]):
        raise SystemExit("the GEMM kernel cannot run here (neither AVX-512 nor AVX2, no compiler, "
                         "or PAGELLM_CPU_GEMM=0)")
    bits = [4] * (len(weights) - 1) + [8]
    if args.quantized:
        weights = [_gguf_roundtrip(w, b) for w, b in zip(weights, bits, strict=True)]
    packed = [gemm.pack(w) for w in weights]
    packed_q = [gemm.pack_quantized(w, b) for w, b in zip(weights, bits, strict=True)] if args.quantized else []
    if args.bf16 and not gemm.bf16_supported():
        raise SystemExit("no bfloat16 GEMM kernel here (needs AVX512-BF16)")
    packed_bf16 = [gemm.pack_bf16(w) for w in weights] if args.bf16 else []
    if args.int8 and not gemm_int8.supported():
        raise SystemExit("no int8 GEMM kernel here (needs AVX512-VNNI)")
    packed_i8 = [gemm_int8.pack(w) for w in weights] if args.int8 else []
    amx = gemm.amx_supported()
    print(f"{len(weights)} weights, {sum(w.numel() for w in weights) * 4 / 2**20:.0f} MiB, "
          f"{torch.get_num_threads()} threads")
    base_lib = kernels.build_source(args.baseline_source, gemm.SIGNATURES) if args.baseline_source else None
    print(f"{'rows':>6} {'F.linear ms':>12} {'GFLOP/s':>8} {'kernel ms':>10} {'GFLOP/s':>8} {'F.linear / kernel':>18}"
          + (f" {'baseline ms':>12} {'baseline / kernel':>18}" if base_lib else "")
          + (f" {'quantized ms':>13} {'kernel / quantized':>19}" if args.quantized else "")
          + (f" {'bf16 AMX ms':>12} {'kernel / AMX':>13}" if args.bf16 and amx else "")
          + (f" {'bf16 dp ms':>11} {'kernel / dp':>12}" if args.bf16 else "")
          + (f" {'int8 ms':>8} {'kernel / int8':>14}" if args.int8 else ""))
    for m in args.rows:
        xs = {k: torch.randn(m, k) for k in {w.shape[1] for w in weights}}
        flops = sum(2 * m * w.numel() for w in weights)

        def mkl(xs: dict = xs) -> None:
            for w in weights:
                F.linear(xs[w.shape[1]], w)

        def kernel(xs: dict = xs) -> None:
            for w, p in zip(weights, packed, strict=True):
                gemm.linear(xs[w.shape[1]], p, w.shape[0])

        ys = {w.shape[0]: torch.empty(m, w.shape[0]) for w in weights}

        def baseline(xs: dict = xs, ys: dict = ys, m: int = m) -> None:
            assert base_lib is not None
            for w, p in zip(weights, packed, strict=True):
                n, k = w.shape
                base_lib.gemm_packed_f32(ys[n].data_ptr(), n, xs[k].data_ptr(), k, p.data_ptr(), None, m, n, k)

        def quantized(xs: dict = xs) -> None:
            for w, p, b in zip(weights, packed_q, bits, strict=True):
                gemm.linear(xs[w.shape[1]], p, w.shape[0], bits=b)

        def bf16(xs: dict = xs, use_amx: bool = False) -> None:
            for w, p in zip(weights, packed_bf16, strict=True):
                gemm.linear(xs[w.shape[1]], p, w.shape[0], bits=16, amx=use_amx)

        def int8(xs: dict = xs) -> None:
            for w, packed_bits in zip(weights, packed_i8, strict=True):
                assert packed_bits is not None
                gemm_int8.linear(xs[w.shape[1]], packed_bits[0], packed_bits[1], w.shape[0])

        steps = ({"mkl": mkl, "kernel": kernel} | ({"baseline": baseline} if base_lib else {})
                 | ({"quantized": quantized} if args.quantized else {})
                 | ({"bf16_amx": lambda: bf16(use_amx=True)} if args.bf16 and amx else {})
                 | ({"bf16_dp": bf16} if args.bf16 else {}) | ({"int8": int8} if args.int8 else {}))
        with torch.inference_mode():
            best = interleaved_best(steps, args.repeats)
        a, b = best["mkl"], best["kernel"]
        line = f"{m:6d} {a * 1e3:12.2f} {flops / a / 1e9:8.1f} {b * 1e3:10.2f} {flops / b / 1e9:8.1f} {a / b:17.2f}x"
        if base_lib:
            line += f" {best['baseline'] * 1e3:12.2f} {best['baseline'] / b:17.2f}x"
        if args.quantized:
            line += f" {best['quantized'] * 1e3:13.2f} {b / best['quantized']:18.2f}x"
        if args.bf16 and amx:
            line += f" {best['bf16_amx'] * 1e3:12.2f} {b / best['bf16_amx']:12.2f}x"
        if args.bf16:
            line += f" {best['bf16_dp'] * 1e3:11.2f} {b / best['bf16_dp']:11.2f}x"
        if args.int8:
            line += f" {best['int8'] * 1e3:8.2f} {b / best['int8']:13.2f}x"
        print(line)


if __name__ == "__main__":
    main()
