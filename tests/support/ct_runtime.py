"""compressed-tensors' runtime as an oracle: our values as it holds them, and transformers loading a
compressed-tensors checkpoint through it (tests/formats/compressed_tensors/test_compressed_tensors.py,
tests/formats/common/test_float_grids.py). Importing this module skips a test (module) where compressed-tensors is
not installed."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("compressed_tensors", reason="compressed-tensors is the consumer (scripts/test_env.d/40-...)")


def _as_runtime(rec, dtype: torch.dtype) -> torch.Tensor:
    """Our values as compressed-tensors' runtime holds them: grids rounded once to its compute dtype. Its fp4
    decompression (nvfp4 / mxfp4) computes in float32 and returns bf16 (compressors/nvfp4 unpack_fp4_from_uint8's
    dtype), and its mxfp8 one multiplies in bf16, which a loader then casts to the model's dtype: two roundings
    there."""
    item = rec.load()
    if not rec.is_grid:
        return item.tensor
    w = item.dequantize(torch.float32)
    if rec.params.element == "e2m1" or rec.params.scales.dtype == torch.float8_e8m0fnu:
        # mxfp8-quantized too: compressors/mxfp8 decodes the E8M0 exponents to bfloat16 (decompress_mx_scale)
        # and multiplies in that dtype, so a product below bfloat16's precision rounds there first
        w = w.to(torch.bfloat16)
    return w.to(dtype)


def _ct_model(path: Path, dtype=torch.float32):
    """transformers 5.24 + compressed-tensors 0.19, decompressed (the runtime's own dequantization)."""
    from transformers import AutoModelForCausalLM
    from transformers.utils.quantization_config import CompressedTensorsConfig

    return AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype,
                                                quantization_config=CompressedTensorsConfig(dequantize=True))
