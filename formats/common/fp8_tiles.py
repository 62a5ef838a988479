"""FP8 E4M3 in 128x128 tiles under power-of-two (E8M0) scales as a target, shared by the `fp8` writer
(transformers' FineGrainedFP8, scale_fmt "ue8m0") and the compressed-tensors writer (float-quantized, strategy
block): the checker family `fp8-tile` and the cast a session runs (kernels/fp8_tiles.py has the math and why an
MXFP4 grid casts exactly).

Verdicts, from the grid's parameters alone (the codes are not loaded when planning):
- an E2M1 grid (MXFP4, NVFP4...) whose scales are all powers of two, in groups that divide the tile's 128 columns:
  `exact` when the block exponents inside every tile span at most 14 binades, else `requantize` (the tiles that
  span more may round their smallest blocks; the report measures it);
- an E4M3 grid already in 128x128 tiles under power-of-two scales: `exact` (re-tiling keeps every value);
- anything else (dense weights, integer grids, other scales): `requantize` with transformers' own ue8m0
  quantizer on the float32 dequantization.
"""

from __future__ import annotations

import torch

from ...converters.checker import EXACT, REQUANTIZE, Decision, TargetScheme, register_family
from ...converters.records import Dense, Grid, GridParams
from ...kernels.floatq import is_e8m0_exact
from ...kernels.fp8_tiles import TILE, decode_fp8_pow2_tiles, mx_tiles_exact, quantize_fp8_pow2_tiles, tile_grid

__all__ = ["FP8_TILE", "cast_to_fp8_tiles"]

_REQUANT = "; dequantized and quantized with transformers' FP8 quantizer (ue8m0 scales)"


def _fp8_tile(src, shape, s: TargetScheme, native, prefer_groups=()) -> Decision:
    out_f, in_f = shape[-2], shape[-1]
    tiles = tile_grid((out_f, in_f), TILE)
    n_tiles = tiles[0] * tiles[1]
    if not isinstance(src, GridParams):
        return Decision(REQUANTIZE, f"dense {src} weights quantized with transformers' FP8 quantizer into E4M3 "
                                    "128x128 tiles (ue8m0 scales)")
    p = src
    if p.element not in ("e2m1", "e4m3"):
        what = "integer grid codes" if p.codebook is None else "codebook codes"
        return Decision(REQUANTIZE, f"{what} are not E2M1 or E4M3 values" + _REQUANT)
    if p.axis != 1 or not p.contiguous_groups(in_f):
        return Decision(REQUANTIZE, "the source's scale groups do not run along the rows" + _REQUANT)
    scales = p.folded_scales()
    if p.post_scale is not None or not bool(is_e8m0_exact(scales).all()):
        return Decision(REQUANTIZE, "block scales are not powers of two" + _REQUANT)
    if p.element == "e4m3":
        if p.block_rows == TILE[0] and p.group_size == TILE[1]:
            return Decision(EXACT, "E4M3 codes in 128x128 tiles under power-of-two scales: every value kept",
                            keeps_codes=True)
        return Decision(REQUANTIZE, f"E4M3 blocks of {p.block_rows}x{p.group_size} are not 128x128 tiles" + _REQUANT)
    if TILE[1] % p.group_size:
        return Decision(REQUANTIZE, f"scale groups of {p.group_size} straddle the 128-column tiles" + _REQUANT)
    _, exponents = torch.frexp(scales)  # a power of two 2**e is 0.5 * 2**(e + 1)
    fits = mx_tiles_exact(exponents - 1, p.group_size, TILE)
    wide = n_tiles - int(fits.sum())
    if wide == 0:
        return Decision(EXACT, f"every E2M1 value times its power-of-two block scale is an E4M3 value under its "
                               f"tile's E8M0 scale ({n_tiles} tiles, block exponents within 14 binades each)",
                        keeps_codes=True, facts={"tiles": n_tiles})
    return Decision(REQUANTIZE, f"{wide} of {n_tiles} tiles hold block scales more than 14 binades apart, past "
                                "E4M3's range: their smallest blocks may round" + _REQUANT,
                    facts={"tiles": n_tiles, "wide_tiles": wide})


register_family("fp8-tile", _fp8_tile, takes_codebooks=True)

FP8_TILE = TargetScheme("fp8-128x128-e8m0", "fp8-tile", bits=8, group=TILE[1], block=TILE[1], scale="e8m0",
                        element="e4m3")


def cast_to_fp8_tiles(item: Dense | Grid) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(E4M3 codes uint8 [out, in], E8M0 tile scales uint8 [R, C], their float32 decoding) of a weight: its
    float32 dequantization through transformers' ue8m0 quantizer, which is the exact cast for the grids the
    checker calls exact."""
    w = item.dequantize(torch.float32)
    codes, e8m0 = quantize_fp8_pow2_tiles(w, TILE)
    return codes, e8m0, decode_fp8_pow2_tiles(codes, e8m0, TILE)
