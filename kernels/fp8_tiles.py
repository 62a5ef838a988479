"""FP8 E4M3 weights in square tiles (DeepSeek-V3's 128x128) under a power-of-two scale per tile, as pure functions.

The layout is transformers' FineGrainedFP8 with `scale_fmt` "ue8m0" (DeepSeek-V3.1): `weight` E4M3 [out, in],
`weight_scale_inv` E8M0 [ceil(out/128), ceil(in/128)], W = fp8(weight) * 2**k of its tile. The quantizer here is
transformers 5.24's Fp8Quantize for that scale format (integrations/finegrained_fp8.py), computed in the same
float32 steps so that its bytes are that quantizer's: per tile amax = max |w|; inv = 1 / (448 / amax) (1 for an
all-zero tile), rounded up to a power of two 2**ceil(log2(max(inv, float32 tiny))); codes = e4m3(clamp(w / inv,
+-448)) (round to nearest even). Edge tiles are partial (DeepSeek's ceil division), their amax over what they hold.

Why an MXFP4 weight survives this exactly (the MXFP4 -> FP8 cast, vLLM PR #53709): an MXFP4 value is
v * 2**e with v an E2M1 value (0, 0.5, 1, 1.5, 2, 3, 4, 6: at most two significant bits) and e the 32-block's E8M0
exponent. The tile's amax is at most 6 * 2**e_max, so its k = log2(inv) is at most e_max - 6 (6/448 < 2**-6), and
w / 2**k = v * 2**(e - k) with e - k >= e - e_max + 6. E4M3 holds every two-significant-bit number from 2**-9
(its smallest subnormal; 1.5 * 2**-8 = 3 * 2**-9 too) up to 448, so the cast is exact whenever
e - k >= -8 for every block, which `mx_tiles_exact` guarantees from the exponents alone: e_max - e <= 14 inside
every tile. A wider tile may still be exact (its small blocks may hold only zeros); the measured error says.
"""

from __future__ import annotations

import torch

__all__ = ["FP8_MAX", "TILE", "tile_grid", "quantize_fp8_pow2_tiles", "decode_fp8_pow2_tiles", "mx_tiles_exact",
           "MX_EXPONENT_SPAN"]

FP8_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max
TILE = (128, 128)
# the widest spread of 32-block exponents inside one tile that the cast keeps exact (see the module docstring):
# E4M3's 2**-9 .. 448 against E2M1's 0.5 .. 6
MX_EXPONENT_SPAN = 14


def tile_grid(shape: tuple[int, int], tile: tuple[int, int] = TILE) -> tuple[int, int]:
    """[ceil(out/rows), ceil(in/cols)]: the scale grid of a weight, edge tiles partial."""
    return -(-shape[0] // tile[0]), -(-shape[1] // tile[1])


def _padded_tiles(w: torch.Tensor, tile: tuple[int, int], fill: float) -> torch.Tensor:
    """[R, rows, C, cols] view of `w` padded with `fill` up to whole tiles."""
    out_f, in_f = w.shape
    r, c = tile_grid((out_f, in_f), tile)
    padded = torch.full((r * tile[0], c * tile[1]), fill, dtype=w.dtype)
    padded[:out_f, :in_f] = w
    return padded.view(r, tile[0], c, tile[1])


def quantize_fp8_pow2_tiles(w: torch.Tensor, tile: tuple[int, int] = TILE) -> tuple[torch.Tensor, torch.Tensor]:
    """float weights [out, in] -> (E4M3 codes as uint8 [out, in], E8M0 scale bytes uint8 [R, C]), transformers'
    Fp8Quantize with scale_fmt ue8m0 (module docstring)."""
    w = w.to(torch.float32)
    out_f, in_f = w.shape
    amax = _padded_tiles(w.abs(), tile, 0.0).amax(dim=(1, 3))
    safe = torch.where(amax > 0, amax, torch.ones_like(amax))
    scales = torch.where(amax > 0, FP8_MAX / safe, torch.ones_like(amax))
    inv = (1.0 / scales).to(torch.float32)
    inv = torch.pow(2.0, torch.ceil(torch.log2(inv.clamp(min=torch.finfo(torch.float32).tiny))))
    e8m0 = inv.to(torch.float8_e8m0fnu)
    forward = 1.0 / e8m0.to(torch.float32)
    scaled = _padded_tiles(w, tile, 0.0) * forward[:, None, :, None]
    codes = scaled.clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    codes = codes.reshape(scaled.shape[0] * tile[0], -1)[:out_f, :in_f].contiguous()
    return codes.view(torch.uint8), e8m0.view(torch.uint8).contiguous()


def decode_fp8_pow2_tiles(codes: torch.Tensor, e8m0: torch.Tensor, tile: tuple[int, int] = TILE) -> torch.Tensor:
    """float32 [out, in]: every E4M3 code times 2**k of its tile (exact in float32)."""
    out_f, in_f = codes.shape
    s = e8m0.view(torch.float8_e8m0fnu).to(torch.float32)
    full = s.repeat_interleave(tile[0], 0)[:out_f].repeat_interleave(tile[1], 1)[:, :in_f]
    return codes.view(torch.float8_e4m3fn).to(torch.float32) * full


def mx_tiles_exact(block_exponents: torch.Tensor, group: int, tile: tuple[int, int] = TILE) -> torch.Tensor:
    """bool [R, C]: the tiles whose 32-block (or `group`-block) exponents e [out, in/group] span at most
    MX_EXPONENT_SPAN, where the FP8 cast of any E2M1 codes under them is exact (module docstring). `group` must
    divide the tile's columns, so that no block straddles two tiles."""
    e = block_exponents.to(torch.int32)
    out_f, n = e.shape
    per_tile = (tile[0], tile[1] // group)
    hi = _padded_tiles(e, per_tile, -(1 << 20)).amax(dim=(1, 3))
    lo = _padded_tiles(e, per_tile, 1 << 20).amin(dim=(1, 3))
    return (hi - lo) <= MX_EXPONENT_SPAN
