"""Probes for tests/e2e/test_triton_conversion.py, each run in its own process: Triton's CPU interpreter must be chosen
(TRITON_INTERPRET=1) before triton is imported, and the pytest process may have imported it already.

    python tests/support/triton_probes.py kernels   every Triton kernel against the CPU path (and llama.cpp's C)
    python tests/support/triton_probes.py convert DIR HF GPTQ HQQ   the tiny-model conversions, default and Triton runs
    python tests/support/triton_probes.py ptx       the kernels compiled for an H200 (sm_90): no FMA, no approximations

Each prints one JSON line that the test reads.
"""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path

import numpy as np
import torch

F32 = np.float32


def _legacy_inputs() -> torch.Tensor:
    """5 rows x 96 (3 blocks a row): blocks of zeros (+0, -0, mixed), denormals, ties of +a/-a, huge values whose
    max - min overflows, one NaN-free block per magnitude from 1e-38 to 3e38."""
    g = torch.Generator().manual_seed(5)
    scale = torch.tensor([1e-38, 1e-6, 1.0, 1e4, 1e37])[:, None]
    x = torch.randn(5, 96, generator=g) * scale
    x[0, :32] = 0.0
    x[0, 32:48] = -0.0
    x[1, :32] = -0.0
    x[1, 40] = 1e-45  # the smallest denormal: 1/d overflows
    x[2, 64:96] = torch.tensor([-1.0, 1.0]).repeat(16)  # +a and -a: the first one is C's max
    x[3, 0:32] = torch.arange(32.0) - 16  # exact halves after scaling
    x[4, 32:64] = 3e38
    x[4, 35] = -3e38  # max - min overflows to inf
    x[2, 1] = float(F32(0.5) - F32(2 ** -25)) * x[2, :32].abs().max() / 127 * 127  # near a roundf tie
    return x


def _k_inputs() -> tuple[np.ndarray, np.ndarray]:
    """3 rows x 768 (9 super-blocks): one all zero, zero and sub-GROUP_MAX_EPS sub-blocks, heavy tails, many ties,
    all-positive and all-negative blocks, magnitudes from 1e-30 to 1e30; an importance vector with zeros."""
    rng = np.random.default_rng(11)
    x = rng.standard_normal((3, 768)).astype(F32)
    x[0, :256] = 0
    x[0, 256:272] = 0
    x[0, 300:320] = 1e-20
    x[0, 512:768] = (rng.integers(-3, 4, 256) * 0.5).astype(F32)
    x[1, :256] = (rng.standard_t(2, 256) * 0.02).astype(F32)
    x[1, 256:512] = np.abs(x[1, 256:512]) + 5
    x[1, 512:768] = -np.abs(x[1, 512:768]) * F32(1e-30)
    x[2, :256] *= F32(1e30)
    x[2, 256:512] = np.where(rng.random(256) < 0.9, 0, x[2, 256:512]).astype(F32)
    im = (rng.random(768) ** 3).astype(F32)
    im[rng.random(768) < 0.1] = 0
    return x, im


def probe_kernels() -> dict:
    from qconvert.converters.records import Grid, GridParams, PackedCodes
    from qconvert.kernels import dequantize_grid, kernel_trace
    from qconvert.kernels.ggml import kquants as kq
    from qconvert.kernels.triton import dequant as td, kquant as tk, quant as tq
    from qconvert.kernels.bitpack import pack_rows
    from qconvert.kernels.dequant import (dequantize_axis0_torch, dequantize_codebook_torch, dequantize_grid_torch,
                                          dequantize_two_step_torch)
    from qconvert.kernels.floatq import element_table
    from qconvert.kernels.ggml.libggml import ggml_quantize
    from qconvert.kernels.ggml.layouts import LAYOUTS
    from qconvert.kernels.ggml.legacy import decode_blocks, pack_blocks, quantize_blocks, repack_grid
    from qconvert.kernels.ggml.gptq_q4_0 import gptq4_to_q4_0

    os.environ["QCONVERT_KERNELS"] = "torch"  # the CPU references below must not route to Triton themselves
    done: dict[str, int] = {}

    def check(kind: str, ok: bool, what) -> None:
        if not ok:
            raise AssertionError(f"{kind}: {what}")
        done[kind] = done.get(kind, 0) + 1

    g = torch.Generator().manual_seed(3)
    # legacy quantizers: against the eager CPU path, the fused (torch.compile) one and llama.cpp's C
    x = _legacy_inputs()
    for name in ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"):
        lay = LAYOUTS[name]
        got = tq.quantize_legacy_triton(name, x)
        check("legacy quantize", torch.equal(got, pack_blocks(lay, *quantize_blocks(lay, x))), name)
        check("legacy quantize", np.array_equal(got.numpy(), ggml_quantize(x.numpy(), name)), f"{name} vs ggml")
        dec = td.decode_legacy_triton(name, got)  # bits compared: a block whose fp16 d overflowed decodes to NaN
        check("legacy decode", torch.equal(dec.view(torch.int32), decode_blocks(lay, got).view(torch.int32)), name)
        # a grid's codes into blocks (repack_grid), act-order groups that still hold whole blocks
        bits = min(lay.bits, 4)
        codes = torch.randint(0, 2 ** bits, (3, 128), dtype=torch.uint8, generator=g)
        scales = (torch.rand(3, 4, generator=g) * 0.1).half()
        zeros = torch.randint(0, 2 ** bits, (3, 4), dtype=torch.int16, generator=g)
        mins = -(torch.rand(3, 4, generator=g)).half() if lay.has_min else None
        block_group = torch.tensor([2, 0, 3, 1])
        os.environ["QCONVERT_KERNELS"] = "triton"
        via_route = repack_grid(lay, codes, scales, zeros, block_group, mins=mins)
        os.environ["QCONVERT_KERNELS"] = "torch"
        check("repack", torch.equal(via_route, repack_grid(lay, codes, scales, zeros, block_group, mins=mins)), name)
    codes = torch.randint(0, 16, (5, 256), dtype=torch.uint8, generator=g)
    words = pack_rows(codes.T.contiguous(), 4)
    bs = (torch.rand(5, 8, generator=g) * 0.1).half()
    check("repack", torch.equal(tq.gptq4_to_q4_0_triton(words, bs), gptq4_to_q4_0(words, bs)), "gptq words -> Q4_0")

    # K quantizers, with and without an importance matrix: against the CPU path and llama.cpp's C
    xk, im = _k_inputs()
    for name in ("Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"):
        for imx in (None, im):
            got = tk.quantize_k_triton(torch.from_numpy(xk), name, None if imx is None else torch.from_numpy(imx))
            got = got.numpy()
            tag = f"{name}{' imatrix' if imx is not None else ''}"
            cpu, ggml = kq.quantize_k(xk, name, imatrix=imx), ggml_quantize(xk, name, imx)
            check("K quantize", np.array_equal(got, ggml), f"{tag} vs ggml")
            # the CPU path is ggml's bytes too: the numpy Q3_K with an imatrix once differed from ggml where
            # 2*sum(x*x) overflows float32 (|x| ~ 1e30 here); the imatrix K types now run ggml's algorithm in C
            # (kernels/ggml/kquant_imatrix_c.c), so no block may differ; Triton follows ggml either way
            nb = tk.K_BLOCK_BYTES[name]
            off_cpu = (got.reshape(-1, nb) != cpu.reshape(-1, nb)).any(1)
            cpu_off_ggml = (cpu.reshape(-1, nb) != ggml.reshape(-1, nb)).any(1)
            check("K quantize", not (off_cpu & ~cpu_off_ggml).any(), f"{tag} vs the CPU path")
            done["K blocks where the CPU path is not ggml's"] = done.get(
                "K blocks where the CPU path is not ggml's", 0) + int(off_cpu.sum())
        dec = td.decode_k_triton(name, torch.from_numpy(got)).numpy()
        check("K decode", np.array_equal(dec.view(np.int32), kq.dequantize_k(got, name).view(np.int32)), name)

    # grid dequantization, every form, against the torch path
    out_f, in_f = 12, 192
    for bits in (2, 3, 4, 8):
        for group in (32, 64):
            n_groups = in_f // group
            codes = torch.randint(0, 2 ** bits, (out_f, in_f), dtype=torch.uint8, generator=g)
            scales = (torch.rand((out_f, n_groups), generator=g) * 0.02).half()
            zeros = torch.randint(0, 2 ** bits, (out_f, n_groups), dtype=torch.int16, generator=g)
            perm = torch.randperm(in_f, generator=g)
            for g_idx in (None, (torch.arange(in_f) // group)[perm]):
                ref = dequantize_grid_torch(codes, scales, zeros, group, g_idx)
                words = pack_rows(codes.T.contiguous(), bits)
                got = td.dequantize_gptq_words_triton(words, bits, scales, zeros, group, g_idx)
                check("gptq words", torch.equal(got, ref), (bits, group))
    for cd in (torch.float32, torch.float16, torch.bfloat16):  # AFQ / AWQ-style min and zero forms in their dtype
        codes = torch.randint(0, 16, (7, 96), dtype=torch.uint8, generator=g)
        scales = (torch.rand(7, 3, generator=g) * 0.1).to(torch.float16)
        zeros = torch.randint(0, 16, (7, 3), dtype=torch.int16, generator=g)
        mins = -(torch.rand(7, 3, generator=g) * 0.5).to(torch.float32)
        for m in (None, mins):
            ref = dequantize_grid_torch(codes, scales, zeros, 32, None, mins=m, compute_dtype=cd)
            got = td.dequantize_grid_triton(codes, scales, zeros, 32, None, mins=m, compute_dtype=cd)
            check("grid", torch.equal(got, ref.to(torch.float32)), (cd, m is None))
        # HQQ axis 0: natural and permuted row groups, float zeros
        codes = torch.randint(0, 16, (24, 40), dtype=torch.uint8, generator=g)
        s = (torch.rand(8, 40, generator=g) * 0.1).to(torch.float16)
        z = (torch.rand(8, 40, generator=g) * 15).to(cd)
        for rows in (torch.arange(24) % 8, torch.randperm(24, generator=g) % 8):
            ref = dequantize_axis0_torch(codes, s, z, rows, torch.float32, compute_dtype=cd)
            got = td.dequantize_axis0_triton(codes, s, z, rows, torch.float32, compute_dtype=cd)
            check("axis0", torch.equal(got, ref), cd)
    # codebooks: NF4-like table, FP8 E4M3 with a partial last group, FP4 E2M1 with a post scale
    tables = [(torch.linspace(-1, 1, 16), 4, 64, None), (element_table("e4m3"), 8, 48, None),
              (element_table("e2m1", negative_zero=False), 4, 16, torch.tensor(0.37))]
    for table, bits, group, post in tables:
        codes = torch.randint(0, 2 ** bits, (6, 100), dtype=torch.uint8, generator=g)
        sc = torch.rand(6, -(-100 // group), generator=g) + 0.01
        ref = dequantize_codebook_torch(codes, sc, table, group, post_scale=post)
        got = td.dequantize_codebook_triton(codes, sc, table, group, post_scale=post)
        check("codebook", torch.equal(got, ref), (bits, group))
    codes = torch.randint(0, 256, (6, 64), dtype=torch.uint8, generator=g)
    z8 = torch.randint(0, 256, (6, 2), dtype=torch.uint8, generator=g)
    pre = torch.rand(6, 2, generator=g) * 100
    check("two-step", torch.equal(td.dequantize_two_step_triton(codes, z8, pre, 1 / 127, 32),
                                  dequantize_two_step_torch(codes, z8, pre, 1 / 127, 32)), "LLM.int8")

    def u8(*shape, top=16):
        return torch.randint(0, top, shape, dtype=torch.uint8, generator=g)

    # the readers' unpacking, through the functions the readers call (the Triton route under QCONVERT_KERNELS=triton,
    # the torch path under =torch): HQQ's slabs, every packing, an odd column count, 3-bit's padded rows and words
    # with the unused top bits set; QQQ's Marlin tiles in both modes, and the grouped mode's int8 rounding and clamp
    # (ties, huge, infinite and tiny scales)
    from qconvert.kernels.hqq import PACKINGS as HQQ_PACKINGS, pack_hqq, unpack_hqq
    from qconvert.kernels.qqq_perm import int8_weights, pack_qqq_codes, qqq_codes, unpack_qqq_codes

    def both(fn, *args):
        os.environ["QCONVERT_KERNELS"] = "triton"
        with kernel_trace() as used:
            got = fn(*args)
        os.environ["QCONVERT_KERNELS"] = "torch"
        with kernel_trace() as cpu_used:
            ref = fn(*args)
        return got, ref, used, cpu_used

    for pk in HQQ_PACKINGS.values():
        for rows in ((40, 37) if pk.name == "3bit_32" else (pk.per_word * 5,)):
            codes = torch.randint(0, 2 ** pk.field_bits, (rows, 13), dtype=torch.uint8, generator=g)
            words = pack_hqq(codes, pk)
            if pk.name == "3bit_32":
                words = words | torch.tensor(-2 ** 31 | 2 ** 30, dtype=torch.int32)  # bits 31, 30: not codes
            got, ref, used, cpu_used = both(unpack_hqq, words, pk, rows)
            check("hqq unpack", torch.equal(got, codes) and torch.equal(ref, codes) and used == {"unpack": ["triton"]}
                  and cpu_used == {"unpack": ["torch"]}, (pk.name, rows))
    codes = torch.randint(0, 16, (128, 64), dtype=torch.uint8, generator=g)  # [out, in]: two 1024-code runs a row
    ladder = torch.tensor([0.5, 1.5, 2.5, -0.5, 1e-3, 60000.0, float("inf"), -float("inf"), 3.0, 0.0])
    s_group = ladder[torch.randint(0, len(ladder), (128, 4), generator=g)].half()
    for mode in ("grouped", "channel"):
        B = pack_qqq_codes(codes, mode)
        got, ref, used, _ = both(qqq_codes, B, mode)
        check("qqq", torch.equal(got, codes) and torch.equal(ref, unpack_qqq_codes(B, mode))
              and used == {"unpack": ["triton"]}, mode)
    B = pack_qqq_codes(codes, "grouped")
    got, ref, used, _ = both(qqq_codes, B, "grouped", s_group, 16)
    want = (int8_weights(codes, s_group, 16) + 128).to(torch.uint8)
    check("qqq", torch.equal(got, want) and torch.equal(ref, want) and used == {"unpack": ["triton"]}, "int8")
    nan = s_group.clone()
    nan[3, 1] = float("nan")  # with inf * 0 above: NaN products, code 128 (weight 0) on both paths
    got, ref, used, _ = both(qqq_codes, B, "grouped", nan, 16)
    check("qqq", torch.equal(got, ref) and bool((got[3, 16:32] == 128).all()) and used == {"unpack": ["triton"]},
          "NaN")

    # the other readers' bit streams, through each reader's own unpacking function: odd row counts, widths that
    # straddle words (3, 5, 6, 7 bits), a row's last word partly used, AWQ's GEMM order, bitsandbytes' high nibble
    # first over a flat odd-length buffer, auto-round's column streams
    from qconvert.formats.auto_round.reader import unpack_stream as auto_round_stream
    from qconvert.formats.awq.layout import unpack_codes as awq_codes, unpack_gemm, unpack_stream as awq_stream
    from qconvert.formats.bitsandbytes.reader import unpack_4bit
    from qconvert.formats.compressed_tensors.schemes import unpack_dense
    from qconvert.formats.mlx.packing import unpack_mlx
    from qconvert.formats.uqff.codecs.afq import unpack_afq
    from qconvert.kernels.floatq import unpack_fp4

    def words32(rows, n):
        return torch.randint(-2 ** 31, 2 ** 31, (rows, n), dtype=torch.int64, generator=g).to(torch.int32)

    streams = [("fp4", unpack_fp4, (u8(5, 7, top=256),)), ("fp4 3-d", unpack_fp4, (u8(2, 3, 8, top=256),)),
               ("mlx 3", unpack_mlx, (words32(5, 3), 3, 32)), ("mlx 5", unpack_mlx, (words32(5, 5), 5, 32)),
               ("mlx 6", unpack_mlx, (words32(4, 3), 6, 16)), ("afq 6", unpack_afq, (words32(4, 3), 6, 16)),
               ("afq 3", unpack_afq, (words32(4, 3), 3, 32)), ("ct 4", unpack_dense, (words32(6, 3), 4, 20)),
               ("ct 8", unpack_dense, (words32(6, 3), 8, 12)), ("awq gemm", unpack_gemm, (words32(5, 4),)),
               ("awq gemm cut", awq_codes, (words32(5, 4), 4, 29)), ("awq 3", awq_stream, (words32(5, 4), 3, 40)),
               ("awq 7", awq_stream, (words32(5, 4), 7, 18)), ("bnb", unpack_4bit, (u8(13, 1, top=256), 5, 5)),
               ("auto-round 5", auto_round_stream, (words32(10, 3), 5)),
               ("auto-round 7", auto_round_stream, (words32(14, 2), 7))]
    for tag, fn, args in streams:
        got, ref, used, cpu_used = both(fn, *args)
        check("bit streams", torch.equal(got, ref) and used == {"unpack": ["triton"]}
              and cpu_used == {"unpack": ["torch"]}, tag)

    # the dispatch: kernels.dequantize_grid takes the Triton path under QCONVERT_KERNELS=triton and says so
    os.environ["QCONVERT_KERNELS"] = "triton"

    grids = [  # GPTQ-style zero points, HQQ axis 0 with float zeros, an E2M1 codebook, 3-bit GPTQ words
        Grid(GridParams(bits=4, group_size=64, scales=scales[:, :2], zeros=zeros[:, :2]), codes=u8(7, 128)),
        Grid(GridParams(bits=4, group_size=3, scales=s, zeros=z.float(), axis=0), codes=u8(24, 40)),
        Grid(GridParams(bits=4, group_size=16, scales=torch.rand(6, 4, generator=g), zeros=torch.zeros(6, 4),
                        codebook=element_table("e2m1")), codes=u8(6, 64)),
        Grid(GridParams(bits=3, group_size=32, scales=scales, zeros=zeros),
             packed=PackedCodes(pack_rows(u8(96, 7, top=8), 3), 3, "gptq-rows"))]
    for grid in grids:
        with kernel_trace() as used:
            got = dequantize_grid(grid, torch.bfloat16)
        os.environ["QCONVERT_KERNELS"] = "torch"
        with kernel_trace() as cpu_used:
            ref = dequantize_grid(grid, torch.bfloat16)
        os.environ["QCONVERT_KERNELS"] = "triton"
        check("dispatch", torch.equal(got, ref) and used == {"dequantize": ["triton"]}
              and "triton" not in cpu_used.get("dequantize", []), (grid.params.axis, used, cpu_used))
    return done


PRODUCED = Path(__file__).resolve().parent.parent / "producer_fixtures"


def probe_convert(work: Path, hf: Path, gptq: Path, hqq: Path, qqq: Path) -> dict:
    """Each conversion twice in this process, the default run (QCONVERT_KERNELS unset) and QCONVERT_KERNELS=triton:
    the bytes, the measured errors and each run's per-tensor kernels. hf, gptq, hqq, qqq: the tiny models."""
    from qconvert.converters.apps.cli import main

    jobs = {"hf_q4_k_m": ("hf->gguf", hf, "--type", "q4_k_m", "--allow-requant"),
            "gptq_q4_0": ("gptq->gguf", gptq),
            "gptq_q4_k": ("gptq->gguf", gptq, "--type", "q4_k", "--allow-requant"),
            "hqq_axis0": ("hqq->gguf", hqq, "--allow-requant"),
            "qqq_g128": ("qqq->gguf", qqq),
            # committed producers' checkpoints: their readers' bit streams
            "ct_w4a16": ("ct->gguf", PRODUCED / "compressed_tensors" / "w4a16_g32_sym"),
            "awq_g128": ("awq->gguf", PRODUCED / "awq" / "gemm_g128")}
    results = {}
    for tag, (pair, src, *extra) in jobs.items():
        runs = {}
        for mode in ("default", "triton"):
            if mode == "default":
                os.environ.pop("QCONVERT_KERNELS", None)
            else:
                os.environ["QCONVERT_KERNELS"] = "triton"
            out, report = work / f"{tag}-{mode}.gguf", work / f"{tag}-{mode}.json"
            rc = main([pair, str(src), str(out), "--report", str(report), "--quiet", "--force", *extra])
            if rc != 0:
                raise AssertionError(f"{tag} {mode}: exit {rc}")
            runs[mode] = (out.read_bytes(), json.loads(report.read_text())["tensors"])
        (a, ta), (b, tb) = runs["default"], runs["triton"]
        results[tag] = {"identical": a == b, "bytes": len(a),
                        "tensors": [{"name": x["name"], "target": x["target"], "default": x.get("kernel"),
                                     "triton": y.get("kernel"),
                                     "same_error": (x["max_abs_err"], x["rmse"]) == (y["max_abs_err"], y["rmse"])}
                                    for x, y in zip(ta, tb)]}
    return results


def probe_ptx() -> dict:
    """Compile one variant of every kernel (every K quantizer with and without an imatrix) for sm_90, as the H200
    runs them (enable_fp_fusion=False), through Triton's own ptxas; scan the PTX for what would break the bytes:
    fused multiply-adds, approximate or flush-to-zero float operations."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from qconvert.kernels.triton import dequant as td, kquant as tk, quant as tq

    calls = []

    def record(kernel, grid, *args, **kwargs):  # the launches a quantization makes, not run
        calls.append((kernel, args, kwargs))

    td.launch = tq.launch = tk.launch = record
    x = torch.randn(2, 256)
    tq.quantize_legacy_triton("Q5_1", x)  # (x - min)*id + 0.5: the legacy expression an FMA would change
    for name in ("Q2_K", "Q3_K", "Q4_K"):  # every K kernel and branch (Q5_K, Q6_K: the same kernels, other sizes)
        tk.quantize_k_triton(x, name)
        tk.quantize_k_triton(x, name, torch.rand(256))
    tk.quantize_k_triton(x, "Q6_K")
    td.decode_k_triton("Q5_K", torch.zeros(1, 176, dtype=torch.uint8))
    td.decode_legacy_triton("Q5_1", torch.zeros(1, 24, dtype=torch.uint8))
    td.dequantize_axis0_triton(torch.zeros(8, 64, dtype=torch.uint8), torch.ones(2, 64), torch.ones(2, 64),
                               torch.arange(8) % 2, compute_dtype=torch.bfloat16)
    td.dequantize_grid_triton(torch.zeros(8, 64, dtype=torch.uint8), torch.ones(8, 2).half(),  # s*q + m: no FMA
                              torch.zeros(8, 2, dtype=torch.int16), 32, None, mins=torch.ones(8, 2))
    td.dequantize_gptq_words_triton(torch.zeros(6, 8, dtype=torch.int32), 3, torch.ones(8, 2), torch.zeros(8, 2), 32,
                                    None)
    td.dequantize_codebook_triton(torch.zeros(8, 64, dtype=torch.uint8), torch.ones(8, 4), torch.randn(16), 16,
                                  post_scale=torch.tensor(2.0))
    td.dequantize_two_step_triton(torch.zeros(8, 64, dtype=torch.uint8), torch.zeros(8, 1, dtype=torch.uint8),
                                  torch.ones(8, 1), 1 / 127, 64)
    td.unpack_hqq_triton(torch.zeros(4, 64, dtype=torch.int32), 3, 10, 37)
    td.qqq_codes_triton(torch.zeros(4, 128, dtype=torch.int32), torch.arange(1024), torch.ones(64, 4).half(), 16)
    td.unpack_bitstream_triton(torch.zeros(4, 3, dtype=torch.int32), 5, 16)
    td.unpack_bitstream_triton(torch.zeros(4, 3, dtype=torch.uint8), 4, 6, word_bits=8, order=(1, 0))
    types = {torch.float32: "*fp32", torch.uint8: "*u8", torch.int32: "*i32", torch.int8: "*i8",
             torch.int64: "*i64", torch.int16: "*i16", torch.float16: "*fp16"}
    seen, bad, compiled = set(), [], []
    for kernel, args, kwargs in calls:
        sig, consts, it = {}, {}, iter(args)
        for p in kernel.params:
            if p.is_constexpr:
                consts[p.name] = kwargs.get(p.name, p.default)
                sig[p.name] = "constexpr"
            else:
                v = next(it)
                sig[p.name] = types[v.dtype] if isinstance(v, torch.Tensor) else (
                    "fp32" if isinstance(v, float) else "i32")
        # one compilation per kernel and imatrix branch (a cold compile costs about half a second); the packing
        # kernels are integer code only
        key = (kernel.fn.__name__, consts.get("IMATRIX"))
        if key in seen or kernel.fn.__name__ in ("_pack_k_kernel", "_pack_legacy_kernel", "_gptq_q4_0_kernel"):
            continue
        seen.add(key)
        c = triton.compile(ASTSource(fn=kernel, signature=sig, constexprs=consts), target=GPUTarget("cuda", 90, 32),
                           options={"enable_fp_fusion": False})
        compiled.append(kernel.fn.__name__)
        for pattern in (r"\bfma\.rn\.f32", r"\bmad\.\S*f32", r"div\.full", r"div\.approx", r"sqrt\.approx",
                        r"rcp\.approx", r"\.ftz\b"):
            if re.search(pattern, c.asm["ptx"]):
                bad.append(f"{kernel.fn.__name__} {consts}: {pattern}")
        if "cubin" not in c.asm:
            bad.append(f"{kernel.fn.__name__}: no cubin")
    return {"compiled": compiled, "bad": bad}


if __name__ == "__main__":
    what = sys.argv[1]
    if what == "kernels":
        result = probe_kernels()
    elif what == "convert":
        result = probe_convert(*map(Path, sys.argv[2:7]))
    else:
        result = probe_ptx()
    print("RESULT " + json.dumps(result))
