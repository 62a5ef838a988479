"""The one dispatch per path between the CPU reference kernels and their Triton twins.

Each CPU entry point (kernels.dequantize_grid, the readers' unpacking (hqq.unpack_hqq, qqq_perm.qqq_codes, the
readers' bit streams), ggml_legacy.quantize_pack / repack_grid / decode_blocks, gptq_q4_0.gptq4_to_q4_0,
kquants.quantize_k / dequantize_k) asks here first. When Triton is chosen
(kernels.triton_device: QCONVERT_KERNELS, the compute device that `--device` sets) and a Triton kernel covers the
case, the inputs move to that device (one tensor at a time: each call moves what it needs and gives its result
back on the caller's device), the kernel runs, and the trace notes "triton"; otherwise the function returns None
and notes the path the caller is about to take ("torch", "c", "numpy"), which then runs as before.

Nothing here imports Triton until a Triton kernel is about to run.
"""

from __future__ import annotations

import numpy as np
import torch

from ..dispatch import compute_device, current_trace, note_kernel, triton_device

__all__ = ["dequantize_routed", "hqq_unpack", "qqq_codes", "bitstream", "legacy_quantize", "legacy_repack",
           "legacy_decode", "gptq_q4_0_repack", "k_quantize", "k_decode", "TRITON_K_TYPES", "TRITON_K_IMATRIX_TYPES"]

# the K types whose quantizer has a Triton twin (kernels/triton/kquant.py), without / with an importance matrix
TRITON_K_TYPES = frozenset({"Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"})
TRITON_K_IMATRIX_TYPES = frozenset({"Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"})


def _probe(grid) -> torch.Tensor:
    packed = getattr(grid, "packed", None)
    return packed.words if packed is not None else grid.codes


def _triton_dequantize(grid, dtype: torch.dtype) -> torch.Tensor | None:
    """The Triton kernel for this grid's form, or None when none covers it."""
    from . import dequant as td

    p = grid.params
    if p.axis == 0:
        if p.compute_dtype not in (torch.float32, torch.float16, torch.bfloat16):
            return None
        codes = grid.codes
        return td.dequantize_axis0_triton(codes, p.scales, p.zeros, p.row_groups(codes.shape[0]).to(codes.device),
                                          dtype, compute_dtype=p.compute_dtype)
    if p.axis != 1:
        return None
    if getattr(p, "codebook", None) is not None:
        return td.dequantize_codebook_triton(grid.codes, p.effective_scales(), p.codebook, p.group_size, dtype,
                                             post_scale=p.post_scale)
    if getattr(p, "scale_steps", None) is not None:
        pre, factor = p.scale_steps
        return td.dequantize_two_step_triton(grid.codes, p.zeros, pre, factor, p.group_size, dtype)
    if p.compute_dtype not in (torch.float32, torch.float16, torch.bfloat16):
        return None
    packed = grid.packed
    if (packed is not None and packed.layout == "gptq-rows" and packed.bits in (2, 3, 4, 8) and p.mins is None
            and p.compute_dtype == torch.float32):
        return td.dequantize_gptq_words_triton(packed.words, packed.bits, p.scales, p.zeros, p.group_size, p.g_idx,
                                               dtype)
    return td.dequantize_grid_triton(grid.codes, p.scales, p.zeros, p.group_size, p.g_idx, dtype, mins=p.mins,
                                     compute_dtype=p.compute_dtype)


def dequantize_routed(grid, dtype: torch.dtype, here) -> torch.Tensor:
    """kernels.dequantize_grid: Triton when chosen and covered, else `here` (the torch / C path), on the compute
    device when one is set (torch runs there too), the result back where the grid was."""
    home = _probe(grid).device
    dev = triton_device(_probe(grid))
    if dev is not None:
        moved = grid.to(dev) if dev != home and hasattr(grid, "to") else grid
        out = _triton_dequantize(moved, dtype)
        if out is not None:
            note_kernel("dequantize", "triton")
            return out.to(home)
    cdev = compute_device()
    if cdev is not None and cdev != home and hasattr(grid, "to"):
        note_kernel("dequantize", "torch")  # the torch path on the accelerator (the C path is the CPU's)
        return here(grid.to(cdev), dtype).to(home)
    n = _noted("dequantize")
    out = here(grid, dtype)
    if _noted("dequantize") == n:  # the C path notes itself
        note_kernel("dequantize", "torch")
    return out


def _unpack_routed(words: torch.Tensor, kernel: str, *args) -> torch.Tensor | None:
    """The "unpack" stage: triton_dequant.<kernel>(words, *args) when Triton is chosen (the result back on the
    words' device), else None. Triton is imported only then."""
    dev = triton_device(words)
    if dev is None:
        note_kernel("unpack", "torch")
        return None
    from . import dequant as triton_dequant

    out = getattr(triton_dequant, kernel)(words.to(dev), *args).to(words.device)
    note_kernel("unpack", "triton")
    return out


def hqq_unpack(words: torch.Tensor, field_bits: int, per_word: int, rows: int) -> torch.Tensor | None:
    """kernels/hqq.unpack_hqq's words -> codes in Triton, or None."""
    return _unpack_routed(words, "unpack_hqq_triton", field_bits, per_word, rows)


def qqq_codes(B: torch.Tensor, inverse_perm: torch.Tensor, s_group: torch.Tensor | None,
              group_size: int) -> torch.Tensor | None:
    """kernels/qqq_perm.qqq_codes in Triton, or None."""
    return _unpack_routed(B, "qqq_codes_triton", inverse_perm, s_group, group_size)


def bitstream(words: torch.Tensor, bits: int, count: int, word_bits: int = 32,
              order: tuple[int, ...] | None = None) -> torch.Tensor | None:
    """Row bit streams (triton_dequant.unpack_bitstream_triton: words [rows, n_words], int32 or uint8 by
    `word_bits`) -> uint8 codes [rows, count] in Triton, or None: not chosen, or sizes the caller's torch path
    should judge (a row whose codes need more words than it has)."""
    if words.dim() != 2 or count * bits > words.shape[1] * word_bits:
        note_kernel("unpack", "torch")
        return None
    if word_bits == 32 and words.dtype != torch.int32:
        words = words.view(torch.int32)  # uint32 words: the same bits
    return _unpack_routed(words, "unpack_bitstream_triton", bits, count, word_bits, order)


def _noted(stage: str) -> int:
    trace = current_trace()
    return -1 if trace is None else len(trace.get(stage, ()))


def legacy_quantize(lay, x: torch.Tensor, c_path: bool = False) -> torch.Tensor | None:
    """ggml_legacy.quantize_pack: Q4_0 .. Q8_0 blocks from float32 [rows, n] in Triton, or None; `c_path`:
    whether the caller's CPU path is the C twin (else torch)."""
    dev = triton_device(x)
    if dev is None:
        note_kernel("quantize", "c" if c_path else "torch")
        return None
    from .quant import quantize_legacy_triton

    out = quantize_legacy_triton(lay.name, x.to(dev, torch.float32)).to(x.device)
    note_kernel("quantize", "triton")
    return out


def legacy_repack(lay, codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, block_group: torch.Tensor,
                  mins: torch.Tensor | None) -> torch.Tensor | None:
    """ggml_legacy.repack_grid: a grid's codes into legacy blocks in Triton (the small per-block parameters are
    computed by torch exactly as repack_grid computes them), or None."""
    dev = triton_device(codes)
    if dev is None:
        note_kernel("repack", "torch")
        return None
    from .quant import pack_legacy_triton

    home = codes.device
    bg = block_group.to(dev)
    s = scales.to(dev)[:, bg].to(torch.float32)
    z = zeros.to(dev)[:, bg]
    if lay.has_min:
        m = mins.to(dev)[:, bg].to(torch.float32) if mins is not None else -(s * z.to(torch.float32))
        out = pack_legacy_triton(lay.name, codes.to(dev), None, s, m)
    else:
        shift = lay.offset - z.to(torch.int32)
        out = pack_legacy_triton(lay.name, codes.to(dev), shift, s)
    note_kernel("repack", "triton")
    return out.to(home)


def legacy_decode(lay, data: torch.Tensor) -> torch.Tensor | None:
    """ggml_legacy.decode_blocks in Triton, or None (decoding the written bytes is not a traced stage)."""
    dev = triton_device(data)
    if dev is None:
        return None
    from .dequant import decode_legacy_triton

    return decode_legacy_triton(lay.name, data.to(dev)).to(data.device)


def gptq_q4_0_repack(qweight: torch.Tensor, block_scales: torch.Tensor) -> torch.Tensor | None:
    """gptq_q4_0.gptq4_to_q4_0 in Triton, or None."""
    dev = triton_device(qweight)
    if dev is None:
        note_kernel("repack", "torch")
        return None
    from .quant import gptq4_to_q4_0_triton

    out = gptq4_to_q4_0_triton(qweight.to(dev), block_scales.to(dev)).to(qweight.device)
    note_kernel("repack", "triton")
    return out


def k_quantize(x, name: str, imatrix, c_path: bool) -> np.ndarray | None:
    """kquants.quantize_k: Q2_K .. Q6_K from float32 [..., n] (numpy) in Triton when covered (with or without
    an importance matrix), or None; `c_path`: whether the caller's CPU path is the C twin (else numpy)."""
    covered = name in (TRITON_K_TYPES if imatrix is None else TRITON_K_IMATRIX_TYPES)
    dev = triton_device(None) if covered else None
    if dev is None:
        note_kernel("quantize", "c" if c_path else "numpy")
        return None
    from .kquant import quantize_k_triton

    xa = np.ascontiguousarray(x, dtype=np.float32)
    xt = torch.from_numpy(xa).to(dev)
    qw = None if imatrix is None else torch.from_numpy(np.ascontiguousarray(imatrix, dtype=np.float32)).to(dev)
    out = quantize_k_triton(xt.reshape(-1, xa.shape[-1]), name, qw)
    note_kernel("quantize", "triton")
    return out.cpu().numpy().reshape(*xa.shape[:-1], -1)


def k_decode(data, name: str) -> np.ndarray | None:
    """kquants.dequantize_k in Triton, or None (Q8_K, the activation format, stays on the CPU)."""
    if name not in TRITON_K_TYPES:
        return None
    dev = triton_device(None)
    if dev is None:
        return None
    from .dequant import decode_k_triton

    arr = np.ascontiguousarray(data)
    return decode_k_triton(name, torch.from_numpy(arr).to(dev)).cpu().numpy()
