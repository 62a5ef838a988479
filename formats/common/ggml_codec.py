"""How a tensor planned for a quantized ggml type is encoded when the plan asked for more than the
default reference quantizer: a grid's codes kept inside Q4_K/Q5_K super-blocks, an importance
matrix (`--imatrix`), or llama.cpp's own quantizer (`--quantizer llama.cpp`).

`QuantHow` is decided at plan time (GgufWriter.plan_tensor) and carried in `TensorPlan.info["quant"]`;
`encode_quantized` runs at write time, one tensor at a time.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ...kernels.ggml.layouts import BlockLayout
from ...kernels.ggml.legacy import decode_blocks, quantize_pack

__all__ = ["QuantHow", "encode_quantized", "QUANTIZERS"]

QUANTIZERS = ("qconvert", "llama.cpp")


@dataclass(frozen=True)
class QuantHow:
    keep_codes: bool = False  # grid -> Q4_K/Q5_K: keep the codes in every super-block that can hold them
    imatrix: np.ndarray | None = None  # float32 [in_features] importance per column (K types)
    backend: str = "qconvert"  # "llama.cpp": ggml_quantize_chunk from llama-cpp-python

    @property
    def needed(self) -> bool:
        return self.keep_codes or self.imatrix is not None or self.backend != "qconvert"


def _quantize_rows(lay: BlockLayout, x2: torch.Tensor, how: QuantHow) -> np.ndarray:
    """float32 [rows, n] -> uint8 [rows, row_bytes] with the chosen quantizer."""
    if how.backend == "llama.cpp":
        from ...kernels.ggml.libggml import ggml_quantize

        return ggml_quantize(x2.numpy(), lay.name, how.imatrix if lay.kind == "k" else None,
                             threads=max(1, torch.get_num_threads()))
    if lay.kind == "legacy":
        return quantize_pack(lay, x2).numpy()
    from ...kernels.ggml import kquants as kq

    return kq.quantize_k(x2.numpy(), lay.name, imatrix=how.imatrix)


def _decode(lay: BlockLayout, data: np.ndarray, shape) -> torch.Tensor:
    if lay.kind == "legacy":
        return decode_blocks(lay, torch.from_numpy(data)).view(shape)
    from ...kernels.ggml import kquants as kq

    return torch.from_numpy(kq.dequantize_k(data, lay.name)).view(shape)


def _kept_codes(item, kept: np.ndarray) -> np.ndarray:
    """The codes of the kept super-blocks, (k, 256) uint8, in the tensor's block order. GPTQ words
    (2/4/8-bit) are unpacked for those blocks alone: on a g128 grid few blocks are kept, and unpacking the
    whole tensor's codes cost as much as its dequantization."""
    packed = getattr(item, "packed", None)
    out_features, in_features = item.shape
    if packed is None or packed.layout != "gptq-rows" or packed.bits not in (2, 4, 8):
        return item.codes.numpy().reshape(-1, 256)[kept]
    bits, per_row = packed.bits, in_features // 256
    per_word = 32 // bits
    words_per_block = 256 // per_word
    idx = np.flatnonzero(kept)
    n, block = idx // per_row, idx % per_row
    words = packed.words.numpy().view(np.uint32)  # [in * bits / 32, out]
    w = words[block[:, None] * words_per_block + np.arange(words_per_block), n[:, None]]  # (k, words per block)
    shifts = (bits * np.arange(per_word)).astype(np.uint32)
    codes = (w[:, :, None] >> shifts) & np.uint32((1 << bits) - 1)
    return codes.reshape(idx.size, 256).astype(np.uint8)


def encode_quantized(lay: BlockLayout, item, how: QuantHow, source=None) -> tuple[np.ndarray, torch.Tensor]:
    """-> (uint8 block bytes [rows, row_bytes], float32 decoded values in the item's shape). `source`: a
    callable giving the item's float32 dequantization (computed once, shared with the caller's
    measurement; writer.SourceValues), else the item is dequantized here."""
    def values() -> torch.Tensor:
        return source() if source is not None else item.dequantize(torch.float32)

    if how.keep_codes and hasattr(item, "params"):
        from ...kernels.ggml.kquant_grid import encode_grid_k, plan_kept_blocks

        fit = plan_kept_blocks(item.params, item.shape, lay.name)
        if fit is not None:
            def requantize():
                x = values()
                return _quantize_rows(lay, x.reshape(-1, x.shape[-1]), how)

            data, kept = encode_grid_k(lay.name, lambda kept: _kept_codes(item, kept), fit, requantize,
                                       shape=tuple(item.shape))
            if kept.any():  # the kept super-blocks' codes were packed by numpy (the report's "kernel")
                from ...kernels import note_kernel

                note_kernel("repack", "numpy")
            return data, _decode(lay, data, item.shape)
    x = values()
    shape = x.shape
    data = _quantize_rows(lay, x.reshape(-1, shape[-1]), how)
    return data, _decode(lay, data, shape)
