"""MLX's packing of affine codes, and its quantizer rule, in torch (no mlx needed).

Packing (mlx 0.32.4, mlx/backend/cpu/quantized.cpp `extract_bits` / `quantize`): every row of codes is one
little-endian bit stream, code k at bits [k*b, (k+1)*b), cut into uint32 words [out, in*b/32]. For 2/4/8
bits a word holds 32/b codes LSB first; 3 and 5 bits pack 8 codes into 3 and 5 bytes, 6 bits 4 codes into
3 bytes, LSB first, which is the same bit stream. Checked against mx.quantize for 2..8 bits (tests/formats/mlx/test_mlx.py).
"""

from __future__ import annotations

import numpy as np
import torch

from ...kernels.triton import route as triton_route

__all__ = ["MLX_BITS", "MLX_GROUPS", "pack_mlx", "unpack_mlx", "packed_words", "mlx_affine_quantize"]

MLX_BITS = (2, 3, 4, 5, 6, 8)  # mlx 0.32.4 _qmm_dispatch_typed: "Quantization bits must be 2, 3, 4, 5, 6 or 8"
MLX_GROUPS = (128, 64, 32)  # _qmm_dispatch_group: "Quantization group size must be 32, 64 or 128" (largest first)


def packed_words(in_features: int, bits: int) -> int | None:
    """uint32 words per row of `in_features` codes, None when the row does not fill whole words."""
    total = in_features * bits
    return total // 32 if total % 32 == 0 else None


def pack_mlx(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """uint8 codes [out, in] -> torch.uint32 words [out, in*bits/32]."""
    out, n = codes.shape
    if packed_words(n, bits) is None:
        raise ValueError(f"rows of {n} {bits}-bit codes do not fill whole uint32 words")
    c = codes.to(torch.int64).numpy().astype(np.uint16)
    raw = ((c[..., None] >> np.arange(bits, dtype=np.uint16)) & 1).astype(np.uint8).reshape(out, -1)
    packed = np.packbits(raw, axis=1, bitorder="little")
    return torch.from_numpy(np.ascontiguousarray(packed).view(np.uint32).copy()).view(torch.uint32).view(out, -1)


def unpack_mlx(words: torch.Tensor, bits: int, in_features: int) -> torch.Tensor:
    """uint32 (or int32) words [out, in*bits/32] -> uint8 codes [out, in] (Triton where chosen)."""
    w = words.contiguous().view(torch.int32)
    routed = triton_route.bitstream(w, bits, in_features)
    if routed is not None:
        return routed
    out = w.shape[0]
    raw = np.unpackbits(w.numpy().view(np.uint8).reshape(out, -1), axis=1, bitorder="little")
    fields = raw.reshape(out, -1, bits)[:, :in_features].astype(np.uint16)
    codes = (fields << np.arange(bits, dtype=np.uint16)).sum(-1)
    return torch.from_numpy(codes.astype(np.uint8))


def mlx_affine_quantize(w: torch.Tensor, bits: int, group_size: int, store: torch.dtype
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """mx.quantize(w, group_size, bits) (mode "affine") in torch: (codes uint8 [out, in], scales, biases
    [out, in/group] in `store`, the dtype of the weight handed to mlx).

    mlx 0.32.4 fast::Quantize::eval_cpu (`quantize<T, U>`), per group of `group_size` along a row, all in
    float32 from the weight's own dtype: scale = max((max - min) / (2^b - 1), 1e-7), negated unless |min| >
    |max|; edge = the larger-magnitude end (min when |min| > |max|, else max); q0 = rint(edge / scale); when
    q0 != 0 the scale becomes edge / q0 and the bias edge (so the edge is hit exactly), else the bias is 0;
    codes = clip(rint((w - bias) / scale), 0, 2^b - 1) with the float32 scale and bias, which are rounded
    to the weight's dtype only when stored. rint is round-half-even, as torch.round."""
    x = w.to(store).to(torch.float32)
    out, n = x.shape
    g = x.view(out, n // group_size, group_size)
    n_bins = float((1 << bits) - 1)
    w_min, w_max = g.amin(-1), g.amax(-1)
    mask = w_min.abs() > w_max.abs()
    scale = torch.clamp((w_max - w_min) / n_bins, min=1e-7)
    scale = torch.where(mask, scale, -scale)
    edge = torch.where(mask, w_min, w_max)
    q0 = torch.round(edge / scale)
    nonzero = q0 != 0
    scale = torch.where(nonzero, edge / torch.where(nonzero, q0, torch.ones_like(q0)), scale)
    bias = torch.where(nonzero, edge, torch.zeros_like(edge))
    q = torch.clamp(torch.round((g - bias[..., None]) / scale[..., None]), 0, n_bins)
    return q.view(out, n).to(torch.uint8), scale.to(store), bias.to(store)
