"""The ggml block codec GGUF and UQFF both write: one tensor in, its block bytes and the float32 values they
decode to out (`encode_tensor`), for every ggml type a writer targets.

Per target: a source holding that very ggml type copies its blocks; GPTQ 4-bit symmetric words go straight
into Q4_0 blocks (proved by decoding them back); float types are a cast; a grid the checker let keep its codes
is repacked (legacy types), or its codes kept in the Q4_K/Q5_K super-blocks that hold them; the codebook (IQ)
and FP4 types quantize with ggml's reference quantizers (kernels/ggml/, byte-identical), and everything else
with the legacy or K quantizers. `QuantHow` says when a plan asked for more than the default reference
quantizer: kept codes, an importance matrix (`--imatrix`), or llama.cpp's own quantizer (`--quantizer
llama.cpp`); it is decided at plan time and carried in the writer's action.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import torch

from ...kernels.ggml.layouts import BlockLayout
from ...kernels.ggml.legacy import decode_blocks, quantize_pack
from ...converters.checker import EXACT, NEAR_EXACT
from ...converters.errors import QConvertError
from ...converters.plan import BitIdentical
from ...converters.records import Dense, Grid
from ...kernels.ggml.gptq_q4_0 import gptq4_to_q4_0, q4_0_to_gptq4
from ...kernels.ggml.legacy import repack_grid

__all__ = ["QuantHow", "encode_quantized", "QUANTIZERS"]

QUANTIZERS = ("qconvert", "llama.cpp")


@dataclass(frozen=True)
class QuantHow:
    keep_codes: bool = False  # grid -> Q4_K/Q5_K: keep the codes in every super-block that can hold them
    # float32 [in_features] importance per column (K and IQ types), or [slices, in_features] for a stacked tensor
    # whose slices (the dims before the last two) each have their own, as llama-quantize takes them
    imatrix: np.ndarray | None = None
    backend: str = "qconvert"  # "llama.cpp": ggml_quantize_chunk from llama-cpp-python

    @property
    def needed(self) -> bool:
        return self.keep_codes or self.imatrix is not None or self.backend != "qconvert"


def by_slice(quantize, x2, imatrix: np.ndarray | None) -> np.ndarray:
    """quantize(rows, imatrix row) over a stack's slices: [slices, n] importances weigh rows / slices rows each (rows
    of one slice are contiguous, and every quantizer here is row by row, so the bytes are those of one call with
    llama-quantize's per-expert pointer); a 1-D or absent imatrix is one call."""
    if imatrix is None or imatrix.ndim == 1:
        return quantize(x2, imatrix)
    slices = imatrix.shape[0]
    per = x2.shape[0] // slices
    return np.concatenate([quantize(x2[i * per:(i + 1) * per], np.ascontiguousarray(imatrix[i]))
                           for i in range(slices)])


def _quantize_rows(lay: BlockLayout, x2: torch.Tensor, how: QuantHow) -> np.ndarray:
    """float32 [rows, n] -> uint8 [rows, row_bytes] with the chosen quantizer."""
    if how.imatrix is not None and how.imatrix.ndim == 2:
        return by_slice(lambda rows, vec: _quantize_rows(lay, rows, replace(how, imatrix=vec)), x2, how.imatrix)
    if how.backend == "llama.cpp":
        from ...kernels.ggml.libggml import ggml_quantize

        return ggml_quantize(x2.numpy(), lay.name, how.imatrix if lay.kind == "k" else None,
                             threads=max(1, torch.get_num_threads()))
    if lay.kind == "legacy":
        return quantize_pack(lay, x2).numpy()
    from ...kernels.ggml import kquants as kq

    return kq.quantize_k(x2.numpy(), lay.name, imatrix=how.imatrix)


def _decode(lay: BlockLayout, data: np.ndarray, shape) -> torch.Tensor:
    if lay.kind == "legacy":
        return decode_blocks(lay, torch.from_numpy(data)).view(shape)
    from ...kernels.ggml import kquants as kq

    return torch.from_numpy(kq.dequantize_k(data, lay.name)).view(shape)


def _kept_codes(item, kept: np.ndarray) -> np.ndarray:
    """The codes of the kept super-blocks, (k, 256) uint8, in the tensor's block order. GPTQ words
    (2/4/8-bit) are unpacked for those blocks alone: on a g128 grid few blocks are kept, and unpacking the
    whole tensor's codes cost as much as its dequantization."""
    packed = getattr(item, "packed", None)
    out_features, in_features = item.shape
    if packed is None or packed.layout != "gptq-rows" or packed.bits not in (2, 4, 8):
        return item.codes.numpy().reshape(-1, 256)[kept]
    bits, per_row = packed.bits, in_features // 256
    per_word = 32 // bits
    words_per_block = 256 // per_word
    idx = np.flatnonzero(kept)
    n, block = idx // per_row, idx % per_row
    words = packed.words.numpy().view(np.uint32)  # [in * bits / 32, out]
    w = words[block[:, None] * words_per_block + np.arange(words_per_block), n[:, None]]  # (k, words per block)
    shifts = (bits * np.arange(per_word)).astype(np.uint32)
    codes = (w[:, :, None] >> shifts) & np.uint32((1 << bits) - 1)
    return codes.reshape(idx.size, 256).astype(np.uint8)


def encode_quantized(lay: BlockLayout, item, how: QuantHow, source=None) -> tuple[np.ndarray, torch.Tensor]:
    """-> (uint8 block bytes [rows, row_bytes], float32 decoded values in the item's shape). `source`: a
    callable giving the item's float32 dequantization (computed once, shared with the caller's
    measurement; writer.SourceValues), else the item is dequantized here."""
    def values() -> torch.Tensor:
        return source() if source is not None else item.dequantize(torch.float32)

    if how.keep_codes and hasattr(item, "params"):
        from ...kernels.ggml.kquant_grid import encode_grid_k, plan_kept_blocks

        fit = plan_kept_blocks(item.params, item.shape, lay.name)
        if fit is not None:
            def requantize():
                x = values()
                return _quantize_rows(lay, x.reshape(-1, x.shape[-1]), how)

            data, kept = encode_grid_k(lay.name, lambda kept: _kept_codes(item, kept), fit, requantize,
                                       shape=tuple(item.shape))
            if kept.any():  # the kept super-blocks' codes were packed by numpy (the report's "kernel")
                from ...kernels import note_kernel

                note_kernel("repack", "numpy")
            return data, _decode(lay, data, item.shape)
    x = values()
    shape = x.shape
    data = _quantize_rows(lay, x.reshape(-1, shape[-1]), how)
    return data, _decode(lay, data, shape)


def available_kquants():
    try:
        from ...kernels.ggml import kquants
    except ImportError:
        return None
    return kquants


def _gptq_words_to_q4_0(item: Grid):
    """The fast exact path: GPTQ 4-bit symmetric words straight into Q4_0 blocks, then back again to
    prove the bytes hold exactly the source words and scales."""
    p = item.params
    out_features, in_features = item.shape
    block_scales = p.scales[:, p.group_of_column(in_features)[::32]].to(torch.float16)
    words = item.packed.words
    from ...kernels import note_kernel, triton_device
    from ...kernels.ggml import kquant_c

    if not words.is_cuda and kquant_c.available() and triton_device(words) is None:  # (Triton: gptq4_to_q4_0)
        # the same bytes in C, and the same proof: every word and scale rebuilt from the bytes, compared
        note_kernel("repack", "c")
        data, bad = kquant_c.gptq4_to_q4_0(words.numpy(), block_scales.numpy(), max(1, torch.get_num_threads()))
        if bad:
            raise AssertionError("Q4_0 bytes do not decode back to the GPTQ words")  # a bug, never user input
        return data, BitIdentical("Q4_0 blocks decode back to the source's GPTQ words and fp16 scales")
    data = gptq4_to_q4_0(words, block_scales)
    words_back, scales_back = q4_0_to_gptq4(data)
    if not (torch.equal(words_back, words) and torch.equal(scales_back, block_scales)):
        raise AssertionError("Q4_0 bytes do not decode back to the GPTQ words")  # a bug, never user input
    return data.numpy(), BitIdentical("Q4_0 blocks decode back to the source's GPTQ words and fp16 scales")


def _gptq_words_to_q8_0(item: Grid):
    """The fast exact path to Q8_0: GPTQ 2/4/8-bit words straight into Q8_0 blocks (code - zero, the fp16 scale),
    in C, proved by decoding the bytes back to the words, zero points and scales. The torch route (unpack the codes,
    repack_grid, decode every block and measure it against the dequantized source) wrote the same bytes at several
    times the cost: the slowest exact path of the GPTQ -> GGUF benchmark."""
    from ...kernels import note_kernel
    from ...kernels.ggml import kquant_c

    p = item.params
    block_group = p.group_of_column(item.shape[1])[::32]
    d = p.scales[:, block_group].to(torch.float16)
    z = p.zeros[:, block_group].to(torch.int32)
    data, bad = kquant_c.gptq_to_q8_0(item.packed.words.numpy(), p.bits, z.numpy(), d.numpy(),
                                      max(1, torch.get_num_threads()))
    if bad:
        raise AssertionError("Q8_0 bytes do not decode back to the GPTQ words")  # a bug, never user input
    note_kernel("repack", "c")
    return data, BitIdentical("Q8_0 blocks decode back to the source's GPTQ words, zero points and fp16 scales")


def _fast_path_applies(lay: BlockLayout, verdict: str, item) -> bool:
    packed = getattr(item, "packed", None)
    return (lay.name == "Q4_0" and verdict == EXACT and packed is not None and packed.layout == "gptq-rows"
            and packed.bits == 4 and item.params.symmetric)


def _q8_0_fast_path_applies(lay: BlockLayout, verdict: str, item) -> bool:
    """An exact GPTQ grid of plain integer zero points and one scale per group, its words on the CPU (Triton has
    its own repack), and the C kernels built."""
    packed = getattr(item, "packed", None)
    if not (lay.name == "Q8_0" and verdict == EXACT and isinstance(item, Grid) and packed is not None
            and packed.layout == "gptq-rows" and packed.bits in (2, 4, 8) and len(item.shape) == 2):
        return False
    p = item.params
    if not (p.integer_zeros and p.axis == 1 and p.scale_steps is None and p.global_scale is None
            and not packed.words.is_cuda):
        return False
    from ...kernels import triton_device
    from ...kernels.ggml import kquant_c

    return triton_device(packed.words) is None and kquant_c.available()


class SourceValues:
    """An item's float32 dequantization, computed at most once: what the encoder quantizes is also what the
    runner measures the written tensor against (GgufSession.take_reference)."""

    __slots__ = ("item", "values")

    def __init__(self, item: Dense | Grid):
        self.item, self.values = item, None

    def __call__(self) -> torch.Tensor:
        if self.values is None:
            self.values = self.item.dequantize(torch.float32)
        return self.values


def encode_tensor(lay: BlockLayout, verdict: str, item: Dense | Grid,
                  quant: QuantHow | None = None,
                  source: SourceValues | None = None) -> tuple[np.ndarray, torch.Tensor | BitIdentical]:
    """-> (bytes as uint8 numpy, float32 values the bytes decode to in the item's shape, or a proof
    that the bytes are bit-identical to the source's packed codes). `source`: the item's float32
    dequantization, shared with the caller (computed here when a path needs it)."""
    if source is None:
        source = SourceValues(item)
    packed = getattr(item, "packed", None)
    if packed is not None and packed.layout == f"ggml:{lay.name}":
        # the source holds this very ggml type: its blocks are the answer, byte for byte
        return packed.words.numpy(), BitIdentical(f"{lay.name} blocks copied from the source unchanged")
    if _fast_path_applies(lay, verdict, item):
        return _gptq_words_to_q4_0(item)
    if _q8_0_fast_path_applies(lay, verdict, item):
        return _gptq_words_to_q8_0(item)
    if lay.kind == "float":
        dtype = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}[lay.name]
        t = (source() if dtype == torch.float32 else item.dequantize(dtype)).contiguous()
        return t.view(torch.uint8).numpy(), t.to(torch.float32)
    if isinstance(item, Grid) and verdict in (EXACT, NEAR_EXACT) and lay.kind == "legacy":
        p = item.params
        out_features, in_features = item.shape
        block_group = p.group_of_column(in_features)[:: lay.block]
        data = repack_grid(lay, item.codes, p.scales, p.zeros, block_group, mins=p.mins)
        return data.numpy(), decode_blocks(lay, data)
    if lay.kind == "codebook":
        if verdict == EXACT:  # the checker's "blocks copied" needs the source's blocks, found above
            raise QConvertError(f"{lay.name} blocks to copy are missing from the source record")
        return _encode_codebook(lay, source, quant)
    if lay.kind == "fp4":
        return _encode_fp4(lay, verdict, item, quant)
    if lay.kind == "lowbit":
        return _encode_lowbit(lay, source, quant)
    if quant is not None and quant.needed:  # kept grid codes, an imatrix or llama.cpp's quantizer (QuantHow)
        return encode_quantized(lay, item, quant, source)
    x = source()
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    if lay.kind == "legacy":
        data = quantize_pack(lay, x2)
        return data.numpy(), decode_blocks(lay, data).view(shape)
    kq = available_kquants()
    data = kq.quantize_k(x2.numpy(), lay.name)
    return data, torch.from_numpy(kq.dequantize_k(data, lay.name)).view(shape)


def _encode_codebook(lay: BlockLayout, source: SourceValues, quant: QuantHow | None) -> tuple[np.ndarray, torch.Tensor]:
    """The codebook types: the dequantized weights through ggml's quantize_iq4_nl / _iq4_xs / _iq3_s / _iq3_xxs /
    _iq2_s / _iq2_xs / _iq2_xxs / _iq1_s / _iq1_m (our kernels, or llama.cpp's own with --quantizer llama.cpp), with
    the --imatrix weights when given; decoded as ggml decodes it. The source's float32 values are `source`'s, so
    the runner measures against them without dequantizing the source again."""
    from ...kernels.ggml.iq2 import (dequantize_iq2_s, dequantize_iq2_xs, dequantize_iq2_xxs, quantize_iq2_s,
                                quantize_iq2_xs, quantize_iq2_xxs)
    from ...kernels.ggml.iq1 import dequantize_iq1_m, dequantize_iq1_s, quantize_iq1_m, quantize_iq1_s
    from ...kernels.ggml.iq3_s import dequantize_iq3_s, dequantize_iq3_xxs, quantize_iq3_s, quantize_iq3_xxs
    from ...kernels.ggml.iq4_nl import dequantize_iq4_nl, quantize_iq4_nl
    from ...kernels.ggml.iq4_xs import dequantize_iq4_xs, quantize_iq4_xs

    quantize, dequantize = {"IQ4_NL": (quantize_iq4_nl, dequantize_iq4_nl),
                            "IQ4_XS": (quantize_iq4_xs, dequantize_iq4_xs),
                            "IQ3_S": (quantize_iq3_s, dequantize_iq3_s),
                            "IQ2_S": (quantize_iq2_s, dequantize_iq2_s),
                            "IQ2_XS": (quantize_iq2_xs, dequantize_iq2_xs),
                            "IQ3_XXS": (quantize_iq3_xxs, dequantize_iq3_xxs),
                            "IQ2_XXS": (quantize_iq2_xxs, dequantize_iq2_xxs),
                            "IQ1_S": (quantize_iq1_s, dequantize_iq1_s),
                            "IQ1_M": (quantize_iq1_m, dequantize_iq1_m)}[lay.name]

    x = source()
    shape = x.shape
    x2 = x.reshape(-1, shape[-1]).contiguous().numpy()
    imatrix = quant.imatrix if quant is not None else None
    if quant is not None and quant.backend == "llama.cpp":
        from ...kernels.ggml.libggml import ggml_quantize

        data = by_slice(lambda rows, vec: ggml_quantize(rows, lay.name, vec, threads=max(1, torch.get_num_threads())),
                        x2, imatrix)
    else:
        data = by_slice(quantize, x2, imatrix)
    return data, torch.from_numpy(dequantize(data, shape[-1])).view(shape)


def _encode_lowbit(lay: BlockLayout, source: SourceValues, quant: QuantHow | None) -> tuple[np.ndarray, torch.Tensor]:
    """Q1_0 / Q2_0 / TQ1_0 / TQ2_0: the weights through ggml's reference quantizer (kernels/ggml/lowbit.py, C), or
    llama.cpp's own with --quantizer llama.cpp; decoded as ggml decodes them."""
    from ...kernels.ggml.lowbit import dequantize_lowbit, quantize_lowbit

    x = source()
    shape = x.shape
    x2 = x.reshape(-1, shape[-1]).contiguous().numpy()
    threads = max(1, torch.get_num_threads())
    if quant is not None and quant.backend == "llama.cpp":
        from ...kernels.ggml.libggml import ggml_quantize

        data = ggml_quantize(x2, lay.name, threads=threads)
    else:
        data = quantize_lowbit(x2, lay.name, threads)
    return data, torch.from_numpy(dequantize_lowbit(lay, data)).view(shape)


def tensor_scale_of(params) -> float | None:
    """The float32 value of the `.scale` tensor llama.cpp multiplies an NVFP4 weight's matmul by, for a float
    grid with a global scale (None without one): ModelOpt's weight_scale_2 as it is, compressed-tensors'
    weight_global_scale as its float32 reciprocal (1.0 / scale, as llama.cpp's converter stores it)."""
    g = getattr(params, "global_scale", None)
    if g is None:
        return None
    g = g.to(torch.float32).reshape(())
    return float(torch.tensor(1.0, dtype=torch.float32) / g) if params.global_scale_op == "div" else float(g)


def _mxfp4_bit_identical(data: np.ndarray, codes: np.ndarray, params, n: int) -> BitIdentical | None:
    """The proof that MXFP4 blocks hold the source's own bits, or None: a source that stores one E8M0 byte per
    32 (compressed-tensors' mxfp4-pack-quantized, gpt-oss, DeepSeek-V4 and Kimi-K3's experts), without a global
    scale, whose codes and exponents the blocks unpack back to exactly. Then ggml decodes every value as the
    source does (the same E2M1 table times the same power of two), and the runner skips the float pass that
    would otherwise cost more than the repack (a giant's layer of experts is gigabytes)."""
    from ...kernels import floatq

    scales = params.scales
    if scales.dtype != torch.float8_e8m0fnu or params.group_size != 32 or params.global_scale is not None:
        return None
    back_codes, back_e = floatq.unpack_ggml_mxfp4(data, n)
    if not (np.array_equal(back_codes, codes) and np.array_equal(back_e, scales.view(torch.uint8).numpy())):
        return None
    return BitIdentical("MXFP4 blocks unpack to the source's E2M1 codes and E8M0 exponents")


def _encode_fp4(lay: BlockLayout, verdict: str, item: Dense | Grid, quant: QuantHow | None
                ) -> tuple[np.ndarray, torch.Tensor | BitIdentical]:
    """MXFP4 / NVFP4 blocks. An E2M1 float grid the checker let keep its codes is repacked (the codes, and the
    block scales as E8M0 exponents or UE4M3 bytes: the source's own bits); anything else is dequantized and
    quantized by ggml's reference quantizer (kernels/floatq.py, byte-identical to quantize_row_mxfp4_ref /
    quantize_row_nvfp4_ref), or llama.cpp's own with --quantizer llama.cpp. -> (bytes, float32 values the
    file decodes to, an NVFP4 tensor's `.scale` applied)."""
    from ...kernels import floatq

    if isinstance(item, Grid) and verdict in (EXACT, NEAR_EXACT) and getattr(item.params, "element", None) == "e2m1":
        p = item.params
        rows, n = item.shape
        codes = item.codes.numpy()
        if lay.name == "MXFP4":
            if p.scales.dtype == torch.float8_e8m0fnu and p.group_size == 32 and p.global_scale is None:
                e = p.scales.view(torch.uint8).numpy()  # the exponents as stored: float_to_e8m0's bytes, uncomputed
            else:
                e = floatq.float_to_e8m0(p.folded_scales()[:, torch.arange(0, n, 32) // p.group_size]).numpy()
            data = floatq.pack_ggml_mxfp4(codes, e)
            proof = _mxfp4_bit_identical(data, codes, p, n)
            return data, proof if proof is not None else torch.from_numpy(floatq.decode_ggml_mxfp4(data, n))
        ts = tensor_scale_of(p)
        block = p.scales.to(torch.float32) if ts is not None else p.folded_scales()
        d = block[:, torch.arange(0, n, 16) // p.group_size].to(torch.float8_e4m3fn).view(torch.uint8) & 0x7F
        data = floatq.pack_ggml_nvfp4(codes, d.numpy())
        decoded = torch.from_numpy(floatq.decode_ggml_nvfp4(data, n))
        return data, decoded if ts is None else decoded * torch.tensor(ts, dtype=torch.float32)
    x = item.dequantize(torch.float32)
    shape = x.shape
    x2 = x.reshape(-1, shape[-1]).contiguous().numpy()
    if quant is not None and quant.backend == "llama.cpp":
        from ...kernels.ggml.libggml import ggml_quantize

        data = ggml_quantize(x2, lay.name, threads=max(1, torch.get_num_threads()))
    else:
        data = floatq.quantize_ggml_mxfp4(x2) if lay.name == "MXFP4" else floatq.quantize_ggml_nvfp4(x2)
    decode = floatq.decode_ggml_mxfp4 if lay.name == "MXFP4" else floatq.decode_ggml_nvfp4
    return data, torch.from_numpy(decode(data, shape[-1])).view(shape)
