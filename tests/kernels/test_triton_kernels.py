"""The Triton dequantization kernels give the torch path's results bit for bit.

No GPU here: the kernels run under Triton's CPU interpreter (TRITON_INTERPRET=1, set before triton is
imported, hence a subprocess). On a CUDA machine the same kernels compile for the GPU."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("triton", reason="Triton is installed by the test environment (pyproject extra 'triton')")

PROBE = textwrap.dedent("""
    import torch
    from qconvert.converters.records import Grid, GridParams, PackedCodes
    from qconvert.kernels import dequantize_grid, kernel_backend
    from qconvert.kernels.bitpack import pack_rows
    from qconvert.kernels.dequant import dequantize_grid_torch
    from qconvert.kernels.triton.dequant import dequantize_grid_triton, dequantize_gptq_words_triton
    assert kernel_backend(torch.zeros(1)) == "triton"
    gen = torch.Generator().manual_seed(0)
    out_f, in_f, checked = 48, 192, 0
    for bits in (2, 4, 8):
        for group in (32, 64, 192):
            n_groups = in_f // group
            codes = torch.randint(0, 2**bits, (out_f, in_f), dtype=torch.uint8, generator=gen)
            scales = (torch.rand((out_f, n_groups), generator=gen) * 0.02).to(torch.float16)
            zeros = torch.randint(0, 2**bits, (out_f, n_groups), dtype=torch.int16, generator=gen)
            mins = -(torch.rand((out_f, n_groups), generator=gen) * 0.1).to(torch.float16)
            perm = torch.randperm(in_f, generator=gen)
            for g_idx in (None, (torch.arange(in_f) // group)[perm]):
                ref = dequantize_grid_torch(codes, scales, zeros, group, g_idx)
                got = dequantize_grid_triton(codes, scales, zeros, group, g_idx)
                assert torch.equal(ref, got), ("zero form", bits, group)
                ref_m = dequantize_grid_torch(codes, scales, zeros, group, g_idx, mins=mins)
                got_m = dequantize_grid_triton(codes, scales, zeros, group, g_idx, mins=mins)
                assert torch.equal(ref_m, got_m), ("min form", bits, group)
                words = pack_rows(codes.T.contiguous(), bits)
                got_w = dequantize_gptq_words_triton(words, bits, scales, zeros, group, g_idx)
                assert torch.equal(ref, got_w), ("packed words", bits, group)
                params = GridParams(bits=bits, group_size=group, scales=scales, zeros=zeros, g_idx=g_idx)
                via_dispatch = dequantize_grid(Grid(params, packed=PackedCodes(words, bits, "gptq-rows")),
                                               torch.bfloat16)
                assert torch.equal(via_dispatch, ref.to(torch.bfloat16)), ("dispatch bf16", bits, group)
                checked += 1
    print("checked", checked)
""")


def test_triton_kernels_match_torch_bit_for_bit():
    env = {**os.environ, "TRITON_INTERPRET": "1", "QCONVERT_KERNELS": "triton"}
    proc = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip() == "checked 18"
