"""Benchmark the Triton kernels on a CUDA device (one short run, under 5 minutes on an H200).

    python scripts/bench_gpu.py               needs a CUDA device; refuses in one line without one
    python scripts/bench_gpu.py --interpret   no GPU: a tiny smoke run under Triton's CPU interpreter (proves the
                                              script and the kernels work; its timings mean nothing)

Prints the device, then
- per dequantization kernel: GB/s (bytes read + bytes written, from CUDA-event timings) and the ratio to the
  device's memory bandwidth (nominal from its memory clock and bus width where torch reports them, else from a
  table of known parts; and the bandwidth of a plain device-to-device copy measured here), and whether the values
  equal the torch path's on the same device;
- per quantizer: MB/s of bf16 input (the bf16 -> float32 cast included), the same for llama.cpp's CPU quantizer
  (ggml_quantize_chunk, 2 threads, kernels/ggml/libggml.py) on the same tensor, and whether the bytes are identical.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

# nominal HBM / GDDR bandwidth (bytes/s) of parts whose properties torch may not report
_KNOWN_BANDWIDTH = {"H200": 4.8e12, "H100 SXM": 3.35e12, "H100 NVL": 3.9e12, "H100 PCIe": 2.0e12, "H100": 3.35e12,
                    "GH200": 4.0e12, "B200": 8.0e12, "A100-SXM4-80GB": 2.039e12, "A100 80GB PCIe": 1.935e12,
                    "A100": 1.555e12, "L40S": 0.864e12, "L4": 0.3e12, "RTX 4090": 1.008e12, "A10": 0.6e12}


def _nominal_bandwidth(torch, dev) -> tuple[float | None, str]:
    props = torch.cuda.get_device_properties(dev)
    clock = getattr(props, "memory_clock_rate", None)  # kHz
    width = getattr(props, "memory_bus_width", None)  # bits
    if clock and width:
        return 2.0 * clock * 1e3 * width / 8, "memory clock x bus width"
    for key, bw in _KNOWN_BANDWIDTH.items():
        if key.lower() in props.name.lower():
            return bw, f"table entry {key!r}"
    return None, "unknown part"


def _timer(torch, device):
    """(fn) -> (seconds per call, one result): CUDA events over a few repetitions on a GPU (triton.testing.do_bench),
    one call's wall time under the interpreter."""
    if device.type == "cuda":
        from triton.testing import do_bench

        return lambda fn: (do_bench(fn, warmup=5, rep=50) / 1e3, fn())

    def wall(fn):
        t = time.perf_counter()
        out = fn()
        return time.perf_counter() - t, out

    return wall


def _same_bits(torch, a, b) -> bool:
    """Equal float32 values bit for bit (NaN codes of a float grid included)."""
    a, b = a.to(torch.float32), b.to(torch.float32)
    return a.shape == b.shape and torch.equal(a.view(torch.int32), b.view(torch.int32))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--interpret", action="store_true", help="no GPU: a tiny smoke run under TRITON_INTERPRET=1")
    ap.add_argument("--rows", type=int, default=4096, help="rows of the dequantization tensors (x 8192 columns)")
    ap.add_argument("--quant-rows", type=int, default=1024, help="rows of the quantizer tensors (x 4096 columns)")
    ap.add_argument("--threads", type=int, default=2, help="threads for llama.cpp's CPU quantizer")
    args = ap.parse_args(argv)
    if args.interpret:
        os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported
        os.environ["QCONVERT_KERNELS"] = "triton"
    import numpy as np
    import torch

    if not args.interpret and not torch.cuda.is_available():
        print("bench_gpu: no CUDA device (torch sees none); run with --interpret for a smoke run under Triton's "
              "interpreter", file=sys.stderr)
        return 2
    from qconvert.kernels.ggml import kquants as kq
    from qconvert.kernels.triton import dequant as td
    from qconvert.kernels.triton import kquant as tk
    from qconvert.kernels.triton import quant as tq
    from qconvert.kernels.bitpack import pack_rows
    from qconvert.kernels.dequant import (dequantize_axis0_torch, dequantize_codebook_torch, dequantize_grid_torch,
                                          dequantize_two_step_torch)
    from qconvert.kernels.floatq import element_table
    from qconvert.kernels.ggml.libggml import available as ggml_available, ggml_quantize
    from qconvert.kernels.ggml.layouts import LAYOUTS

    if args.interpret:
        dev = torch.device("cpu")
        rows, cols, qrows, qcols = 8, 256, 2, 512
        print("device: cpu, Triton interpreter (TRITON_INTERPRET=1): a smoke run; no timing here is meaningful")
        nominal, how = None, "none (interpreter)"
    else:
        dev = torch.device("cuda")
        rows, cols, qrows, qcols = args.rows, 8192, args.quant_rows, 4096
        props = torch.cuda.get_device_properties(dev)
        nominal, how = _nominal_bandwidth(torch, dev)
        print(f"device: {props.name}, {props.total_memory / 2**30:.0f} GiB, {props.multi_processor_count} SMs, "
              f"torch {torch.__version__}, CUDA {torch.version.cuda}")
    timed = _timer(torch, dev)
    g = torch.Generator(device="cpu").manual_seed(0)

    # the practical ceiling: a device-to-device copy of a large buffer
    buf = torch.empty(rows * cols, dtype=torch.float32, device=dev)
    dst = torch.empty_like(buf)
    copy_bw = 2 * buf.numel() * 4 / timed(lambda: dst.copy_(buf))[0]
    print(f"memory bandwidth: nominal {nominal / 1e9:.0f} GB/s ({how}); " if nominal else
          f"memory bandwidth: nominal unknown ({how}); ", end="")
    print(f"device copy {copy_bw / 1e9:.0f} GB/s (measured)")

    def ratio(bw: float) -> str:
        return (f"{bw / nominal:6.1%} of nominal, " if nominal else "") + f"{bw / copy_bw:6.1%} of copy"

    print(f"\ndequantization, [{rows} x {cols}] -> float32")
    codes4 = torch.randint(0, 16, (rows, cols), dtype=torch.uint8, generator=g).to(dev)
    groups = cols // 128
    s16 = (torch.rand(rows, groups, generator=g) * 0.01).half().to(dev)
    z4 = torch.randint(0, 16, (rows, groups), dtype=torch.int16, generator=g).to(dev)
    perm = torch.randperm(cols, generator=g)
    g_idx = (torch.arange(cols) // 128)[perm].to(dev)
    words4 = pack_rows(codes4.T.contiguous(), 4)
    codes3 = (codes4 & 7)
    words3 = pack_rows(codes3.T.contiguous(), 3)
    r0 = max(1, rows // 64)
    s0 = (torch.rand(r0, cols, generator=g) * 0.01).half().to(dev)
    z0 = (torch.rand(r0, cols, generator=g) * 15).half().to(dev)
    rowg = torch.arange(rows, device=dev) % r0
    codes8 = torch.randint(0, 256, (rows, cols), dtype=torch.uint8, generator=g).to(dev)
    e4m3 = element_table("e4m3").to(dev)
    sc32 = torch.rand(rows, cols // 32, generator=g).to(dev)
    q4_0 = tq.quantize_legacy_triton("Q4_0", torch.randn(rows, cols, generator=g).to(dev))
    q4_k = tk.quantize_k_triton(torch.randn(max(1, rows // 8), cols, generator=g).to(dev), "Q4_K")
    out_bytes = rows * cols * 4
    cases = [
        ("GPTQ 4-bit words, act-order", words4.numel() * 4 + out_bytes,
         lambda: td.dequantize_gptq_words_triton(words4, 4, s16, z4, 128, g_idx),
         lambda: dequantize_grid_torch(codes4, s16, z4, 128, g_idx)),
        ("GPTQ 3-bit words", words3.numel() * 4 + out_bytes,
         lambda: td.dequantize_gptq_words_triton(words3, 3, s16, z4 & 7, 128, None),
         lambda: dequantize_grid_torch(codes3, s16, z4 & 7, 128, None)),
        ("grid codes, min form (AFQ)", codes4.numel() + out_bytes,
         lambda: td.dequantize_grid_triton(codes4, s16, z4, 128, None, mins=s16.float()),
         lambda: dequantize_grid_torch(codes4, s16, z4, 128, None, mins=s16.float())),
        ("HQQ axis 0, fp16 compute", codes4.numel() + out_bytes,
         lambda: td.dequantize_axis0_triton(codes4, s0, z0, rowg, compute_dtype=torch.float16),
         lambda: dequantize_axis0_torch(codes4, s0, z0, rowg, torch.float32, compute_dtype=torch.float16)),
        ("codebook FP8 E4M3, 32-blocks", codes8.numel() + out_bytes,
         lambda: td.dequantize_codebook_triton(codes8, sc32, e4m3, 32),
         lambda: dequantize_codebook_torch(codes8, sc32, e4m3, 32)),
        ("two-step (LLM.int8)", codes8.numel() + out_bytes,
         lambda: td.dequantize_two_step_triton(codes8, z4[:, :1].to(torch.uint8), sc32[:, :1], 1 / 127, cols),
         lambda: dequantize_two_step_torch(codes8, z4[:, :1].to(torch.uint8), sc32[:, :1], 1 / 127, cols)),
        ("GGUF Q4_0 blocks", q4_0.numel() + out_bytes,
         lambda: td.decode_legacy_triton("Q4_0", q4_0), None),
        ("GGUF Q4_K blocks", q4_k.numel() + q4_k.shape[0] * cols * 4,
         lambda: td.decode_k_triton("Q4_K", q4_k), None),
    ]
    for name, nbytes, fn, ref in cases:
        secs, got = timed(fn)
        same = "" if ref is None else ("  = torch path" if _same_bits(torch, got, ref())
                                       else "  DIFFERS from the torch path")
        bw = nbytes / secs
        print(f"  {name:<30} {secs * 1e3:9.3f} ms {bw / 1e9:9.1f} GB/s  {ratio(bw)}{same}")

    print(f"\nquantizers, bf16 [{qrows} x {qcols}] in; llama.cpp: ggml_quantize_chunk on the CPU, "
          f"{args.threads} threads")
    xb = (torch.randn(qrows, qcols, generator=g) * 0.02).to(torch.bfloat16)
    x_dev = xb.to(dev)
    x32 = xb.to(torch.float32).numpy()
    imatrix = (torch.rand(qcols, generator=g) + 0.01).numpy()
    im_dev = torch.from_numpy(imatrix).to(dev)
    mb = xb.numel() * 2 / 1e6
    have_ggml = ggml_available()
    if not have_ggml:
        print("  (llama-cpp-python is not installed: no llama.cpp comparison)")
    jobs = [(name, None) for name in ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0")]
    jobs += [(name, im) for name in kq.K_TYPES for im in (None, imatrix)]
    for name, im in jobs:
        if LAYOUTS[name].kind == "legacy":
            fn = (lambda name=name: tq.quantize_legacy_triton(name, x_dev.to(torch.float32)))
        else:
            fn = (lambda name=name, im=im: tk.quantize_k_triton(x_dev.to(torch.float32), name,
                                                               None if im is None else im_dev))
        secs, got = timed(fn)
        label = name + (" imatrix" if im is not None else "")
        line = f"  {label:<14} triton {mb / secs:10.1f} MB/s"
        if have_ggml:
            t = time.perf_counter()
            ref = ggml_quantize(x32, name, im, threads=args.threads)
            cpu = time.perf_counter() - t
            same = np.array_equal(got.cpu().numpy(), ref)
            line += (f"   llama.cpp {mb / cpu:8.1f} MB/s   x{cpu / secs:7.1f}   "
                     f"bytes {'identical' if same else 'DIFFER'}")
        print(line, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
