"""GPTQ 4-bit packed words <-> ggml Q4_0 blocks, moving nibbles without unpacking a single code.

GPTQ stores input channels 8r..8r+7 of output n in word qweight[r, n], nibble j = channel 8r+j.
A Q4_0 block of 32 inputs stores byte j = e_j | e_(j+16) << 4, j < 16. For block b of output n the
four words w0..w3 = qweight[4b..4b+3, n] hold e_0..e_31, and with M = 0x0F0F0F0F:

    L = (w_h & M) | ((w_(h+2) & M) << 4)        byte i of L is Q4_0 byte 2i   (+ 8h)
    H = ((w_h >> 4) & M) | (w_(h+2) & ~M)       byte i of H is Q4_0 byte 2i+1 (+ 8h)

for h = 0, 1. The same two lines map (L, H) back to (w_h, w_(h+2)), so the inverse is the same
function, which lets a writer prove what it wrote by turning the bytes back into the source words.
This is exact only where the GPTQ zero point is 8 (4-bit symmetric), because Q4_0's is.
"""

from __future__ import annotations

import torch

__all__ = ["gptq4_to_q4_0", "q4_0_to_gptq4"]

_M = 0x0F0F0F0F
_NOT_M = ~_M  # as int32: 0xF0F0F0F0


def _swap_nibble_planes(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return (a & _M) | ((b & _M) << 4), ((a >> 4) & _M) | (b & _NOT_M)


def gptq4_to_q4_0(qweight: torch.Tensor, block_scales: torch.Tensor) -> torch.Tensor:
    """qweight int32 [in/8, out], block_scales fp16 [out, in/32] -> Q4_0 bytes uint8 [out, in/32*18]
    (the Triton twin, kernels/triton/quant.py, when Triton is chosen)."""
    from ..triton.route import gptq_q4_0_repack

    routed = gptq_q4_0_repack(qweight, block_scales)
    if routed is not None:
        return routed
    in8, out = qweight.shape
    nb = in8 // 4
    words = qweight.view(nb, 4, out)  # word h of every block is a contiguous [nb, out] plane
    res = torch.empty((out, nb, 18), dtype=torch.uint8, device=qweight.device)
    res[:, :, 0:2] = block_scales.to(torch.float16).contiguous().view(torch.uint8).view(out, nb, 2)
    qs = res[:, :, 2:].view(out, nb, 2, 4, 2)  # [out, block, half h, byte i, L/H]
    for h in (0, 1):
        # bit operations on contiguous planes; the transpose to [out, block] happens in the byte stores
        low, high = _swap_nibble_planes(words[:, h], words[:, h + 2])
        qs[:, :, h, :, 0] = low.view(torch.uint8).view(nb, out, 4).transpose(0, 1)
        qs[:, :, h, :, 1] = high.view(torch.uint8).view(nb, out, 4).transpose(0, 1)
    return res.view(out, nb * 18)


def q4_0_to_gptq4(data: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_0 bytes uint8 [out, nb*18] -> (qweight int32 [nb*4, out], block scales fp16 [out, nb])."""
    out = data.shape[0]
    nb = data.shape[1] // 18
    blocks = data.view(out, nb, 18)
    d = blocks[:, :, 0:2].contiguous().view(torch.float16).view(out, nb)
    qs = blocks[:, :, 2:].contiguous().view(out, nb, 2, 4, 2)
    words = torch.empty((out, nb, 4), dtype=torch.int32, device=data.device)
    for h in (0, 1):
        # (measured: on this side, contiguous byte gathers then one final transpose beat strided stores)
        low = qs[:, :, h, :, 0].contiguous().view(torch.int32).view(out, nb)
        high = qs[:, :, h, :, 1].contiguous().view(torch.int32).view(out, nb)
        words[:, :, h], words[:, :, h + 2] = _swap_nibble_planes(low, high)
    return words.view(out, nb * 4).T.contiguous(), d
