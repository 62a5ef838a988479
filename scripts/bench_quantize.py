"""Quantizer speed and error: qconvert's quantizers against llama.cpp's own (`ggml_quantize_chunk` from
llama-cpp-python's libggml-base.so, through ctypes) and gguf-py's numpy quantizer, on the same
bf16-rounded float32 tensors of real LLM shapes.

    python scripts/bench_quantize.py                 # >= 256 MB of bf16 input, 1 and 2 threads
    python scripts/bench_quantize.py --mb 64 --types Q4_K,Q6_K --threads 1
    python scripts/bench_quantize.py --imatrix --repeat 5     # 2048x2048 with an imatrix: IQ and K types, Q4_1

--imatrix: one 2048x2048 bf16 tensor and a random importance vector, each type's time the MIN of --repeat runs
(other processes share the CPUs; ours and ggml's alternate; wall and CPU seconds), ours (kernels/ggml/iq_c.c, kquant_imatrix_c.c; Q4_1 without imatrix: the
legacy C path) against ggml_quantize_chunk at the same thread count, after a warm-up call on both sides (ggml's
grid init for the IQ types, our C build); a markdown table row per type and thread count.

Throughput is MB/s of bf16 input (2 bytes per weight), the best of --repeat runs, after a warm-up call
at each thread count (torch.compile of the fused Q4_0/Q8_0 kernels happens once per process and thread
count; the C K-quantizers are built once per machine and cached). Threads: our K quantizers
(kernels/ggml/kquant_c.c) hand chunks of super-blocks to that many Python threads (ctypes releases the GIL),
the Q4_0/Q8_0 kernels run on torch's intra-op threads (set to the same count); llama.cpp's rows are split
over a ThreadPoolExecutor calling ggml_quantize_chunk on row ranges. RMSE of the decoded weights against
the input is printed for both, and whether the bytes are identical.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent.parent))
try:
    from qconvert.kernels.ggml import kquants as kq
    from qconvert.kernels.ggml.libggml import available as llama_cpp_available
    from qconvert.kernels.ggml.libggml import ggml_quantize
    from qconvert.kernels.ggml.layouts import LAYOUTS
    from qconvert.kernels.ggml.legacy import decode_blocks, quantize_pack
except ImportError as e:  # pragma: no cover
    raise SystemExit(f"install the package first (pip install -e .): {e}")

TYPES = ("Q4_0", "Q8_0", "Q4_K", "Q5_K", "Q6_K", "Q3_K", "Q2_K")
# llama-7B shapes ([out, in]): mlp up/gate, mlp down, attention projections
SHAPES = ((11008, 4096), (4096, 11008), (4096, 4096))


def make_inputs(mb: float, seed: int = 0, shapes=SHAPES) -> list[np.ndarray]:
    """bf16-rounded float32 tensors cycling through `shapes` until `mb` MB of bf16 are reached."""
    gen = torch.Generator().manual_seed(seed)
    out, total, i = [], 0, 0
    while total < mb * 1e6:
        shape = shapes[i % len(shapes)]
        t = torch.randn(shape, generator=gen) * (shape[1] ** -0.5)
        out.append(t.to(torch.bfloat16).to(torch.float32).numpy())
        total += t.numel() * 2
        i += 1
    return out


def ours_quantize(x: np.ndarray, t: str, threads: int) -> np.ndarray:
    lay = LAYOUTS[t]
    if lay.kind == "k":
        return kq.quantize_k(x, t, threads=threads)
    # Q4_0 / Q8_0: the fused torch.compile kernels, which run on torch's intra-op threads
    return quantize_pack(lay, torch.from_numpy(x)).numpy()


def decode(data: np.ndarray, t: str) -> np.ndarray:
    lay = LAYOUTS[t]
    if lay.kind == "k":
        return kq.dequantize_k(data, t)
    return decode_blocks(lay, torch.from_numpy(data)).numpy()


def gguf_py_quantize(x: np.ndarray, t: str) -> np.ndarray:
    import gguf

    return gguf.quants.quantize(x, gguf.GGMLQuantizationType[t])


def timed(fn, inputs, repeat: int, clock=time.perf_counter):
    best, outs = float("inf"), None
    for _ in range(repeat):
        t0 = clock()
        outs = [fn(x) for x in inputs]
        best = min(best, clock() - t0)
    return best, outs


def timed_both(fn, inputs, repeat: int):
    """(min wall seconds, min CPU seconds of this process, all threads, outputs): on a loaded machine the CPU
    seconds are the steadier measure of the work done; the wall seconds include the waits for a core."""
    wall, cpu, outs = float("inf"), float("inf"), None
    for _ in range(repeat):
        w0, c0 = time.perf_counter(), time.process_time()
        outs = [fn(x) for x in inputs]
        wall, cpu = min(wall, time.perf_counter() - w0), min(cpu, time.process_time() - c0)
    return wall, cpu, outs


def rmse(inputs, outs, t: str) -> float:
    se, n = 0.0, 0
    for x, q in zip(inputs, outs):
        d = decode(q, t).reshape(x.shape) - x
        se += float(np.square(d, dtype=np.float64).sum())
        n += x.size
    return (se / n) ** 0.5


IMATRIX_TYPES = ("IQ2_XXS", "IQ3_XXS", "IQ3_S", "IQ2_XS", "IQ2_S", "IQ1_S", "IQ1_M", "Q2_K", "Q3_K", "Q4_K", "Q5_K",
                 "Q6_K", "Q4_1")


def ours_with_imatrix(x: np.ndarray, t: str, imatrix: np.ndarray | None, threads: int) -> np.ndarray:
    from qconvert.kernels.ggml import iq1, iq2, iq3_s

    if t.startswith("IQ1"):
        return getattr(iq1, f"quantize_{t.lower()}")(x, imatrix, threads=threads)
    if t.startswith("IQ"):
        return getattr(iq3_s if t.startswith("IQ3") else iq2, f"quantize_{t.lower()}")(x, imatrix, threads=threads)
    if LAYOUTS[t].kind == "k":
        return kq.quantize_k(x, t, imatrix=imatrix, threads=threads)
    from qconvert.kernels.ggml import kquant_c

    return kquant_c.quantize_legacy(x, t, threads)  # Q4_1 from dense weights (no imatrix: the reference quantizer)


def bench_imatrix(types, thread_counts, repeat: int) -> None:
    gen = torch.Generator().manual_seed(0)
    x = (torch.randn((2048, 2048), generator=gen) * 2048 ** -0.5).to(torch.bfloat16).to(torch.float32).numpy()
    imatrix = np.random.default_rng(0).gamma(0.7, 1.0, 2048).astype(np.float32)
    print(f"2048x2048 bf16, imatrix gamma(0.7); min of {repeat} runs, ours and ggml's alternating; ratio = ggml time"
          " / ours (>= 1.5 is the target); wall seconds, then CPU seconds of the process (all its threads)")
    print("| type | threads | ours s | ggml s | ggml/ours | ours CPU s | ggml CPU s | ggml/ours CPU | same bytes |")
    print("|---|---|---|---|---|---|---|---|---|")
    for t in types:
        im = None if t == "Q4_1" else imatrix
        for n in thread_counts:
            ours_with_imatrix(x[:8], t, im, n), ggml_quantize(x[:8], t, im, threads=n)  # warm-up: builds, grid init
            our_time = gg_time = our_cpu = gg_cpu = float("inf")
            for _ in range(repeat):  # alternating, so that a change of load reaches both sides alike
                wall, cpu, ours = timed_both(lambda a: ours_with_imatrix(a, t, im, n), [x], 1)
                our_time, our_cpu = min(our_time, wall), min(our_cpu, cpu)
                wall, cpu, theirs = timed_both(lambda a: ggml_quantize(a, t, im, threads=n), [x], 1)
                gg_time, gg_cpu = min(gg_time, wall), min(gg_cpu, cpu)
            same = np.array_equal(ours[0], np.asarray(theirs[0]).reshape(ours[0].shape))
            print(f"| {t} | {n} | {our_time:.3f} | {gg_time:.3f} | {gg_time / our_time:.2f} | {our_cpu:.3f} | "
                  f"{gg_cpu:.3f} | {gg_cpu / our_cpu:.2f} | {same} |", flush=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mb", type=float, default=256, help="MB of bf16 input (default 256)")
    ap.add_argument("--types", default=",".join(TYPES))
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--shapes", default=None, help="e.g. 256x1024,512x512 instead of llama-7B's shapes")
    ap.add_argument("--imatrix", action="store_true", help="the 2048x2048 imatrix table (IQ and K types, Q4_1)")
    args = ap.parse_args(argv)
    if args.imatrix:
        types = IMATRIX_TYPES if args.types == ",".join(TYPES) else [t.strip().upper() for t in args.types.split(",")]
        bench_imatrix(types, [int(n) for n in args.threads.split(",")], max(1, args.repeat))
        return 0
    shapes = SHAPES if not args.shapes else tuple(tuple(int(v) for v in s.split("x")) for s in args.shapes.split(","))
    types = [t.strip().upper() for t in args.types.split(",")]
    thread_counts = [int(n) for n in args.threads.split(",")]
    inputs = make_inputs(args.mb, shapes=shapes)
    mb = sum(x.size for x in inputs) * 2 / 1e6
    shapes = sorted({x.shape for x in inputs})
    print(f"input: {len(inputs)} tensors {shapes}, {mb:.0f} MB of bf16; llama.cpp: "
          f"{'libggml-base.so via ctypes' if llama_cpp_available() else 'not installed'}")
    print(f"{'type':<5} {'thr':>3} {'ours MB/s':>10} {'llama.cpp':>10} {'ours/llama':>10} {'gguf-py':>8} "
          f"{'ours/gguf-py':>12} {'rmse ours':>10} {'rmse llama':>10} {'same bytes':>10}")
    for t in types:
        gp_speed = None
        if t in ("Q4_0", "Q8_0"):
            gp_time, _ = timed(lambda x: gguf_py_quantize(x, t), inputs, args.repeat)
            gp_speed = mb / gp_time
        for n in thread_counts:
            torch.set_num_threads(n)
            # warm-up at this thread count: imports, the C build (cached) and torch.compile of the
            # Q4_0/Q8_0 kernels (inductor compiles once per thread count)
            ours_quantize(inputs[0], t, n)
            our_time, ours = timed(lambda x: ours_quantize(x, t, n), inputs, args.repeat)
            ours_speed = mb / our_time
            line = f"{t:<5} {n:>3} {ours_speed:>10.1f} "
            if llama_cpp_available():
                ll_time, theirs = timed(lambda x: ggml_quantize(x, t, threads=n), inputs, args.repeat)
                ll_speed = mb / ll_time
                same = all(np.array_equal(a, b) for a, b in zip(ours, theirs))
                line += f"{ll_speed:>10.1f} {ours_speed / ll_speed:>10.2f} "
            else:
                theirs, same = None, None
                line += f"{'-':>10} {'-':>10} "
            line += (f"{gp_speed:>8.1f} {ours_speed / gp_speed:>12.2f} " if gp_speed else f"{'-':>8} {'-':>12} ")
            line += f"{rmse(inputs, ours, t):>10.3e} "
            line += f"{rmse(inputs, theirs, t):>10.3e} {str(same):>10}" if theirs is not None else f"{'-':>10} {'-':>10}"
            print(line, flush=True)
            del ours, theirs
    return 0


if __name__ == "__main__":
    sys.exit(main())
