"""Triton twins of the grid dequantization for CUDA tensors, giving the torch path's float32 results.

Two kernels over a [out, in] grid, one program per (row block, column block):
- `dequantize_grid_triton`: unpacked uint8 codes, zero-point form (q - z) * s or min form s * q + m,
  with an act-order index (a group per column; the contiguous case passes k // group_size).
- `dequantize_gptq_words_triton`: GPTQ's packed int32 words (2, 4, 8 bits) straight to float32,
  so a GPU never materializes the unpacked codes.

The arithmetic is the torch path's, in float32 with the same single roundings: q - z is exact for
integer zero points, one rounding for the product. In the min form s * q is exact whenever the scale
has at most 24 - bits significant bits (fp16/bf16 scales, ggml K sub-block scales), so a fused
multiply-add on the GPU rounds the same way. Outputs are float32; a bf16/fp16 result is cast by torch
outside the kernel (Triton's CPU interpreter truncates float32 -> bf16 instead of rounding).
Without a GPU these kernels run under TRITON_INTERPRET=1, which is how the tests compare them.

Beyond those two, the twins of the other grid forms and of the GGUF block decoders (same float32 operations in
the same order as the torch / numpy path, so the same bits):
- `dequantize_axis0_triton`: HQQ's axis-0 grids, (q - z[h(n), k]) * s[h(n), k], each step rounded to the grid's
  compute dtype (float32, fp16 or bf16; one float32 operation rounded once more to fp16/bf16 is the correctly
  rounded fp16/bf16 operation, 24 >= 2*11 + 2, and it is what torch's CPU half arithmetic computes);
- `dequantize_codebook_triton`: bitsandbytes NF4/FP4 and the float grids (FP8, MXFP4, NVFP4): table[q] * s, times
  the "post" global scale when there is one;
- `dequantize_two_step_triton`: bitsandbytes LLM.int8, ((q - z) * a) * c;
- `decode_legacy_triton` / `decode_k_triton`: GGUF Q4_0..Q8_0 and Q2_K..Q6_K block bytes -> float32, the
  expressions of kernels/ggml/legacy.decode_blocks and kernels/kquants.dequantize_q*_K.
The GPTQ words kernel reads 3-bit words too (codes 10 and 21 of every 32 straddle two words).
And the unpacking a reader does before a grid exists: `unpack_hqq_triton` (HQQ's 8/4/3/2/1-bit slabs) and
`qqq_codes_triton` (QQQ's Marlin tiles, with the grouped mode's int8 rounding and clamp), and
`unpack_bitstream_triton`, the little-endian bit streams most other readers store (MLX, AFQ, compressed-tensors,
AWQ's stream and GEMM nibble order, auto-round's 5-7-bit words, bitsandbytes' and the FP4 formats' nibbles).
Every launch passes enable_fp_fusion=False: no a*b+c is contracted into an FMA on a GPU.
"""

from __future__ import annotations

import os

import numpy as np
import torch
import triton
import triton.language as tl

__all__ = ["dequantize_grid_triton", "dequantize_gptq_words_triton", "dequantize_axis0_triton",
           "dequantize_codebook_triton", "dequantize_two_step_triton", "decode_legacy_triton", "decode_k_triton",
           "unpack_hqq_triton", "qqq_codes_triton", "unpack_bitstream_triton", "launch", "interpreting"]

_BLOCK_ROWS = 16
_BLOCK_COLS = 64


@triton.jit
def _grid_kernel(codes_ptr, scales_ptr, offsets_ptr, gidx_ptr, out_ptr, n_rows, n_cols, n_groups,
                 MIN_FORM: tl.constexpr, BLOCK_ROWS: tl.constexpr, BLOCK_COLS: tl.constexpr,
                 CD: tl.constexpr = 0):
    rows = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    cols = tl.program_id(1) * BLOCK_COLS + tl.arange(0, BLOCK_COLS)
    mask = (rows[:, None] < n_rows) & (cols[None, :] < n_cols)
    groups = tl.load(gidx_ptr + cols, mask=cols < n_cols, other=0)
    q = tl.load(codes_ptr + rows.to(tl.int64)[:, None] * n_cols + cols[None, :], mask=mask, other=0).to(tl.float32)
    param = rows.to(tl.int64)[:, None] * n_groups + groups[None, :]
    s = tl.load(scales_ptr + param, mask=mask, other=0.0)
    o = tl.load(offsets_ptr + param, mask=mask, other=0.0)
    # each operation rounded to the compute dtype (CD 0: float32, the plain operations; 1 fp16, 2 bf16)
    if MIN_FORM:
        w = _round_to(_round_to(s * q, CD) + o, CD)
    else:
        w = _round_to(_round_to(q - o, CD) * s, CD)
    tl.store(out_ptr + rows.to(tl.int64)[:, None] * n_cols + cols[None, :], w, mask=mask)


@triton.jit
def _gptq_words_kernel(words_ptr, scales_ptr, zeros_ptr, gidx_ptr, out_ptr, n_rows, n_cols, n_groups,
                       BITS: tl.constexpr, BLOCK_ROWS: tl.constexpr, BLOCK_COLS: tl.constexpr):
    # words: [n_cols * BITS / 32, n_rows] int32; output row n = GPTQ output channel n
    rows = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    cols = tl.program_id(1) * BLOCK_COLS + tl.arange(0, BLOCK_COLS)
    mask = (rows[:, None] < n_rows) & (cols[None, :] < n_cols)
    # one little-endian bit stream per output row, code k at bits [BITS*k, BITS*k + BITS) (kernels/bitpack.py);
    # a 3-bit code may straddle two words, the other widths never do
    pos = cols[None, :] * BITS
    w_idx = pos // 32
    shift = (pos % 32).to(tl.uint32)
    word = tl.load(words_ptr + w_idx.to(tl.int64) * n_rows + rows[:, None], mask=mask, other=0)
    word = word.to(tl.uint32, bitcast=True)
    q = word >> shift
    if BITS == 3:
        nxt = tl.load(words_ptr + (w_idx.to(tl.int64) + 1) * n_rows + rows[:, None], mask=mask & (shift > 29),
                      other=0).to(tl.uint32, bitcast=True)
        q = q | tl.where(shift > 29, nxt << ((32 - shift) & 31), 0)
    q = (q & ((1 << BITS) - 1)).to(tl.float32)
    groups = tl.load(gidx_ptr + cols, mask=cols < n_cols, other=0)
    param = rows.to(tl.int64)[:, None] * n_groups + groups[None, :]
    s = tl.load(scales_ptr + param, mask=mask, other=0.0)
    z = tl.load(zeros_ptr + param, mask=mask, other=0.0)
    tl.store(out_ptr + rows.to(tl.int64)[:, None] * n_cols + cols[None, :], (q - z) * s, mask=mask)


def _group_index(in_features: int, group_size: int, g_idx: torch.Tensor | None, device) -> torch.Tensor:
    if g_idx is not None:
        return g_idx.to(device=device, dtype=torch.int32).contiguous()
    return (torch.arange(in_features, device=device, dtype=torch.int32) // group_size).contiguous()


def _grid(n_rows: int, n_cols: int):
    return (triton.cdiv(n_rows, _BLOCK_ROWS), triton.cdiv(n_cols, _BLOCK_COLS))


def interpreting() -> bool:
    """Whether Triton runs under its CPU interpreter (TRITON_INTERPRET=1): every op is a numpy call there, so
    programs take many more elements each."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def launch(kernel, grid, *args, **kwargs) -> None:
    """kernel[grid](*args, **kwargs) without FMA contraction on a GPU (the interpreter ignores the flag and
    computes every operation separately anyway), and without numpy's overflow warnings under the interpreter
    (inf and NaN are values like any other here, as in C). An empty grid (an empty tensor) launches nothing."""
    if any(n == 0 for n in grid):
        return
    if interpreting():
        with np.errstate(all="ignore"):
            kernel[grid](*args, **kwargs)
    else:
        kernel[grid](*args, enable_fp_fusion=False, **kwargs)


def dequantize_grid_triton(codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int,
                           g_idx: torch.Tensor | None, dtype: torch.dtype = torch.float32,
                           mins: torch.Tensor | None = None, compute_dtype: torch.dtype = torch.float32
                           ) -> torch.Tensor:
    n_rows, n_cols = codes.shape
    out = torch.empty((n_rows, n_cols), dtype=torch.float32, device=codes.device)
    cd = compute_dtype
    offsets = (mins if mins is not None else zeros).to(cd).to(torch.float32).contiguous()
    scales = scales.to(cd)
    br, bc = _tiles(n_rows, n_cols)
    launch(_grid_kernel, (triton.cdiv(n_rows, br), triton.cdiv(n_cols, bc)),
        codes.contiguous(), scales.to(torch.float32).contiguous(), offsets,
        _group_index(n_cols, group_size, g_idx, codes.device), out, n_rows, n_cols, scales.shape[1],
        MIN_FORM=mins is not None, BLOCK_ROWS=br, BLOCK_COLS=bc, CD=_CD[cd])
    return out if dtype == torch.float32 else out.to(dtype)


def dequantize_gptq_words_triton(words: torch.Tensor, bits: int, scales: torch.Tensor, zeros: torch.Tensor,
                                 group_size: int, g_idx: torch.Tensor | None,
                                 dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """GPTQ qweight [in*b/32, out] (b in 2, 3, 4, 8) with scales/zeros [out, G] -> [out, in]."""
    if bits not in (2, 3, 4, 8):
        raise ValueError(f"packed Triton dequant handles 2, 3, 4 and 8 bits, not {bits}")
    n_cols = words.shape[0] * 32 // bits
    n_rows = words.shape[1]
    out = torch.empty((n_rows, n_cols), dtype=torch.float32, device=words.device)
    br, bc = _tiles(n_rows, n_cols)
    launch(_gptq_words_kernel, (triton.cdiv(n_rows, br), triton.cdiv(n_cols, bc)),
        words.contiguous(), scales.to(torch.float32).contiguous(), zeros.to(torch.float32).contiguous(),
        _group_index(n_cols, group_size, g_idx, words.device), out, n_rows, n_cols, scales.shape[1],
        BITS=bits, BLOCK_ROWS=br, BLOCK_COLS=bc)
    return out if dtype == torch.float32 else out.to(dtype)


# ---------------------------------------------------------------------------------------------------
# The other grid forms


@triton.jit
def round_bf16(x):
    """float32 -> the nearest bfloat16 value (ties to even), as float32; NaN stays NaN. Written in integers:
    Triton's interpreter truncates a float32 -> bf16 cast instead of rounding it."""
    bits = x.to(tl.int32, bitcast=True)
    r = (bits + (0x7FFF + ((bits >> 16) & 1))) & -65536
    return tl.where(x != x, x, r.to(tl.float32, bitcast=True))


@triton.jit
def _round_to(x, CD: tl.constexpr):
    # CD: 0 float32, 1 float16, 2 bfloat16 (the grid's compute dtype)
    if CD == 1:
        x = x.to(tl.float16).to(tl.float32)
    elif CD == 2:
        x = round_bf16(x)
    return x


@triton.jit
def _axis0_kernel(codes_ptr, scales_ptr, zeros_ptr, rowg_ptr, out_ptr, n_rows, n_cols,
                  CD: tl.constexpr, BLOCK_ROWS: tl.constexpr, BLOCK_COLS: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    cols = tl.program_id(1) * BLOCK_COLS + tl.arange(0, BLOCK_COLS)
    mask = (rows[:, None] < n_rows) & (cols[None, :] < n_cols)
    h = tl.load(rowg_ptr + rows, mask=rows < n_rows, other=0)
    q = tl.load(codes_ptr + rows.to(tl.int64)[:, None] * n_cols + cols[None, :], mask=mask, other=0).to(tl.float32)
    param = h.to(tl.int64)[:, None] * n_cols + cols[None, :]
    s = tl.load(scales_ptr + param, mask=mask, other=0.0)
    z = tl.load(zeros_ptr + param, mask=mask, other=0.0)
    w = _round_to(_round_to(q - z, CD) * s, CD)
    tl.store(out_ptr + rows.to(tl.int64)[:, None] * n_cols + cols[None, :], w, mask=mask)


@triton.jit
def _codebook_kernel(codes_ptr, table_ptr, scales_ptr, post_ptr, out_ptr, n_rows, n_cols, n_groups, group_size,
                     HAS_POST: tl.constexpr, BLOCK_ROWS: tl.constexpr, BLOCK_COLS: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    cols = tl.program_id(1) * BLOCK_COLS + tl.arange(0, BLOCK_COLS)
    mask = (rows[:, None] < n_rows) & (cols[None, :] < n_cols)
    q = tl.load(codes_ptr + rows.to(tl.int64)[:, None] * n_cols + cols[None, :], mask=mask, other=0).to(tl.int32)
    v = tl.load(table_ptr + q, mask=mask, other=0.0)
    param = rows.to(tl.int64)[:, None] * n_groups + (cols // group_size)[None, :]
    s = tl.load(scales_ptr + param, mask=mask, other=0.0)
    w = v * s
    if HAS_POST:
        w = w * tl.load(post_ptr)
    tl.store(out_ptr + rows.to(tl.int64)[:, None] * n_cols + cols[None, :], w, mask=mask)


@triton.jit
def _two_step_kernel(codes_ptr, zeros_ptr, pre_ptr, out_ptr, n_rows, n_cols, n_groups, group_size, factor,
                     BLOCK_ROWS: tl.constexpr, BLOCK_COLS: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    cols = tl.program_id(1) * BLOCK_COLS + tl.arange(0, BLOCK_COLS)
    mask = (rows[:, None] < n_rows) & (cols[None, :] < n_cols)
    q = tl.load(codes_ptr + rows.to(tl.int64)[:, None] * n_cols + cols[None, :], mask=mask, other=0).to(tl.int32)
    param = rows.to(tl.int64)[:, None] * n_groups + (cols // group_size)[None, :]
    z = tl.load(zeros_ptr + param, mask=mask, other=0)
    a = tl.load(pre_ptr + param, mask=mask, other=0.0)
    w = ((q - z).to(tl.float32) * a) * factor
    tl.store(out_ptr + rows.to(tl.int64)[:, None] * n_cols + cols[None, :], w, mask=mask)


def _tiles(n_rows: int, n_cols: int) -> tuple[int, int]:
    """(rows, cols) of one program's tile: small on a GPU, whole bands under the interpreter."""
    if interpreting():
        cols = min(1024, triton.next_power_of_2(max(1, n_cols)))
        return max(1, min(triton.next_power_of_2(max(1, n_rows)), (1 << 16) // cols)), cols
    return _BLOCK_ROWS, _BLOCK_COLS


_CD = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}


def dequantize_axis0_triton(codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                            row_groups: torch.Tensor, dtype: torch.dtype = torch.float32,
                            compute_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The twin of kernels/dequant.dequantize_axis0_torch: codes [out, in], scales/zeros [R, in], row_groups [out]."""
    n_rows, n_cols = codes.shape
    dev = codes.device
    out = torch.empty((n_rows, n_cols), dtype=torch.float32, device=dev)
    # the parameters take the compute dtype first (torch's own cast, as the torch path does), then travel as float32
    s = scales.to(dev).to(compute_dtype).to(torch.float32).contiguous()
    z = zeros.to(dev).to(compute_dtype).to(torch.float32).contiguous()
    br, bc = _tiles(n_rows, n_cols)
    launch(_axis0_kernel, (triton.cdiv(n_rows, br), triton.cdiv(n_cols, bc)), codes.contiguous(), s, z,
           row_groups.to(device=dev, dtype=torch.int32).contiguous(), out, n_rows, n_cols,
           CD=_CD[compute_dtype], BLOCK_ROWS=br, BLOCK_COLS=bc)
    return out if dtype == torch.float32 else out.to(dtype)


def dequantize_codebook_triton(codes: torch.Tensor, scales: torch.Tensor, codebook: torch.Tensor, group_size: int,
                               dtype: torch.dtype = torch.float32, post_scale: torch.Tensor | None = None
                               ) -> torch.Tensor:
    """The twin of kernels/dequant.dequantize_codebook_torch: table[q] * s (float32), times `post_scale`."""
    n_rows, n_cols = codes.shape
    dev = codes.device
    out = torch.empty((n_rows, n_cols), dtype=torch.float32, device=dev)
    s = scales.to(dev, torch.float32).contiguous()
    post = (post_scale if post_scale is not None else torch.ones(())).to(dev, torch.float32).reshape(1).contiguous()
    br, bc = _tiles(n_rows, n_cols)
    launch(_codebook_kernel, (triton.cdiv(n_rows, br), triton.cdiv(n_cols, bc)), codes.contiguous(),
           codebook.to(dev, torch.float32).contiguous(), s, post, out, n_rows, n_cols, s.shape[1], group_size,
           HAS_POST=post_scale is not None, BLOCK_ROWS=br, BLOCK_COLS=bc)
    return out if dtype == torch.float32 else out.to(dtype)


def dequantize_two_step_triton(codes: torch.Tensor, zeros: torch.Tensor, pre_scales: torch.Tensor, factor: float,
                               group_size: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The twin of kernels/dequant.dequantize_two_step_torch: ((q - z) * a) * c, c as a float32 scalar."""
    n_rows, n_cols = codes.shape
    dev = codes.device
    out = torch.empty((n_rows, n_cols), dtype=torch.float32, device=dev)
    z = zeros.to(dev, torch.int32).contiguous()
    a = pre_scales.to(dev, torch.float32).contiguous()
    br, bc = _tiles(n_rows, n_cols)
    launch(_two_step_kernel, (triton.cdiv(n_rows, br), triton.cdiv(n_cols, bc)), codes.contiguous(), z, a, out,
           n_rows, n_cols, a.shape[1], group_size, float(np.float32(factor)), BLOCK_ROWS=br, BLOCK_COLS=bc)
    return out if dtype == torch.float32 else out.to(dtype)


# ---------------------------------------------------------------------------------------------------
# GGUF block decoders: bytes -> float32, the expressions of ggml_legacy.decode_blocks and kquants.dequantize_q*_K


@triton.jit
def load_f16(ptr, mask):
    """The little-endian fp16 at byte pointers `ptr`, as float32."""
    lo = tl.load(ptr, mask=mask, other=0).to(tl.int32)
    hi = tl.load(ptr + 1, mask=mask, other=0).to(tl.int32)
    return (lo | (hi << 8)).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _decode_legacy_kernel(data_ptr, out_ptr, n_blocks, KIND: tl.constexpr, NBYTES: tl.constexpr,
                          BB: tl.constexpr):
    # KIND: 0 Q4_0, 1 Q4_1, 2 Q5_0, 3 Q5_1, 4 Q8_0
    blk = tl.program_id(0) * BB + tl.arange(0, BB)
    live = blk < n_blocks
    k = tl.arange(0, 32)
    m2 = live[:, None] & (k[None, :] < 32)
    base = data_ptr + blk.to(tl.int64) * NBYTES
    d = load_f16(base, live)
    if KIND == 4:
        q = tl.load(base[:, None] + 2 + k[None, :], mask=m2, other=0).to(tl.int8, bitcast=True).to(tl.float32)
        w = d[:, None] * q
    else:
        HAS_MIN: tl.constexpr = KIND == 1 or KIND == 3
        FIVE: tl.constexpr = KIND == 2 or KIND == 3
        QS: tl.constexpr = 2 + 2 * HAS_MIN + 4 * FIVE
        b = tl.load(base[:, None] + QS + (k[None, :] % 16), mask=m2, other=0).to(tl.int32)
        q = (b >> (4 * (k[None, :] // 16))) & 0xF
        if FIVE:
            QH: tl.constexpr = 2 + 2 * HAS_MIN
            hb = tl.load(base[:, None] + QH + k[None, :] // 8, mask=m2, other=0).to(tl.int32)
            q = q | (((hb >> (k[None, :] % 8)) & 1) << 4)
        if HAS_MIN:
            m = load_f16(base + 2, live)
            w = d[:, None] * q.to(tl.float32) + m[:, None]
        else:
            OFFSET: tl.constexpr = 16 if FIVE else 8
            w = d[:, None] * (q - OFFSET).to(tl.float32)
    tl.store(out_ptr + blk.to(tl.int64)[:, None] * 32 + k[None, :], w, mask=m2)


@triton.jit
def _k_scale_min(sc_ptr, j, mask):
    """get_scale_min_k4 for sub-block j (0..7) of Q4_K/Q5_K scale bytes at sc_ptr: (scale, min) as int32."""
    lo_s = tl.load(sc_ptr + (j % 4), mask=mask, other=0).to(tl.int32)  # scales[j] for j < 4, scales[j-4] else
    lo_m = tl.load(sc_ptr + 4 + (j % 4), mask=mask, other=0).to(tl.int32)  # scales[j+4] / scales[j]
    mix = tl.load(sc_ptr + 8 + (j % 4), mask=mask, other=0).to(tl.int32)  # scales[j+4] for j >= 4
    sc = tl.where(j < 4, lo_s & 63, (mix & 0xF) | ((lo_s >> 6) << 4))
    mn = tl.where(j < 4, lo_m & 63, (mix >> 4) | ((lo_m >> 6) << 4))
    return sc, mn


@triton.jit
def _decode_k_kernel(data_ptr, out_ptr, n_blocks, KIND: tl.constexpr, NBYTES: tl.constexpr, BB: tl.constexpr):
    # KIND: 2..6 = Q2_K..Q6_K
    blk = tl.program_id(0) * BB + tl.arange(0, BB)
    live = blk < n_blocks
    e = tl.arange(0, 256)[None, :]
    m2 = live[:, None] & (e < 256)
    m1 = live[:, None]
    base = data_ptr + blk.to(tl.int64)[:, None] * NBYTES
    if KIND == 2:
        sc = tl.load(base + e // 16, mask=m2, other=0).to(tl.int32)
        q = (tl.load(base + 16 + 32 * (e // 128) + e % 32, mask=m2, other=0).to(tl.int32)
             >> (2 * ((e % 128) // 32))) & 3
        d = load_f16(base + 80, m1)
        dmin = load_f16(base + 82, m1)
        dl = d * (sc & 0xF).to(tl.float32)
        ml = dmin * (sc >> 4).to(tl.float32)
        w = dl * q.to(tl.float32) - ml
    elif KIND == 3:
        hm = (tl.load(base + e % 32, mask=m2, other=0).to(tl.int32) >> (e // 32)) & 1
        q2 = (tl.load(base + 32 + 32 * (e // 128) + e % 32, mask=m2, other=0).to(tl.int32)
              >> (2 * ((e % 128) // 32))) & 3
        j = e // 16
        s_lo = tl.load(base + 96 + j % 8, mask=m2, other=0).to(tl.int32)
        low = tl.where(j < 8, s_lo & 0xF, s_lo >> 4)
        high = (tl.load(base + 104 + j % 4, mask=m2, other=0).to(tl.int32) >> (2 * (j // 4))) & 3
        sc = (low | (high << 4)) - 32
        d = load_f16(base + 108, m1)
        dl = d * sc.to(tl.float32)
        w = dl * (q2 - 4 * (1 - hm)).to(tl.float32)
    elif KIND == 4 or KIND == 5:
        j = e // 32
        sc, mn = _k_scale_min(base + 4, j, m2)
        d = load_f16(base, m1)
        dmin = load_f16(base + 2, m1)
        QS: tl.constexpr = 16 if KIND == 4 else 48
        q = (tl.load(base + QS + 32 * (e // 64) + e % 32, mask=m2, other=0).to(tl.int32) >> (4 * (j % 2))) & 0xF
        if KIND == 5:
            q = q | (((tl.load(base + 16 + e % 32, mask=m2, other=0).to(tl.int32) >> j) & 1) << 4)
        d1 = d * sc.to(tl.float32)
        m1 = dmin * mn.to(tl.float32)
        w = d1 * q.to(tl.float32) - m1
    else:
        half = e // 128
        g = (e % 128) // 32
        lo = (tl.load(base + 64 * half + 32 * (g % 2) + e % 32, mask=m2, other=0).to(tl.int32) >> (4 * (g // 2))) & 0xF
        hi = (tl.load(base + 128 + 32 * half + e % 32, mask=m2, other=0).to(tl.int32) >> (2 * g)) & 3
        q = (lo | (hi << 4)) - 32
        sc = tl.load(base + 192 + e // 16, mask=m2, other=0).to(tl.int8, bitcast=True).to(tl.float32)
        d = load_f16(base + 208, m1)
        w = (d * sc) * q.to(tl.float32)
    tl.store(out_ptr + blk.to(tl.int64)[:, None] * 256 + e, w, mask=m2)


_LEGACY_KINDS = {"Q4_0": (0, 18), "Q4_1": (1, 20), "Q5_0": (2, 22), "Q5_1": (3, 24), "Q8_0": (4, 34)}
_K_KINDS = {"Q2_K": (2, 84), "Q3_K": (3, 110), "Q4_K": (4, 144), "Q5_K": (5, 176), "Q6_K": (6, 210)}


def _blocks_per_program(n_blocks: int, gpu: int, interp: int) -> int:
    return min(interp, triton.next_power_of_2(max(1, n_blocks))) if interpreting() else gpu


def decode_legacy_triton(type_name: str, data: torch.Tensor) -> torch.Tensor:
    """uint8 [rows, nb*nbytes] Q4_0/Q4_1/Q5_0/Q5_1/Q8_0 blocks -> float32 [rows, nb*32]."""
    kind, nbytes = _LEGACY_KINDS[type_name]
    rows = data.shape[0] if data.dim() > 1 else 1
    nb = data.numel() // nbytes
    out = torch.empty((rows, nb // rows * 32), dtype=torch.float32, device=data.device)
    bb = _blocks_per_program(nb, 32, 4096)
    launch(_decode_legacy_kernel, (triton.cdiv(nb, bb),), data.contiguous(), out, nb, KIND=kind, NBYTES=nbytes, BB=bb)
    return out


def decode_k_triton(type_name: str, data: torch.Tensor) -> torch.Tensor:
    """uint8 [..., nb*nbytes] Q2_K..Q6_K super-blocks -> float32 [..., nb*256]."""
    kind, nbytes = _K_KINDS[type_name]
    nb = data.numel() // nbytes
    out = torch.empty((*data.shape[:-1], data.shape[-1] // nbytes * 256), dtype=torch.float32, device=data.device)
    bb = _blocks_per_program(nb, 4, 256)
    launch(_decode_k_kernel, (triton.cdiv(nb, bb),), data.contiguous(), out, nb, KIND=kind, NBYTES=nbytes, BB=bb)
    return out


# ---------------------------------------------------------------------------------------------------
# Packed codes that a reader unpacks before the grid exists: HQQ's slabs and QQQ's Marlin tiles (with QQQ's int8
# clamp). The twins of kernels/hqq.unpack_hqq and kernels/qqq_perm.unpack_qqq_codes + formats/qqq.int8_weights.


@triton.jit
def _hqq_unpack_kernel(words_ptr, out_ptr, n_rows, n_cols, step, FIELD: tl.constexpr, PER_WORD: tl.constexpr,
                       BLOCK_ROWS: tl.constexpr, BLOCK_COLS: tl.constexpr):
    # output row r of the group matrix is slab j = r // step of word row r % step, bit field j counted from the
    # most significant side (3-bit: bits 29..0 of an int32)
    rows = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    cols = tl.program_id(1) * BLOCK_COLS + tl.arange(0, BLOCK_COLS)
    mask = (rows[:, None] < n_rows) & (cols[None, :] < n_cols)
    slab = rows // step
    word = tl.load(words_ptr + (rows % step).to(tl.int64)[:, None] * n_cols + cols[None, :], mask=mask,
                   other=0).to(tl.int32)
    q = (word >> (FIELD * (PER_WORD - 1 - slab))[:, None]) & ((1 << FIELD) - 1)
    tl.store(out_ptr + rows.to(tl.int64)[:, None] * n_cols + cols[None, :], q.to(tl.uint8), mask=mask)


def unpack_hqq_triton(words: torch.Tensor, field_bits: int, per_word: int, rows: int) -> torch.Tensor:
    """HQQ words [step, C] (uint8, or int32 for 3-bit) -> uint8 codes [rows, C]; rows <= per_word * step (the
    caller checked the counts as kernels/hqq.unpack_hqq does)."""
    step, n_cols = words.shape
    out = torch.empty((rows, n_cols), dtype=torch.uint8, device=words.device)
    br, bc = _tiles(rows, n_cols)
    launch(_hqq_unpack_kernel, (triton.cdiv(rows, br), triton.cdiv(n_cols, bc)), words.contiguous(), out, rows,
           n_cols, step, FIELD=field_bits, PER_WORD=per_word, BLOCK_ROWS=br, BLOCK_COLS=bc)
    return out


@triton.jit
def _qqq_kernel(b_ptr, inv_ptr, sg_ptr, out_ptr, n_out, n_in, n_groups, group_size, INT8: tl.constexpr,
                BLOCK_ROWS: tl.constexpr, BLOCK_COLS: tl.constexpr):
    # output [n_out, n_in]: code c[k, n] sits in tile (k // 16, n // 16) at 16 * (k % 16) + n % 16 of its row's
    # run; runs of 1024 are permuted (packed[x] = tiled[perm[x]], so tiled[t] = packed[inv[t]]), 8 nibbles a word
    n = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    k = tl.program_id(1) * BLOCK_COLS + tl.arange(0, BLOCK_COLS)
    mask = (n[:, None] < n_out) & (k[None, :] < n_in)
    t = (n // 16)[:, None] * 256 + 16 * (k % 16)[None, :] + (n % 16)[:, None]
    x = (t // 1024) * 1024 + tl.load(inv_ptr + t % 1024, mask=mask, other=0)
    row = (k // 16)[None, :].to(tl.int64)
    word = tl.load(b_ptr + row * (2 * n_out) + x // 8, mask=mask, other=0)
    c = (word >> (4 * (x % 8))) & 0xF
    if INT8:
        # clamp(round_half_even((c - 8) * s_group), -128, 127) + 128, float32 on the fp16 scale (QQQTorchLinear);
        # adding and removing 1.5 * 2^23 rounds ties to even in float32, |x| < 2^22 (larger values are integers)
        sg = tl.load(sg_ptr + n.to(tl.int64)[:, None] * n_groups + (k // group_size)[None, :], mask=mask, other=0.0)
        v = (c - 8).to(tl.float32) * sg
        r = tl.where(tl.abs(v) < 4194304.0, (v + 12582912.0) - 12582912.0, v)
        r = tl.where(r > 127.0, 127.0, tl.where(r < -128.0, -128.0, r))
        # NaN (an infinite scale times code 8, or a NaN scale) -> 0, which torch's CPU cast gives on x86 and ARM
        # (int32 0x80000000, int16 0) and a GPU's cvt.rzi gives too; said here rather than left to the cast
        r = tl.where(r != r, 0.0, r)
        c = r.to(tl.int32) + 128
    tl.store(out_ptr + n.to(tl.int64)[:, None] * n_in + k[None, :], c.to(tl.uint8), mask=mask)


def qqq_codes_triton(B: torch.Tensor, inverse_perm: torch.Tensor, s_group: torch.Tensor | None = None,
                     group_size: int = 0) -> torch.Tensor:
    """QQQ `B` int32 [in/16, out*2] -> uint8 [out, in]: the nibbles (s_group None), or, with s_group [out, G]
    (fp16), the grouped mode's runtime int8 weights + 128. inverse_perm: the mode's 1024-entry inverse code
    permutation (kernels/qqq_perm)."""
    rows, cols = B.shape
    n_in, n_out = rows * 16, cols // 2
    dev = B.device
    out = torch.empty((n_out, n_in), dtype=torch.uint8, device=dev)
    sg = (s_group.to(dev, torch.float16).to(torch.float32).contiguous() if s_group is not None
          else torch.zeros(1, dtype=torch.float32, device=dev))
    br, bc = _tiles(n_out, n_in)
    launch(_qqq_kernel, (triton.cdiv(n_out, br), triton.cdiv(n_in, bc)), B.contiguous(),
           inverse_perm.to(dev, torch.int32).contiguous(), sg, out, n_out, n_in,
           sg.shape[1] if s_group is not None else 1, max(1, group_size), INT8=s_group is not None,
           BLOCK_ROWS=br, BLOCK_COLS=bc)
    return out


@triton.jit
def _bitstream_kernel(words_ptr, order_ptr, out_ptr, n_rows, n_codes, n_words, s_row, s_word,
                      BITS: tl.constexpr, WORD: tl.constexpr, PER: tl.constexpr, HAS_ORDER: tl.constexpr,
                      BLOCK_ROWS: tl.constexpr, BLOCK_COLS: tl.constexpr):
    # row r's codes as one little-endian bit stream over its words (WORD bits each): code k's field f (k itself, or
    # its place in a word's interleaving order) at bits [f*BITS, f*BITS + BITS), possibly straddling two words
    r = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    k = tl.program_id(1) * BLOCK_COLS + tl.arange(0, BLOCK_COLS)
    live = k < n_codes
    mask = (r[:, None] < n_rows) & live[None, :]
    if HAS_ORDER:
        f = (k // PER) * PER + tl.load(order_ptr + k % PER, mask=live, other=0)
    else:
        f = k
    pos = f * BITS
    w = pos // WORD
    sh = pos % WORD
    base = words_ptr + r.to(tl.int64)[:, None] * s_row
    lo = tl.load(base + (w.to(tl.int64) * s_word)[None, :], mask=mask & (w < n_words)[None, :], other=0)
    if WORD == 32:
        lo = lo.to(tl.uint32, bitcast=True)
    else:
        lo = lo.to(tl.uint32)
    q = lo >> sh.to(tl.uint32)[None, :]
    straddle = (sh + BITS > WORD) & (w + 1 < n_words)
    hi = tl.load(base + ((w + 1).to(tl.int64) * s_word)[None, :], mask=mask & straddle[None, :], other=0)
    if WORD == 32:
        hi = hi.to(tl.uint32, bitcast=True)
    else:
        hi = hi.to(tl.uint32)
    q = q | tl.where(straddle[None, :], hi << ((WORD - sh) % WORD).to(tl.uint32)[None, :], 0)
    q = q & ((1 << BITS) - 1)
    tl.store(out_ptr + r.to(tl.int64)[:, None] * n_codes + k[None, :], q.to(tl.uint8), mask=mask)


def unpack_bitstream_triton(words: torch.Tensor, bits: int, count: int, word_bits: int = 32,
                            order: tuple[int, ...] | None = None) -> torch.Tensor:
    """Row bit streams -> uint8 codes [rows, count]: words [rows, n_words] (int32 for 32-bit words, uint8 for 8; any
    strides), code k LSB-first at bit k*bits of its row's stream, or, with `order` (one entry per code of a word),
    code k at field (k // len(order)) * len(order) + order[k % len(order)] (AWQ's GEMM nibbles, bitsandbytes'
    high-nibble-first bytes). Fields past the row's last word read as zero bits (the caller checked the sizes)."""
    rows, n_words = words.shape
    dev = words.device
    out = torch.empty((rows, count), dtype=torch.uint8, device=dev)
    per = len(order) if order is not None else 1
    order_t = torch.tensor(order if order is not None else (0,), dtype=torch.int32, device=dev)
    br, bc = _tiles(rows, count)
    launch(_bitstream_kernel, (triton.cdiv(rows, br), triton.cdiv(count, bc)), words, order_t, out, rows, count,
           n_words, words.stride(0), words.stride(1), BITS=bits, WORD=word_bits, PER=per,
           HAS_ORDER=order is not None, BLOCK_ROWS=br, BLOCK_COLS=bc)
    return out
