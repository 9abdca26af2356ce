#!/usr/bin/env python3
"""mlxhost's quantized mat-vec CUDA kernel (host/src/model/kernels/quantized_matvec.cuh) against
MLX's own `mx.quantized_matmul`, through `mx.fast.cuda_kernel`, on the GPU machine.

For each weight shape (the real 8B and 32B layers' products by default), rows of activations N and
launch layout (R output rows per warp, WARPS warps per block): the largest relative difference
from MLX's op, and the time per product. Times are the mean of REPS independent products in one
evaluation (MLX queues them into one CUDA graph), so a product shorter than MLX's per-op host cost
(~5-10 us) reads as that cost for both kernels; the effective bandwidth is weight bytes over time.

    python3 benches/device/qmv_kernel.py [--quick] [--json out.json]
"""
import argparse
import json
import os
import time

import mlx.core as mx

HERE = os.path.dirname(os.path.abspath(__file__))
HEADER = open(os.path.join(HERE, "../../host/src/model/kernels/quantized_matvec.cuh")).read()

# (name, O, K): the products of a decode step at Qwen3-8B's and Qwen2.5-32B's shapes (q/k/v fused,
# gate/up fused, as mlxhost runs them).
SHAPES = [
    ("8b.qkv", 6144, 4096), ("8b.o", 4096, 4096), ("8b.gate_up", 24576, 4096),
    ("8b.down", 4096, 12288), ("8b.lm_head", 151936, 4096),
    ("32b.qkv", 7168, 5120), ("32b.o", 5120, 5120), ("32b.gate_up", 55296, 5120),
    ("32b.down", 5120, 27648), ("32b.lm_head", 152064, 5120),
]

_kernels = {}


def kernel(layout):
    if layout not in _kernels:
        _kernels[layout] = mx.fast.cuda_kernel(
            name="mlxhost_qmv_proto",
            input_names=["x", "w", "scales", "biases"],
            output_names=["y"],
            source="mlxhost_qmv::matvec<T, BITS, GS, NR, R, U, WARPS, BF16 != 0>"
                   "(x, w, scales, biases, y, x_shape[1], w_shape[0]);",
            header=HEADER,
        )
    return _kernels[layout]


def ours(x, w, s, b, bits, gs, r, u, warps):
    n, k = x.shape
    o = w.shape[0]
    blocks = (o + r * warps - 1) // (r * warps)
    return kernel("v1")(
        inputs=[x, w, s, b],
        template=[("T", x.dtype), ("BITS", bits), ("GS", gs), ("NR", n), ("R", r), ("U", u),
                  ("WARPS", warps), ("BF16", int(x.dtype == mx.bfloat16))],
        grid=(blocks * warps * 32, 1, 1), threadgroup=(warps * 32, 1, 1),
        output_shapes=[(n, o)], output_dtypes=[x.dtype])[0]


def theirs(x, w, s, b, bits, gs):
    return mx.quantized_matmul(x, w, s, b, transpose=True, group_size=gs, bits=bits)


def timed(fn, xs):
    mx.eval(fn(xs[0]))
    best = float("inf")
    for _ in range(3):
        mx.synchronize()
        t = time.perf_counter()
        ys = [fn(x) for x in xs]
        mx.eval(ys)
        mx.synchronize()
        best = min(best, (time.perf_counter() - t) / len(xs))
    return best


def rel_diff(got, want):
    got, want = got.astype(mx.float32), want.astype(mx.float32)
    return (mx.abs(got - want) / (1 + mx.abs(want))).max().item()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--json")
    ap.add_argument("--reps", type=int, default=40)
    args = ap.parse_args()
    layouts = [(1, 1, 4), (2, 2, 4), (4, 1, 4), (4, 2, 4), (2, 2, 8), (4, 1, 8), (1, 4, 8)]
    results = []
    # Correctness over the kinds the kernel takes (each template set is one NVRTC compile).
    kinds = [(mx.bfloat16, bits, gs, n) for bits in (4, 8) for gs in (32, 64, 128) for n in (1, 3, 8)]
    kinds += [(mx.float16, 4, 64, n) for n in (1, 8)] + [(mx.float16, 8, 32, 2)]
    for dtype, bits, gs, n in kinds:
        o, k = 1000, 1536
        wf = (mx.random.normal((o, k)) * 0.05).astype(dtype)
        w, s, b = mx.quantize(wf, group_size=gs, bits=bits)
        x = mx.random.normal((n, k)).astype(dtype)
        r, u, warps = (4, 2, 4) if n < 3 else (1, 2, 4)
        d = rel_diff(ours(x, w, s, b, bits, gs, r, u, warps), theirs(x, w, s, b, bits, gs))
        results.append(dict(check=True, dtype=str(dtype), bits=bits, gs=gs, n=n, r=r, u=u,
                            warps=warps, max_rel_diff=d))
        print(f"check {dtype} bits={bits} gs={gs} n={n} R={r} U={u} W={warps}: {d:.2e}", flush=True)
    shapes = [SHAPES[i] for i in (1, 2, 3, 4)] if args.quick else SHAPES
    for name, o, k in shapes:
        bits, gs, dtype = 4, 64, mx.bfloat16
        wf = (mx.random.normal((o, k)) * 0.05).astype(dtype)
        w, s, b = mx.quantize(wf, group_size=gs, bits=bits)
        del wf
        nbytes = w.nbytes + s.nbytes + b.nbytes
        for n in ((1, 4, 8) if args.quick else (1, 2, 4, 8)):
            xs = [mx.random.normal((n, k)).astype(dtype) for _ in range(args.reps)]
            mx.eval(xs)
            t_mlx = timed(lambda x: theirs(x, w, s, b, bits, gs), xs)
            row = dict(shape=name, O=o, K=k, n=n, mb=nbytes / 1e6, mlx_us=t_mlx * 1e6,
                       mlx_gbs=nbytes / t_mlx / 1e9)
            line = f"{name:12s} n={n} {nbytes/1e6:7.1f} MB  mlx {t_mlx*1e6:7.1f} us {nbytes/t_mlx/1e9:6.0f} GB/s"
            for r, u, warps in layouts:
                t = timed(lambda x: ours(x, w, s, b, bits, gs, r, u, warps), xs)
                row[f"R{r}U{u}W{warps}_us"] = t * 1e6
                line += f" | R{r}U{u}W{warps} {t*1e6:6.1f} ({t_mlx/t:4.2f}x)"
            print(line, flush=True)
            results.append(row)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(device=mx.device_info() if hasattr(mx, "device_info") else None,
                           results=results), f, indent=1, default=str)


if __name__ == "__main__":
    main()
