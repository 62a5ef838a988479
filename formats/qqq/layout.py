"""QQQ's stored layer as its runtime computes it: Marlin-tiled int4 codes `B` with a per-channel scale and, in
the grouped mode, int8 group scales (kernels/qqq_perm.py permutes them); the grid a stored module means, and
the module a 4-bit symmetric grid is stored as.
"""

from __future__ import annotations


import torch

from ...converters.records import Grid, GridParams
from ...kernels.qqq_perm import (CHANNEL_SCALE_PERM, GROUP_SCALE_PERM, pack_qqq_codes, permute_chunks, qqq_codes,
                                 unpermute_chunks)


MODULE_PARTS = ("B", "s_channel", "s_group")  # the stored tensors of one linear (besides its bias)
SUPPORTED_GROUPS = (-1, 128)
INT8_STEPS = 16  # the largest second-level scale that keeps (c - 8) * s_group inside int8


def layout_mode(group_size: int, in_features: int) -> str:
    return "grouped" if group_size not in (-1, in_features) else "channel"


def runtime_channel_scale(s_channel_true: torch.Tensor) -> torch.Tensor:
    """The per-channel scale gptqmodel's fp16 runtime multiplies with: fp16(s_channel), [out] fp16."""
    return s_channel_true.to(torch.float32).to(torch.float16)


def qqq_runtime_grid(B: torch.Tensor, mode: str, s_channel_true: torch.Tensor, s_group_true: torch.Tensor | None,
                     group_size: int) -> Grid:
    """The kernel-exact grid of one QQQ linear from its stored `B` words and unpermuted scales (s_channel [out],
    s_group [out, G] or None for per-channel mode). Grouped mode's codes are the runtime int8 weights + 128
    (kernels/qqq_perm.qqq_codes with s_group: the clamp)."""
    s_rt = runtime_channel_scale(s_channel_true)
    if s_group_true is None:
        codes4 = qqq_codes(B, mode)
        out_features, in_features = codes4.shape
        scale = (s_rt.to(torch.float32) * 16).to(torch.float16)  # a power-of-two multiple: exact in fp16
        params = GridParams(bits=4, group_size=in_features, scales=scale[:, None],
                            zeros=torch.full((out_features, 1), 8, dtype=torch.int16))
        return Grid(params, codes=codes4 ^ 8)  # signed(c) + 8 == c xor 8 for 4-bit two's complement
    runtime_codes = qqq_codes(B, mode, s_group_true, group_size)
    out_features, in_features = runtime_codes.shape
    params = GridParams(bits=8, group_size=in_features, scales=s_rt[:, None],
                        zeros=torch.full((out_features, 1), 128, dtype=torch.int16))
    return Grid(params, codes=runtime_codes)


def exact_channel_scale(s_g: torch.Tensor) -> torch.Tensor | None:
    """For group scales s_g [out, G] (float32 values of fp16 scales): a per-row fp16 channel scale s with
    every s_g = s * k, k an integer in 1..16, so that QQQ's int8 step reproduces the grid exactly; None if
    some row has none."""
    top = s_g.max(dim=1).values
    found = torch.zeros_like(top)
    ok = torch.zeros(top.shape, dtype=torch.bool)
    for k in range(INT8_STEPS, 0, -1):  # the largest k gives the finest channel scale
        s = (top / k).to(torch.float16).to(torch.float32)
        ratio = s_g / s[:, None]
        k_int = torch.round(ratio)
        good = ((k_int * s[:, None] == s_g).all(1) & (k_int >= 1).all(1) & (k_int <= INT8_STEPS).all(1) & (s > 0))
        take = good & ~ok
        found = torch.where(take, s, found)
        ok |= good
    return found if bool(ok.all()) else None


def covering_channel_scale(s_g: torch.Tensor) -> torch.Tensor:
    """The smallest fp16 channel scale s >= max_g s_g / 16 (so |(c - 8) * s_g / s| <= 128: no clamp)."""
    need = s_g.max(dim=1).values / INT8_STEPS
    s = need.to(torch.float16)
    low = s.to(torch.float32) < need
    s = torch.where(low, torch.nextafter(s, torch.full_like(s, float("inf"))), s)
    tiny = torch.finfo(torch.float16).tiny
    return torch.where(s > 0, s, torch.full_like(s, tiny)).to(torch.float32)


def encode_module(grid: Grid, mode: str) -> dict[str, torch.Tensor]:
    """A 4-bit symmetric grid (zero 8; one group per row for "channel", contiguous groups for "grouped")
    -> the QQQ tensors B, s_channel (fp32 [1, out]) and, grouped, s_group (fp16 [G, out]), all permuted."""
    p = grid.params
    codes = grid.codes
    out_features, _ = codes.shape
    s = p.scales.to(torch.float32)
    if mode == "channel":
        nibbles = (codes.to(torch.int16) - 8) & 0xF  # two's complement nibble of q - 8
        s_channel = s[:, 0] / 16
        return {"B": pack_qqq_codes(nibbles.to(torch.uint8), "channel"),
                "s_channel": permute_chunks(s_channel, CHANNEL_SCALE_PERM).reshape(1, out_features).contiguous()}
    exact = exact_channel_scale(s)
    s_channel = exact if exact is not None else covering_channel_scale(s)
    s_group = (s / s_channel[:, None]).to(torch.float16)  # gptqmodel's own rule: fp16(scale / s_channel)
    n_groups = s_group.shape[1]
    return {"B": pack_qqq_codes(codes, "grouped"),
            "s_channel": permute_chunks(s_channel, CHANNEL_SCALE_PERM).reshape(1, out_features).contiguous(),
            "s_group": permute_chunks(s_group.T.contiguous(), GROUP_SCALE_PERM).reshape(n_groups, out_features).contiguous()}


def decode_module(tensors: dict[str, torch.Tensor], mode: str, group: int) -> Grid:
    """The runtime grid of stored QQQ tensors (the same decode the reader uses)."""
    B = tensors["B"]
    out_features = B.shape[1] // 2
    s_channel = unpermute_chunks(tensors["s_channel"].reshape(-1).to(torch.float32), CHANNEL_SCALE_PERM)
    s_group = None
    if mode == "grouped":
        sg = tensors["s_group"]
        s_group = unpermute_chunks(sg.to(torch.float16).reshape(-1), GROUP_SCALE_PERM).reshape(-1, out_features).T
    return qqq_runtime_grid(B, mode, s_channel, s_group, group)
