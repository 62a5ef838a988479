"""The conversion on a GPU, checked without one: every Triton kernel (the readers' unpacking, the grid
dequantizations, the GGUF block decoders, the legacy and K quantizers with and without an imatrix, the repacks)
gives the CPU path's bytes, which are llama.cpp's; the tiny-model conversions with QCONVERT_KERNELS=triton write
the default run's bytes and name "triton" for every quantized tensor; the kernels compile for an H200 (sm_90) with
no fused multiply-add and no approximate or flush-to-zero float operation; an absent --device is refused in one
line.

The kernels run under Triton's CPU interpreter (TRITON_INTERPRET=1, set before triton is imported: hence
subprocesses, see tests/support/triton_probes.py). Nothing here runs on, or times, a GPU.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from qconvert.converters.apps.cli import main

import fixtures_qqq
from hqq_env import hqqfx  # noqa: F401  (the hqq fixtures, built by hqq's own environment)

pytest.importorskip("triton", reason="Triton is installed by the test environment (pyproject extra 'triton')")

PROBES = Path(__file__).parents[1] / "support" / "triton_probes.py"
FLOAT_TYPES = ("F32", "F16", "BF16")


def _probe(*args: str, interpret: bool = True) -> dict:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    env.pop("QCONVERT_KERNELS", None)
    if interpret:
        env["TRITON_INTERPRET"] = "1"
    else:
        env.pop("TRITON_INTERPRET", None)
    proc = subprocess.run([sys.executable, str(PROBES), *args], capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = next(s for s in proc.stdout.splitlines() if s.startswith("RESULT "))
    return json.loads(line[len("RESULT "):])


def test_every_triton_kernel_gives_the_cpu_paths_bytes():
    done = _probe("kernels")
    # counts of comparisons made: each type, form and shape listed in triton_probes.probe_kernels
    assert done == {"legacy quantize": 10, "legacy decode": 5, "repack": 6, "K quantize": 20,
                    "K blocks where the CPU path is not ggml's": 0, "K decode": 5, "gptq words": 16, "grid": 6,
                    "axis0": 6, "codebook": 3, "two-step": 1, "hqq unpack": 6, "qqq": 4, "bit streams": 16,
                    "dispatch": 4}


def test_conversions_with_triton_kernels_are_byte_identical(fx, hqqfx, tmp_path):  # noqa: F811
    hf = fx["bases"]["base"]
    gptq = fx["variants"]["v1_b4_g32_sym"]["ckpt"]
    hqq = hqqfx["root"] / "b4_g64_ax0" / "tf"
    qqq = fixtures_qqq.ensure_qqq_fixtures()["variants"]["qqq_g128"]["ckpt"]
    results = _probe("convert", str(tmp_path), str(hf), str(gptq), str(hqq), str(qqq))
    assert set(results) == {"hf_q4_k_m", "gptq_q4_0", "gptq_q4_k", "hqq_axis0", "qqq_g128", "ct_w4a16", "awq_g128"}
    targets = set()
    for tag, r in results.items():
        assert r["identical"], tag
        for t in r["tensors"]:
            assert t["same_error"], (tag, t)  # the written bytes decoded by Triton measure as by the CPU path
            assert "triton" not in json.dumps(t["default"]), (tag, t)  # the default run never takes Triton
            if t["target"] in FLOAT_TYPES:
                assert t["default"] == {} and t["triton"] == {}, (tag, t)  # copied: no kernel claimed
                continue
            targets.add(t["target"])
            # every stage of every quantized tensor ran in Triton: its dequantization (a grid source) and its
            # quantization or repack
            assert t["triton"] and set(t["triton"].values()) == {"triton"}, (tag, t)
            assert {"quantize", "repack"} & set(t["triton"]), (tag, t)
            assert set(t["triton"]) == set(t["default"]), (tag, t)  # the same stages, on the CPU path's kernels
    assert targets == {"Q4_0", "Q4_1", "Q5_0", "Q8_0", "Q4_K", "Q6_K"}
    kernels = {t["name"]: t["triton"] for t in results["gptq_q4_k"]["tensors"]}
    assert kernels["model.layers.0.mlp.down_proj.weight"] == {"dequantize": "triton", "quantize": "triton"}
    assert kernels["model.layers.0.mlp.up_proj.weight"] == {"repack": "triton"}  # the Q5_0 repack of the grid
    assert all(t["triton"] == {"repack": "triton"} for t in results["gptq_q4_0"]["tensors"]
               if t["target"] == "Q4_0")  # GPTQ words straight into Q4_0 blocks
    assert all(t["triton"] == {"unpack": "triton", "dequantize": "triton", "quantize": "triton"}
               for t in results["hqq_axis0"]["tensors"] if t["target"] == "Q4_1")  # axis-0 dequant, Q4_1 quantizer
    # QQQ's Marlin tiles and int8 clamp unpacked in Triton, the int8 grid repacked into Q8_0 blocks (exact; a layer
    # whose group scales are multiples of one channel scale goes to Q4_0)
    qqq_rows = [t for t in results["qqq_g128"]["tensors"] if t["target"] not in FLOAT_TYPES]
    assert all(t["triton"] == {"unpack": "triton", "repack": "triton"} for t in qqq_rows), qqq_rows
    assert "Q8_0" in {t["target"] for t in qqq_rows} <= {"Q8_0", "Q4_0"}, qqq_rows
    # compressed-tensors' and AWQ's bit streams unpacked in Triton, their grids repacked (Q4_0 / Q4_1)
    for tag, target in (("ct_w4a16", "Q4_0"), ("awq_g128", "Q4_1")):
        rows = [t for t in results[tag]["tensors"] if t["target"] not in FLOAT_TYPES]
        assert rows and all(t["triton"] == {"unpack": "triton", "repack": "triton"} for t in rows), (tag, rows)
        assert target in {t["target"] for t in rows}, (tag, rows)


def test_kernels_compile_for_an_h200_without_fma_or_approximations():
    # compiled, not run: Triton's NVIDIA backend and its bundled ptxas need no GPU
    result = _probe("ptx", interpret=False)
    assert result["bad"] == []
    assert set(result["compiled"]) >= {"_quant_legacy_kernel", "_qkx_kernel", "_qx_kernel", "_q3_kernel",
                                       "_weights_kernel", "_super_q45_kernel", "_super_q2_kernel",
                                       "_super_q3_kernel", "_super_q6_kernel", "_requant_kernel", "_decode_k_kernel",
                                       "_decode_legacy_kernel", "_axis0_kernel", "_grid_kernel", "_gptq_words_kernel",
                                       "_codebook_kernel", "_two_step_kernel", "_hqq_unpack_kernel", "_qqq_kernel",
                                       "_bitstream_kernel"}


def _absent_device() -> str:
    # without a GPU: `cuda` itself; with one, a device index torch does not have
    return "cuda" if not torch.cuda.is_available() else f"cuda:{torch.cuda.device_count()}"


def _cli(capsys, *args) -> tuple[int, str, str]:
    """qconvert's main() in this process (a refusal comes before any model is read: no process start needed)."""
    capsys.readouterr()
    rc = main([str(a) for a in args])
    out, err = capsys.readouterr()
    return rc, out, err


def test_an_absent_device_is_refused_in_one_line(fx, tmp_path, capsys):
    src = fx["variants"]["v1_b4_g32_sym"]["ckpt"]
    out = tmp_path / "out.gguf"
    device = _absent_device()
    rc, stdout, stderr = _cli(capsys, "gptq->gguf", src, out, "--device", device)
    lines = stderr.strip().splitlines()
    assert rc == 2 and len(lines) == 1, stderr
    assert lines[0].startswith("qconvert: error: --device") and "CUDA" in lines[0], stderr
    assert stdout == "" and list(tmp_path.iterdir()) == []  # nothing written, not even a temporary
    rc, _, stderr = _cli(capsys, "verify", src, src, "--device", device)
    assert rc == 2 and len(stderr.strip().splitlines()) == 1 and "--device" in stderr, stderr
    rc, _, stderr = _cli(capsys, "convert", src, out, "--to", "gguf", "--device", "tpu")
    assert rc == 2 and "--device expects cpu, cuda, cuda:N or auto" in stderr, stderr
    assert list(tmp_path.iterdir()) == []


def test_the_cpu_run_names_its_kernels(fx, tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("QCONVERT_KERNELS", raising=False)
    src = fx["variants"]["v1_b4_g32_sym"]["ckpt"]
    report = tmp_path / "r.json"
    rc, stdout, _ = _cli(capsys, "gptq->gguf", src, tmp_path / "out.gguf", "--type", "q4_k", "--allow-requant",
                         "--device", "cpu", "--report", report)
    assert rc == 0
    rows = {t["name"]: t for t in json.loads(report.read_text())["tensors"]}
    down = rows["model.layers.0.mlp.down_proj.weight"]["kernel"]
    assert set(down) == {"dequantize", "quantize"} and "triton" not in down.values()
    assert rows["model.layers.0.mlp.up_proj.weight"]["kernel"] == {"repack": "torch"}
    assert rows["model.norm.weight"]["kernel"] == {}
    header, *table = stdout.splitlines()
    assert header.split()[-1] == "kernel"
    assert next(line for line in table if line.startswith("model.layers.0.mlp.up_proj.weight")).endswith(" torch")
    assert next(line for line in table if line.startswith("model.norm.weight")).endswith(" -")
