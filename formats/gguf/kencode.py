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

from ...kernels.ggml_layouts import BlockLayout
from ...kernels.ggml_legacy import decode_blocks, quantize_pack

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
        from ...kernels.ggml_ctypes import ggml_quantize

        return ggml_quantize(x2.numpy(), lay.name, how.imatrix if lay.kind == "k" else None,
                             threads=max(1, torch.get_num_threads()))
    if lay.kind == "legacy":
        return quantize_pack(lay, x2).numpy()
    from ...kernels import kquants as kq

    return kq.quantize_k(x2.numpy(), lay.name, imatrix=how.imatrix)


def _decode(lay: BlockLayout, data: np.ndarray, shape) -> torch.Tensor:
    if lay.kind == "legacy":
        return decode_blocks(lay, torch.from_numpy(data)).view(shape)
    from ...kernels import kquants as kq

    return torch.from_numpy(kq.dequantize_k(data, lay.name)).view(shape)


def encode_quantized(lay: BlockLayout, item, how: QuantHow) -> tuple[np.ndarray, torch.Tensor]:
    """-> (uint8 block bytes [rows, row_bytes], float32 decoded values in the item's shape)."""
    if how.keep_codes and hasattr(item, "params"):
        from ...kernels.kquant_grid import encode_grid_k, plan_kept_blocks

        fit = plan_kept_blocks(item.params, item.shape, lay.name)
        if fit is not None:
            def requantize():
                x = item.dequantize(torch.float32)
                return _quantize_rows(lay, x.reshape(-1, x.shape[-1]), how)

            data, _ = encode_grid_k(lay.name, item.codes.numpy(), fit, requantize)
            return data, _decode(lay, data, item.shape)
    x = item.dequantize(torch.float32)
    shape = x.shape
    data = _quantize_rows(lay, x.reshape(-1, shape[-1]), how)
    return data, _decode(lay, data, shape)
