"""llama-quantize's mixed presets (`--type q4_k_m` and kin): which ggml type each tensor gets.

A preset is a file type (general.file_type, llama.cpp's LlamaFileType), a base type for every weight
that is quantized, and a few per-tensor rules that spend more bits where llama.cpp measured that it
pays: the output projection, attn_v, ffn_down in some layers. The rules are llama.cpp's
`llama_tensor_get_type_impl` (src/llama-quant.cpp, the version vendored in llama-cpp-python 0.3.36)
restricted to what a dense llama / qwen2 / qwen3 model has: no fused attn_qkv, no experts (the
n_expert == 8 rules), no falcon, no 70B-size rule. Layer positions come from the tensor name (blk.N):
llama-quantize counts attn_v / ffn_down tensors in file order, which is layer order in files written
by convert_hf_to_gguf and by qconvert.

After the preset, llama-quantize's shape fallback applies (a row that is not a whole number of 256
K-blocks: Q4_K -> Q5_0, Q5_K -> Q5_1, Q6_K -> Q8_0, Q2_K/Q3_K -> Q4_0; F16 if not even 32-blocks);
that lives in writer._k_fallback.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from ...kernels.ggml_layouts import LAYOUTS

__all__ = ["Preset", "PRESETS", "ModelFacts", "preset_of", "preset_type", "use_more_bits", "quantized_by_llama_cpp"]


@dataclass(frozen=True)
class Preset:
    name: str  # what --type takes: "q4_k_m"
    file_type: int  # general.file_type (gguf.LlamaFileType)
    base: str  # the ggml type of every quantized weight no rule below changes


PRESETS = {p.name: p for p in (
    Preset("q2_k", 10, "Q2_K"),
    Preset("q3_k_m", 12, "Q3_K"),
    Preset("q4_k_s", 14, "Q4_K"),
    Preset("q4_k_m", 15, "Q4_K"),
    Preset("q5_k_s", 16, "Q5_K"),
    Preset("q5_k_m", 17, "Q5_K"),
    Preset("q6_k", 18, "Q6_K"),
    Preset("q8_0", 7, "Q8_0"),
)}


@dataclass(frozen=True)
class ModelFacts:
    n_layers: int  # attn_v / ffn_down tensors (one per layer in a dense model)
    n_gqa: int  # attention heads per KV head
    tied: bool  # no output.weight: token_embd doubles as the output projection


def use_more_bits(i_layer: int, n_layers: int) -> bool:
    """llama.cpp's choice of layers that get more bits: the first and last eighth, and every third
    layer in between."""
    return i_layer < n_layers // 8 or i_layer >= 7 * n_layers // 8 or (i_layer - n_layers // 8) % 3 == 2


def _layer(name: str) -> int:
    m = re.match(r"blk\.(\d+)\.", name)
    return int(m.group(1)) if m else 0


def _category(name: str) -> str:
    if name == "output.weight":
        return "output"
    if name == "token_embd.weight":
        return "token_embd"
    for part in ("attn_v.weight", "attn_k.weight", "attn_q.weight", "attn_output.weight"):
        if part in name:
            return part[:-7]
    for part in ("ffn_up", "ffn_gate", "ffn_down"):
        if part in name:
            return part
    return "other"


# The per-tensor rules: (preset, category) -> function(layer, facts) -> type or None (= the base type).
# Each is one branch of llama_tensor_get_type_impl for these presets.
_RULES = {
    # Q2_K: attn_v gets 4 bits when several heads share it (GQA >= 4), else 3; ffn_down and
    # attn_output 3 bits everywhere
    ("q2_k", "attn_v"): lambda i, f: "Q4_K" if f.n_gqa >= 4 else "Q3_K",
    ("q2_k", "ffn_down"): lambda i, f: "Q3_K",
    ("q2_k", "attn_output"): lambda i, f: "Q3_K",
    # Q3_K_M: Q5_K for the first two attn_v, Q4_K for the rest; ffn_down Q5_K in the first sixteenth
    # of the layers, Q4_K after; attn_output Q4_K
    ("q3_k_m", "attn_v"): lambda i, f: "Q5_K" if i < 2 else "Q4_K",
    ("q3_k_m", "ffn_down"): lambda i, f: "Q5_K" if i < f.n_layers // 16 else "Q4_K",
    ("q3_k_m", "attn_output"): lambda i, f: "Q4_K",
    # Q4_K_S: Q5_K for the first four attn_v and for ffn_down in the first eighth of the layers
    ("q4_k_s", "attn_v"): lambda i, f: "Q5_K" if i < 4 else None,
    ("q4_k_s", "ffn_down"): lambda i, f: "Q5_K" if i < f.n_layers // 8 else None,
    # Q4_K_M / Q5_K_M: Q6_K for attn_v and ffn_down in the use_more_bits layers
    ("q4_k_m", "attn_v"): lambda i, f: "Q6_K" if use_more_bits(i, f.n_layers) else None,
    ("q4_k_m", "ffn_down"): lambda i, f: "Q6_K" if use_more_bits(i, f.n_layers) else None,
    ("q5_k_m", "attn_v"): lambda i, f: "Q6_K" if use_more_bits(i, f.n_layers) else None,
    ("q5_k_m", "ffn_down"): lambda i, f: "Q6_K" if use_more_bits(i, f.n_layers) else None,
    # Q5_K_S, Q6_K, Q8_0: the base type everywhere but the output
}


def preset_of(type_name: str | None) -> Preset | None:
    return PRESETS.get(type_name.strip().lower()) if type_name else None


def quantized_by_llama_cpp(gguf_name: str, shape) -> bool:
    """llama-quantize quantizes 2-D weights only, never norms."""
    return len(shape) >= 2 and gguf_name.endswith("weight") and "_norm.weight" not in gguf_name


def preset_type(preset: Preset, gguf_name: str, shape, facts: ModelFacts) -> tuple[str, str]:
    """(ggml type, which rule chose it) for a quantized weight, before the shape fallback."""
    cat = _category(gguf_name)
    if cat == "output" or (cat == "token_embd" and facts.tied):
        # the output projection (or the tied embedding that serves as it): Q6_K, unless the base
        # type is Q8_0 already or its rows do not fill the base type's blocks (then Q8_0)
        if shape[-1] % LAYOUTS[preset.base].block:
            return "Q8_0", f"{preset.name}: output rows do not fill {preset.base} blocks -> Q8_0"
        if preset.base == "Q8_0":
            return "Q8_0", f"{preset.name}: output"
        return "Q6_K", f"{preset.name}: output" + (" (tied embedding)" if cat == "token_embd" else "")
    rule = _RULES.get((preset.name, cat))
    chosen = rule(_layer(gguf_name), facts) if rule else None
    if chosen:
        return chosen, f"{preset.name}: {cat} of layer {_layer(gguf_name)}"
    return preset.base, f"{preset.name}"
