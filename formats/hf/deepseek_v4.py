"""DeepSeek-V4's checkpoint as released (deepseek-ai/DeepSeek-V4-Flash), read as transformers names it.

Names: DeepSeek's own inference code's (`embed.weight`, `layers.N.attn.wq_a.weight`, `layers.N.ffn.experts.E.w1
.weight`, `hc_head_fn`, `head.weight`), which is also what llama.cpp's converter reads; transformers 5.24 loads
them through the renames of its conversion_mapping.py ("deepseek_v4"), and `release_name_to_hf` applies the same
renames, so that the records carry the names of DeepseekV4ForCausalLM's parameters (`model.layers.N.self_attn
.q_a_proj.weight`...). The routed experts, which transformers fuses into gate_up_proj / down_proj stacks, are
kept one record per expert and projection (`model.layers.N.mlp.experts.E.gate_proj.weight`, w1 -> gate_proj,
w3 -> up_proj, w2 -> down_proj), as the GGUF writer stacks them. The multi-token-prediction block (`mtp.*`)
keeps its names.

FP4 weights: the routed experts are released as int8 [out, in / 2], two E2M1 codes a byte, the even element in
the low nibble, beside `<module>.scale` E8M0 [out, in / 32], one exponent per 32 along the row (value = E2M1 *
2**(e - 127)): the layout llama.cpp's converter repacks into ggml's MXFP4 blocks (conversion/base.py
repack_mxfp4_blocks). Each such pair is one float grid record named as the weight, so a writer can keep its codes
(GGUF MXFP4) or decode them; the scale is not a tensor of its own.

FP8 weights: the full release stores its other linears as F8_E4M3 beside `<module>.scale` E8M0 [ceil(out / 128),
ceil(in / 128)] (its config.json's quantization_config: quant_method fp8, weight_block_size [128, 128],
scale_fmt ue8m0): value = E4M3 * 2**(e - 127), the edge blocks partial, as llama.cpp's converter dequantizes
them (DeepseekV4Model.dequant_model). Each is one float grid record (E4M3 codes, the block's exponent).
"""

from __future__ import annotations

import torch

from ...converters.errors import BadInput
from ...converters.records import Grid, TensorRecord
from ...kernels.floatq import unpack_fp4
from ..common.checkpoint import RELEASE_LAYOUT_CLASSES, CheckpointDir
from ..common.release_names import release_name_to_hf
from ..common.float_grids import block_grid_shape, expand_block_rows, float_grid

__all__ = ["RELEASE_CLASSES", "release_name_to_hf", "packed_fp4_weights", "packed_fp4_record", "fp8_block_weights",
           "fp8_block_record", "release_quantization"]

# the config.json classes saved in this layout: a `.scale` beside an int8 `.weight` means FP4 exponents for them
# only (another model's `.scale` tensors are not), and their names are renamed
RELEASE_CLASSES = RELEASE_LAYOUT_CLASSES

_WEIGHT_DTYPES = ("I8", "U8")
_SCALE_DTYPES = ("F8_E8M0", "U8")
GROUP = 32


def packed_fp4_weights(ckpt: CheckpointDir) -> dict[str, str]:
    """{weight name: scale name} of every FP4 weight with its exponents; each pair's shapes checked (a
    BadInput naming the tensor otherwise)."""
    pairs = {}
    for name in ckpt.location:
        if not name.endswith(".scale"):
            continue
        weight = name[: -len(".scale")] + ".weight"
        if weight not in ckpt.location or ckpt.dtype(weight) not in _WEIGHT_DTYPES:
            continue
        where = ckpt.file_of(weight)
        if ckpt.dtype(name) not in _SCALE_DTYPES:
            raise BadInput(f"dtype {ckpt.dtype(name)}: the exponents of an FP4 weight are E8M0 (F8_E8M0 or U8)",
                           path=ckpt.file_of(name), tensor=name)
        wshape, sshape = ckpt.shape(weight), ckpt.shape(name)
        if len(wshape) != 2 or min(wshape) < 1 or (2 * wshape[1]) % GROUP or \
                tuple(sshape) != (wshape[0], 2 * wshape[1] // GROUP):
            raise BadInput(f"FP4 weight {list(wshape)} with exponents {list(sshape)}: expected [out, in / 2] and "
                           f"[out, in / {GROUP}]", path=where, tensor=weight)
        pairs[weight] = name
    return pairs


def packed_fp4_record(ckpt: CheckpointDir, weight: str, scale: str, shard: str) -> TensorRecord:
    rows, half = ckpt.shape(weight)

    def params():
        return float_grid("e2m1", ckpt.get(scale).contiguous().view(torch.uint8).view(torch.float8_e8m0fnu), GROUP)

    def load() -> Grid:
        return Grid(params(), codes=unpack_fp4(ckpt.get(weight).contiguous().view(torch.uint8)))

    # the exponents are read on use (planning, writing), not held from planning to writing: a giant release's
    # E8M0 bytes (one per 32 weights, 1/16 of its expert bytes) would otherwise all be held at once
    return TensorRecord(release_name_to_hf(weight), (rows, 2 * half), "grid", load, params_loader=params,
                        source_file=shard, source_name=f"{weight} + {scale}")



FP8_BLOCK = (128, 128)


def release_quantization(qc, where) -> dict:
    """The release's quantization_config (FP8 128x128 blocks with E8M0 scales), checked; any other is refused."""
    if not isinstance(qc, dict) or str(qc.get("quant_method", "")).lower() != "fp8" or \
            list(qc.get("weight_block_size") or []) != list(FP8_BLOCK):
        raise BadInput(f"quantization_config {qc!r:.120}: DeepSeek-V4's release form is quant_method fp8 with "
                       f"weight_block_size {list(FP8_BLOCK)}; no other is read", path=where)
    return qc


def fp8_block_weights(ckpt: CheckpointDir) -> dict[str, str]:
    """{weight name: scale name} of every F8_E4M3 weight with its E8M0 block exponents, shapes checked; an FP8
    weight without its exponents is refused (its codes mean a value only times them)."""
    pairs = {}
    for name in ckpt.location:
        if ckpt.dtype(name) != "F8_E4M3":
            continue
        scale = name[: -len(".weight")] + ".scale" if name.endswith(".weight") else None
        if scale is None or scale not in ckpt.location:
            raise BadInput("FP8 weight without its .scale (its E4M3 codes are values only times the block's exponent)",
                           path=ckpt.file_of(name), tensor=name)
        shape = ckpt.shape(name)
        if len(shape) != 2 or ckpt.dtype(scale) not in _SCALE_DTYPES or \
                tuple(ckpt.shape(scale)) != block_grid_shape(shape[0], shape[1], FP8_BLOCK):
            raise BadInput(f"FP8 weight {list(shape)} with exponents {list(ckpt.shape(scale))} "
                           f"{ckpt.dtype(scale)}: expected E8M0 [ceil(out / 128), ceil(in / 128)]",
                           path=ckpt.file_of(scale), tensor=scale)
        pairs[name] = scale
    return pairs


def fp8_block_record(ckpt: CheckpointDir, weight: str, scale: str, shard: str) -> TensorRecord:
    out_f, in_f = ckpt.shape(weight)

    def params():
        exps = ckpt.get(scale).contiguous().view(torch.uint8).view(torch.float8_e8m0fnu)
        return float_grid("e4m3", expand_block_rows(exps, out_f, FP8_BLOCK[0]), FP8_BLOCK[1], block_rows=FP8_BLOCK[0])

    def load() -> Grid:
        return Grid(params(), codes=ckpt.get(weight).contiguous().view(torch.uint8))

    return TensorRecord(release_name_to_hf(weight), (out_f, in_f), "grid", load, params_loader=params,
                        source_file=shard, source_name=f"{weight} + {scale}")  # read on use, as packed_fp4_record's
