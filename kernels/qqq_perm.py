"""QQQ's Marlin-style tile layout: int4 codes <-> the `B` words, and the permuted scale vectors.

QQQ (gptqmodel `nn_modules/qlinear/qqq.py`, from the QQQ repo's Marlin packer) stores a linear's codes
`c[k, n]` (k = input, n = output, nibbles 0..15) as int32 `B [in/16, out*2]`:

1. tile: split `[in, out]` into 16x16 tiles and lay each tile's 256 codes out as one run, row-major
   inside the tile: `T[kt, nt*256 + 16*i + j] = c[16*kt + i, 16*nt + j]` -> `[in/16, out*16]`;
2. permute every run of 1024 codes (4 tiles) by `perm`: `P[x] = T[perm[x]]`; `perm` maps the codes to
   the order in which the kernel's threads fetch them, and its last step (`interleave`) differs between
   grouped and per-channel mode because the two modes decode nibbles differently;
3. pack 8 consecutive codes per word, code i at bits [4i, 4i+4) (LSB first).

Scales are stored permuted too: `s_channel` (flattened) in chunks of 32 by `CHANNEL_SCALE_PERM`,
`s_group` (flattened row-major, `[in/group, out]`) in chunks of 64 by `GROUP_SCALE_PERM`;
`stored[x] = true[perm[x]]` in every case. (gptqmodel 7.6 nn_modules/qlinear/qqq.py: the scale_perm tables.)

Pure functions over tensors; no model or format knowledge.
"""

from __future__ import annotations

from functools import lru_cache

import torch

from .triton import route as triton_route

__all__ = ["TILE", "qqq_codes", "int8_weights", "code_permutation", "CHANNEL_SCALE_PERM", "GROUP_SCALE_PERM",
           "pack_qqq_codes", "unpack_qqq_codes", "permute_chunks", "unpermute_chunks", "check_qqq_dims"]

TILE = 16
_CHUNK = 1024  # codes per permutation run: four 16x16 tiles
_INTERLEAVE = {"grouped": (0, 2, 4, 6, 1, 3, 5, 7), "channel": (4, 0, 5, 1, 6, 2, 7, 3)}


@lru_cache(maxsize=2)
def _code_permutation(mode: str) -> tuple[int, ...]:
    base = []
    for i in range(32):  # 32 threads, each fetching 8 codes of one tile from 4 tiles
        col = i // 4
        one = [16 * row + col + 8 * block for block in (0, 1) for row in range(4 * (i % 4), 4 * (i % 4) + 4)]
        for tile in range(4):
            base.extend(p + 256 * tile for p in one)
    order = _INTERLEAVE[mode]
    return tuple(base[g + order[j]] for g in range(0, _CHUNK, 8) for j in range(8))


def code_permutation(mode: str) -> torch.Tensor:
    """The 1024-entry code permutation of a mode ("grouped" or "channel"): packed[x] = tiled[perm[x]]."""
    if mode not in _INTERLEAVE:
        raise ValueError(f"unknown QQQ mode {mode!r}")
    return torch.tensor(_code_permutation(mode), dtype=torch.int64)


CHANNEL_SCALE_PERM = torch.tensor([2 * i + j for i in range(4) for j in (0, 1, 8, 9, 16, 17, 24, 25)],
                                  dtype=torch.int64)
GROUP_SCALE_PERM = torch.tensor([i + 8 * j for i in range(8) for j in range(8)], dtype=torch.int64)


def check_qqq_dims(in_features: int, out_features: int) -> str | None:
    """Why QQQ cannot hold a linear of this size, or None (thread tiles (k, n) of the kernel)."""
    tiles = ((64, 256), (128, 128), (128, 64), (64, 128))
    if not any(in_features % k == 0 and out_features % n == 0 for k, n in tiles):
        return (f"QQQ needs in/out features divisible by one of the kernel tiles {tiles}; got "
                f"{in_features}x{out_features}")
    return None


def _inverse(perm: torch.Tensor) -> torch.Tensor:
    inv = torch.empty_like(perm)
    inv[perm] = torch.arange(perm.numel(), dtype=perm.dtype)
    return inv


def permute_chunks(values: torch.Tensor, perm: torch.Tensor) -> torch.Tensor:
    """Flattened `values` permuted chunk by chunk (stored[x] = true[perm[x]]), original shape kept."""
    flat = values.reshape(-1, perm.numel())
    return flat[:, perm].reshape(values.shape)


def unpermute_chunks(values: torch.Tensor, perm: torch.Tensor) -> torch.Tensor:
    """Inverse of `permute_chunks`."""
    return permute_chunks(values, _inverse(perm))


def unpack_qqq_codes(B: torch.Tensor, mode: str) -> torch.Tensor:
    """int32 `B [in/16, out*2]` -> nibbles uint8 `[out, in]` (nn.Linear orientation)."""
    rows, cols = B.shape
    in_features, out_features = rows * TILE, cols // 2
    words = B.to(torch.int64) & 0xFFFFFFFF
    shifts = torch.arange(0, 32, 4, dtype=torch.int64)
    lanes = ((words.unsqueeze(-1) >> shifts) & 0xF).reshape(rows, cols * 8)  # [in/16, out*16]
    tiled = unpermute_chunks(lanes, code_permutation(mode))
    codes = tiled.reshape(rows, out_features // TILE, TILE, TILE).permute(0, 2, 1, 3).reshape(in_features, out_features)
    return codes.T.contiguous().to(torch.uint8)


@lru_cache(maxsize=2)
def _inverse_code_permutation(mode: str) -> torch.Tensor:
    return _inverse(code_permutation(mode))


def qqq_codes(B: torch.Tensor, mode: str, s_group: torch.Tensor | None = None, group_size: int = 0) -> torch.Tensor:
    """What a reader needs from `B`: the nibbles `[out, in]` (`unpack_qqq_codes`), or with `s_group` [out, G]
    (grouped mode, unpermuted, fp16) the runtime int8 weights + 128 (`int8_weights`): a Triton kernel where one
    is chosen (kernels/triton/route.py), the torch functions otherwise."""
    routed = triton_route.qqq_codes(B, _inverse_code_permutation(mode), s_group, group_size)
    if routed is not None:
        return routed
    codes = unpack_qqq_codes(B, mode)
    return codes if s_group is None else (int8_weights(codes, s_group, group_size) + 128).to(torch.uint8)


def int8_weights(codes4: torch.Tensor, s_group: torch.Tensor, group_size: int) -> torch.Tensor:
    """Grouped mode: clamp(round_half_even((c - 8) * s_group), -128, 127) as gptqmodel's QQQTorchLinear computes
    it (float32 arithmetic on fp16 s_group). codes4 [out, in], s_group [out, G] -> int16 [out, in]."""
    out_features, in_features = codes4.shape
    sg = s_group.to(torch.float16).to(torch.float32)
    x = (codes4.to(torch.float32) - 8.0).view(out_features, in_features // group_size, group_size) * sg[:, :, None]
    return torch.round(x).clamp(-128, 127).view(out_features, in_features).to(torch.int16)


def pack_qqq_codes(codes: torch.Tensor, mode: str) -> torch.Tensor:
    """Nibbles `[out, in]` (0..15) -> int32 `B [in/16, out*2]`, the exact inverse of `unpack_qqq_codes`."""
    out_features, in_features = codes.shape
    c = codes.T.to(torch.int64).reshape(in_features // TILE, TILE, out_features // TILE, TILE)
    tiled = c.permute(0, 2, 1, 3).reshape(in_features // TILE, out_features * TILE)
    lanes = permute_chunks(tiled, code_permutation(mode)).reshape(in_features // TILE, out_features * 2, 8)
    shifts = torch.arange(0, 32, 4, dtype=torch.int64)
    words = ((lanes & 0xF) << shifts).sum(-1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
