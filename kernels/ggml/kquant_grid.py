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
All super-blocks are searched at once; the loop runs over k only, and only on the super-blocks that
pass a necessary test on the scales' bits (`_may_fit`): on a GPTQ g128 grid almost none do, so
planning and writing no longer pay 63 passes over every super-block.
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
    if todo.size:
        todo = todo[_may_fit(t[todo], max_int)]
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


def _may_fit(t: np.ndarray, max_int: int) -> np.ndarray:
    """A necessary condition for fit_sub_block_scales, from the bits alone (one pass, no search): rows of
    t (k, 8) float32 for which some fp16 d and integers 0..max_int could give d * ints == t.

    Write each nonzero value as odd * 2**e (odd: its significand without trailing zero bits). A solution
    has t_j = d * k_j exactly (an fp16 d has 11 significant bits, k_j <= 63 six: the float32 product is
    exact, and far from float32's overflow and underflow), so odd(t_j) = odd(d) * odd(k_j): odd(d) divides
    g = gcd_j odd(t_j), and odd(t_j) / g <= odd(k_j) <= max_int. All nonzero t_j also share d's sign
    (k_j >= 0), and all are finite. Rows failing this cannot fit; the search runs on the others only (a
    GPTQ grid's unrelated fp16 group scales almost never pass: their odd parts are coprime)."""
    bits = t.view(np.int32)
    mag = (bits & 0x7FFFFFFF).astype(np.int64)
    exp = mag >> 23
    mant = (mag & 0x7FFFFF) | np.where(exp > 0, 0x800000, 0)
    low = mant & -mant  # lowest set bit (0 for a zero)
    odd = np.where(mant > 0, mant // np.maximum(low, 1), 0)
    g = np.gcd.reduce(odd, axis=1)
    nonzero = mag != 0
    neg = (bits < 0) & nonzero
    pos = (bits >= 0) & nonzero
    same_sign = ~(neg.any(axis=1) & pos.any(axis=1))
    return (np.all(exp < 255, axis=1) & same_sign & (g > 0)
            & np.all(odd <= max_int * np.maximum(g, 1)[:, None], axis=1))


def grid_sub_blocks(params, shape, code_max: int):
    """Per 32-element sub-block of a grid: (scales, offsets, cols), scales and offsets float32
    [out, in/256 * len(cols)] for the sub-block positions `cols` of each super-block (the positions whose
    group differs from the previous one's; the others repeat it), where the grid decodes as
    scale * q - offset (offset = s*z, or -min in the min form); None when the grid cannot
    keep its codes in any block (codes wider than the type, groups that split a sub-block, axis-0
    grids, a non-float32 source dequantization, or products s*q, s*z that float32 would round)."""
    import torch

    out_features, in_features = shape
    if (getattr(params, "axis", 1) != 1 or in_features % kq.QK_K or params.bits > code_max.bit_length()
            or params.compute_dtype != torch.float32
            or not params.blocks_within_groups(in_features, _SUB)):
        return None
    group = params.group_of_column(in_features)[::_SUB]
    cols = _distinct_columns(np.asarray(group))
    if len(cols) < 8:  # one column per group: the others repeat it
        group = group.reshape(-1, 8)[:, cols].reshape(-1)
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
    return s.numpy(), off.numpy(), cols


def plan_kept_blocks(params, shape, type_name: str):
    """(kept [nb] bool over the tensor's super-blocks, d16, sc, dmin16, m) or None (see grid_sub_blocks)."""
    code_max = KEEPABLE_TYPES.get(type_name)
    if code_max is None:
        return None
    sub = grid_sub_blocks(params, shape, code_max)
    if sub is None:
        return None
    s, off, cols = sub
    # sub-blocks of one group share their scale and offset: the fit runs on one column per group (for g128,
    # 2 of a super-block's 8), and each integer goes back to every sub-block of its group
    k = len(cols)
    ok_d, d16, sc = fit_sub_block_scales(s.reshape(-1, k))
    ok_m, dmin16, m = fit_sub_block_scales(off.reshape(-1, k))
    expand = _expand_index(cols)
    return ok_d & ok_m, d16, sc[:, expand], dmin16, m[:, expand]


def _distinct_columns(group: np.ndarray) -> list[int]:
    """Of a super-block's 8 sub-block positions, those whose group differs from the previous position's
    in some super-block (group: the group of each sub-block of a row, super-block after super-block)."""
    g = group.reshape(-1, 8)
    return [0] + [j for j in range(1, 8) if not np.array_equal(g[:, j], g[:, j - 1])]


def _expand_index(cols: list[int]) -> np.ndarray:
    """Position j of 8 -> index of its representative in `cols` (the last distinct position <= j)."""
    return np.searchsorted(np.asarray(cols), np.arange(8), side="right") - 1


def encode_grid_k(type_name: str, codes, fit, requantize, shape=None) -> tuple[np.ndarray, np.ndarray]:
    """codes uint8 [out, in] (or a function of the kept mask giving the kept super-blocks' codes (k, 256),
    with `shape` = (out, in)) + a plan_kept_blocks result -> (uint8 [out, row_bytes], kept [nb]).
    Kept super-blocks hold the codes as they are; the others come from `requantize()`, which returns
    the reference quantizer's bytes for the whole tensor (called only if some block is not kept)."""
    kept, d16, sc, dmin16, m = fit
    out_features, in_features = shape if callable(codes) else codes.shape
    nbytes = kq.BLOCK_BYTES[type_name]

    def kept_codes() -> np.ndarray:
        if callable(codes):
            return np.ascontiguousarray(codes(kept), dtype=np.uint8)
        return np.ascontiguousarray(codes, dtype=np.uint8).reshape(-1, kq.QK_K)[kept]

    if kept.all():
        data = kq.pack_q45_K(kept_codes(), sc, m, d16, dmin16, KEEPABLE_TYPES[type_name])
    else:  # only the kept super-blocks are packed (on a GPTQ g128 grid: a few percent of them)
        data = np.array(requantize(), dtype=np.uint8).reshape(-1, nbytes)
        if kept.any():
            data[kept] = kq.pack_q45_K(kept_codes(), sc[kept], m[kept], d16[kept], dmin16[kept],
                                       KEEPABLE_TYPES[type_name])
    return data.reshape(out_features, in_features // kq.QK_K * nbytes), kept
