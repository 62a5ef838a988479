"""Benchmark: the aligned repack GPTQ 4-bit g128 -> Q4_0 against its peers, on one core.

Builds (or reuses) a synthetic GPTQ llama of at least 1 GB of bf16-equivalent weights and reports, in
MB/s of bf16-equivalent weights (2 bytes per weight) per core:

  qconvert repack kernel     GPTQ words -> Q4_0 bytes (kernels.gptq_q4_0), the conversion's hot path
  qconvert end to end        `qconvert gptq->gguf` in-process: read shards, plan, repack, prove each
                             tensor by decoding it back to the source words, write the GGUF
  llama.cpp quantizer        ggml_quantize_chunk(Q4_0) from float32 (llama-quantize's kernel; its input
                             here is the dequantized weight, as a bf16->Q4_0 run would see it)
  gguf-py quantizer          gguf.quants.quantize(Q4_0) in numpy, from float32
  numpy GPTQ dequant         unpack + scale to bf16 in plain numpy (what a float round trip costs)

and the ratio of each peer to the repack kernel. Timings are the best of --repeat runs; tests never
assert on them. Torch and numpy are pinned to one thread.

    python scripts/bench_repack.py [--work DIR] [--gb 1.0] [--repeat 2]
"""

from __future__ import annotations

import argparse
import ctypes
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import numpy as np  # noqa: E402
import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from synthetic_gptq import make_synthetic_gptq  # noqa: E402

HIDDEN, INTERMEDIATE = 4096, 11008


def _best(fn, repeat):
    best = float("inf")
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def _ggml_quantize_chunk():
    """llama.cpp's quantizer from the llama-cpp-python wheel, or None when it is not installed."""
    try:
        import llama_cpp
    except ImportError:
        return None
    lib_dir = Path(llama_cpp.__file__).parent / "lib"
    lib = ctypes.CDLL(str(lib_dir / "libggml-base.so"))
    fn = lib.ggml_quantize_chunk
    fn.restype = ctypes.c_size_t
    fn.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64,
                   ctypes.c_int64, ctypes.c_void_p]
    lib.ggml_quantize_init.argtypes = [ctypes.c_int]
    lib.ggml_quantize_init(2)

    def quantize_q4_0(x: np.ndarray) -> np.ndarray:
        rows, n = x.shape
        out = np.empty((rows, n // 32 * 18), np.uint8)
        fn(2, x.ctypes.data, out.ctypes.data, 0, rows, n, None)
        return out

    return quantize_q4_0


def _numpy_dequant_bf16(qweight: np.ndarray, scales: np.ndarray, group: int) -> np.ndarray:
    shifts = np.arange(0, 32, 4, dtype=np.uint32)
    codes = (qweight.view(np.uint32)[:, None, :] >> shifts[None, :, None]) & 0xF  # [in/8, 8, out]
    codes = codes.reshape(-1, qweight.shape[1]).astype(np.float32)
    w = (codes - 8.0) * np.repeat(scales.astype(np.float32), group, axis=0)
    return (w.view(np.uint32) + 0x8000 >> 16).astype(np.uint16)  # bf16 bits (round half up; cost only)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", type=Path, default=None, help="folder for the synthetic model and output")
    ap.add_argument("--gb", type=float, default=1.0, help="bf16-equivalent size of the synthetic model")
    ap.add_argument("--repeat", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(1)

    from qconvert.converters.plan import Options
    from qconvert.converters.run import convert
    from qconvert.formats.gptq.reader import GptqSource
    from qconvert.kernels.ggml.gptq_q4_0 import gptq4_to_q4_0

    work = args.work or Path(tempfile.mkdtemp(prefix="qconvert-bench-"))
    src = work / "synthetic-gptq"
    per_layer = (4 * HIDDEN * HIDDEN + 3 * HIDDEN * INTERMEDIATE) * 2
    layers = max(1, int(np.ceil(args.gb * 1e9 / per_layer)))
    if not (src / "config.json").exists():
        info = make_synthetic_gptq(src, HIDDEN, INTERMEDIATE, layers, heads=32, kv_heads=8, shard_mb=1024)
    source = GptqSource(src)
    grids = [r for r in source.records() if r.is_grid]
    bf16_mb = sum(r.shape[0] * r.shape[1] * 2 for r in grids) / 1e6
    print(f"model: {len(grids)} GPTQ 4-bit g128 tensors ({HIDDEN}x{INTERMEDIATE} llama, {layers} layers), "
          f"{bf16_mb:.0f} MB of bf16-equivalent weights; 1 thread", flush=True)

    # the repack kernel over every tensor, data already in memory
    loaded = [r.load() for r in grids]
    inputs = []
    for g in loaded:
        p = g.params
        inputs.append((g.packed.words, p.scales[:, p.group_of_column(g.shape[1])[::32]].to(torch.float16)))
    t_kernel = _best(lambda: [gptq4_to_q4_0(w, s) for w, s in inputs], args.repeat)

    out = work / "out.gguf"
    t_e2e = _best(lambda: convert("gptq", src, "gguf", out, Options(), force=True, progress=False), args.repeat)

    results = [("qconvert repack kernel", t_kernel), ("qconvert end to end", t_e2e)]
    # peers on a sample of the same weights (a gate and a down projection), scaled to MB/s
    sample = [loaded[4], loaded[6]]
    sample_mb = sum(g.shape[0] * g.shape[1] * 2 for g in sample) / 1e6
    floats = [g.dequantize(torch.float32).numpy() for g in sample]
    q4 = _ggml_quantize_chunk()
    peers = []
    if q4 is not None:
        peers.append(("llama.cpp ggml_quantize_chunk Q4_0", _best(lambda: [q4(x) for x in floats], args.repeat)))
    import gguf

    peers.append(("gguf-py quants.quantize Q4_0",
                  _best(lambda: [gguf.quants.quantize(x, gguf.GGMLQuantizationType.Q4_0) for x in floats], 1)))
    np_inputs = [(g.packed.words.numpy(), g.params.scales.T.contiguous().numpy(), g.params.group_size) for g in sample]
    peers.append(("numpy GPTQ dequant to bf16", _best(lambda: [_numpy_dequant_bf16(*a) for a in np_inputs], args.repeat)))

    kernel_rate = bf16_mb / t_kernel
    print(f"{'':36} {'MB/s/core':>10} {'ratio to repack kernel':>24}")
    for name, t in results:
        rate = bf16_mb / t
        print(f"{name:36} {rate:10.0f} {rate / kernel_rate:24.3f}")
    for name, t in peers:
        rate = sample_mb / t
        print(f"{name:36} {rate:10.0f} {rate / kernel_rate:24.3f}")
    if q4 is None:
        print("llama.cpp peer skipped: llama-cpp-python is not installed (pip install -e '.[llama]')")


if __name__ == "__main__":
    main()
