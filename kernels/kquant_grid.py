"""Grid-aware Q4_K / Q5_K packing: keep a source grid's codes where the K super-block can hold its scales.

A Q4_K (Q5_K) super-block of 256 values has 8 sub-blocks of 32 and decodes, as ggml computes it in
float32, as

    y = (d * sc_j) * q - (dmin * m_j)        d, dmin fp16; sc_j, m_j integers 0..63; q 0..15 (0..31)

A grid sub-block with scale s_j and zero point z_j decodes as s_j * (q - z_j) = s_j * q - s_j * z_j
(or, in the min form, s_j * q + min_j). So the grid's codes can stay as they are exactly when there are
fp16 `d`, `dmin` and integers with  d * sc_j == s_j  and  dmin * m_j == s_j * z_j (resp. -min_j)  in
float32 for all 8 sub-blocks: per-channel grids always qualify (sc_j = 1); group grids qualify when
their scales inside a super-block are small integer multiples of one fp16 value. Blocks that do not
qualify are quantized from the dequantized values by the reference quantizer (the caller does that).

Finding d: if d exists, the largest |s_j| equals d * k for some k in 1..63, and since that quotient is
exactly representable, float32 s_max / k *is* d. So trying k = 1..63 (the first success, i.e. the
largest d, is taken) finds a solution whenever one exists. The same search gives dmin for the mins.
All super-blocks are searched at once; the loop runs over k only.
"""

from __future__ import annotations

import numpy as np

from . import kquants as kq

__all__ = ["fit_sub_block_scales", "grid_sub_blocks", "plan_kept_blocks", "encode_grid_k", "KEEPABLE_TYPES"]

F32 = np.float32
KEEPABLE_TYPES = {"Q4_K": 15, "Q5_K": 31}  # code maximum of each K type with 32-element sub-blocks
_SUB = 32
_MAX_INT = 63


def fit_sub_block_scales(targets: np.ndarray, max_int: int = _MAX_INT):
    """targets (nb, 8) float32 -> (ok [nb] bool, d fp16 [nb], ints uint8 [nb, 8]) with
    float32(d) * ints == targets exactly (all sub-blocks) where ok."""
    t = np.ascontiguousarray(targets, dtype=F32)
    nb = t.shape[0]
    a = np.abs(t)
    idx = np.argmax(a, axis=1)
    base = t[np.arange(nb), idx]  # the signed target of largest magnitude
    ok = base == 0  # an all-zero block: d = 0, every integer 0
    d = np.zeros(nb, np.float16)
    ints = np.zeros((nb, t.shape[1]), np.uint8)
    todo = np.flatnonzero(~ok & np.isfinite(base))
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        for k in range(1, max_int + 1):
            if todo.size == 0:
                break
            dk = (base[todo] / F32(k)).astype(np.float16)
            df = dk.astype(F32)[:, None]
            q = np.rint(t[todo] / df)
            good = (np.all((q >= 0) & (q <= max_int), axis=1) & np.all(df * q == t[todo], axis=1)
                    & (dk != 0) & np.isfinite(dk))
            if good.any():
                hit = todo[good]
                ok[hit] = True
                d[hit] = dk[good]
                ints[hit] = q[good].astype(np.uint8)
                todo = todo[~good]
    return ok, d, ints


def grid_sub_blocks(params, shape, code_max: int):
    """Per 32-element sub-block of a grid: (scales, offsets) float32 [out, in/32], where the grid
    decodes as scale * q - offset (offset = s*z, or -min in the min form); None when the grid cannot
    keep its codes in any block (codes wider than the type, groups that split a sub-block, axis-0
    grids, a non-float32 source dequantization, or products s*q, s*z that float32 would round)."""
    import torch

    out_features, in_features = shape
    if (getattr(params, "axis", 1) != 1 or in_features % kq.QK_K or params.bits > code_max.bit_length()
            or params.compute_dtype != torch.float32
            or not params.blocks_within_groups(in_features, _SUB)):
        return None
    group = params.group_of_column(in_features)[::_SUB]
    s = params.scales.to(torch.float32)[:, group]
    if params.mins is not None:
        off = -params.mins.to(torch.float32)[:, group]
    elif params.integer_zeros:
        # zero-point form: ggml computes s*q - s*z, the source (q - z)*s; equal when both products
        # are exact, i.e. the scale has at most 12 significant bits (fp16, bf16 scales have 11 / 8)
        bits = s.contiguous().view(torch.int32)
        if bool(((bits & 0xFFF) != 0).any()):
            return None
        off = s * params.zeros[:, group].to(torch.float32)
    else:
        return None
    return s.numpy(), off.numpy()


def plan_kept_blocks(params, shape, type_name: str):
    """(kept [nb] bool over the tensor's super-blocks, d16, sc, dmin16, m) or None (see grid_sub_blocks)."""
    code_max = KEEPABLE_TYPES.get(type_name)
    if code_max is None:
        return None
    sub = grid_sub_blocks(params, shape, code_max)
    if sub is None:
        return None
    s, off = sub
    ok_d, d16, sc = fit_sub_block_scales(s.reshape(-1, 8))
    ok_m, dmin16, m = fit_sub_block_scales(off.reshape(-1, 8))
    return ok_d & ok_m, d16, sc, dmin16, m


def encode_grid_k(type_name: str, codes: np.ndarray, fit, requantize) -> tuple[np.ndarray, np.ndarray]:
    """codes uint8 [out, in] + a plan_kept_blocks result -> (uint8 [out, row_bytes], kept [nb]).
    Kept super-blocks hold the codes as they are; the others come from `requantize()`, which returns
    the reference quantizer's bytes for the whole tensor (called only if some block is not kept)."""
    kept, d16, sc, dmin16, m = fit
    out_features, in_features = codes.shape
    nbytes = kq.BLOCK_BYTES[type_name]
    L = np.ascontiguousarray(codes, dtype=np.uint8).reshape(-1, kq.QK_K)
    packed = kq.pack_q45_K(L, sc, m, d16, dmin16, KEEPABLE_TYPES[type_name])
    if kept.all():
        data = packed
    else:
        data = np.array(requantize(), dtype=np.uint8).reshape(-1, nbytes)
        data[kept] = packed[kept]
    return data.reshape(out_features, in_features // kq.QK_K * nbytes), kept
