"""llama-quantize's mixed presets (`--type q4_k_m` and kin): which ggml type each tensor gets.

A preset is a file type (general.file_type, llama.cpp's LlamaFileType), a base type for every weight
that is quantized, and a few per-tensor rules that spend more bits where llama.cpp measured that it
pays: the output projection, attn_v, ffn_down in some layers. The rules are llama.cpp's
`llama_tensor_get_type_impl` (src/llama-quant.cpp, the version vendored in llama-cpp-python 0.3.36;
line numbers below are that file's) for the K presets and Q8_0, with every branch those presets reach:
dense models, MoE models (3-D `ffn_*_exps`, shared experts `ffn_*_shexp`, the n_expert == 8 rules),
fused attn_qkv (phi3, falcon), DeepSeek-2's MLA tensors (attn_kv_b counts as attn_v; attn_q_a/q_b,
attn_kv_a_mqa, attn_k_b, attn_v_b take the base type), falcon's branches and the 70B attn_v bump.
Of the IQ presets only IQ1_S and IQ1_M are here (llama-quant.cpp:490-566 for them); the other IQ presets, Q2_K_S,
Q3_K_S/L, MXFP4_MOE and the imatrix-only rules are not (no such PRESETS entry), nor glm5-next's own exceptions
(llama-quant.cpp:331-347, :472-486).

Layer positions. llama-quantize walks the tensors sorted by (layer of `blk.N.`, then name)
(llama-model-loader.h weight_name_comparer) and:
- attn_v-like tensors (attn_v, attn_qkv, attn_kv_b; llama-quant.cpp:157) use a running counter
  i_attention_wv over that walk, against n_attention_wv = how many such names the file has (:927-935);
- ffn_down uses a running counter i_ffn_down against n_ffn_down = block_count (:940) in a dense model,
  but the layer parsed from the name when n_expert > 1 (layer_info, :455-470: every ffn_down,
  ffn_down_exps and ffn_down_shexp of layer N is at position N).
Without a `ranks` table (ModelFacts from config.json) the counter is taken to be the layer number, which
is exact when every layer has one such tensor; `model_facts_from_gguf_names` builds the exact table.

After the preset, llama-quantize's shape fallback applies (schemes.k_fallback).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Iterable, Mapping

from ...kernels.ggml.layouts import TARGET_LAYOUTS

__all__ = ["Preset", "PRESETS", "ModelFacts", "preset_of", "preset_type", "use_more_bits", "quantized_by_llama_cpp",
           "model_facts_from_gguf_names", "quantize_order", "is_llm_type_70b", "n_dims"]


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
    # the 1-2-bit file types (LLAMA_FTYPE_MOSTLY_*): the base type everywhere but the output (Q6_K, or Q8_0 where
    # its rows do not fill the base type's blocks) and, but for Q1_0, an untied token_embd (Q4_K; :534-536)
    Preset("q1_0", 40, "Q1_0"),
    Preset("q2_0", 41, "Q2_0"),
    Preset("tq1_0", 36, "TQ1_0"),
    Preset("tq2_0", 37, "TQ2_0"),
    # the 1-bit lattice file types (LLAMA_FTYPE_MOSTLY_IQ1_S / _IQ1_M), an importance matrix required: rules of
    # their own (_iq1_type), shared in llama.cpp with the IQ2_XXS / IQ2_XS / IQ2_S / IQ2_M mixes
    Preset("iq1_s", 24, "IQ1_S"),
    Preset("iq1_m", 31, "IQ1_M"),
)}
_IQ1 = ("iq1_s", "iq1_m")
# llama-quant.cpp:534-536: an untied token_embd of these file types is Q4_K
_EMBD_Q4_K = ("q2_0", "tq1_0", "tq2_0")


@dataclass(frozen=True)
class ModelFacts:
    n_layers: int  # block_count (llama.cpp's n_layer_all, which is n_ffn_down)
    n_gqa: int  # attention heads per KV head of layer 0, as the GGUF says (DeepSeek-2's MLA: head_count_kv 1)
    tied: bool  # no output.weight: token_embd doubles as the output projection
    n_expert: int = 0  # expert_count (0 or 1: dense)
    arch: str = ""  # GGUF architecture ("llama", "falcon", "deepseek2"): falcon has rules of its own
    n_attention_wv: int | None = None  # attn_v / attn_qkv / attn_kv_b names in the file; None: n_layers
    llm_type_70b: bool = False  # llama.cpp's LLM_TYPE_70B (is_llm_type_70b): attn_v gets Q5_K over Q3_K/Q4_K
    # position of each attn_v-like / dense ffn_down tensor in llama-quantize's walk (quantize_order); None:
    # the layer number of the name
    ranks: Mapping[str, int] | None = field(default=None, compare=False, hash=False)

    @property
    def n_wv(self) -> int:
        return self.n_layers if self.n_attention_wv is None else self.n_attention_wv


def use_more_bits(i_layer: int, n_layers: int) -> bool:
    """llama.cpp's choice of layers that get more bits: the first and last eighth, and every third
    layer in between (llama-quant.cpp:452-454)."""
    return i_layer < n_layers // 8 or i_layer >= 7 * n_layers // 8 or (i_layer - n_layers // 8) % 3 == 2


def _layer(name: str) -> int:
    """The N of `blk.N.` (sscanf in llama.cpp); -1 for tensors outside the blocks."""
    m = re.match(r"blk\.(\d+)\.", name)
    return int(m.group(1)) if m else -1


def _category(name: str) -> str:
    """llama.cpp's tensor_get_category (llama-quant.cpp:119): the first substring that matches, in this
    order (so attn_q_a / attn_q_b / attn_k_b / attn_v_b / attn_kv_a_mqa are "other")."""
    if name == "output.weight":
        return "output"
    if name in ("token_embd.weight", "per_layer_token_embd.weight"):
        return "token_embd"
    for part, cat in (("attn_qkv.weight", "attn_qkv"), ("attn_kv_b.weight", "attn_kv_b"), ("attn_v.weight", "attn_v"),
                      ("attn_k.weight", "attn_k"), ("attn_q.weight", "attn_q"),
                      ("attn_output.weight", "attn_output"), ("ffn_up", "ffn_up"), ("ffn_gate", "ffn_gate"),
                      ("ffn_down", "ffn_down")):
        if part in name:
            return cat
    return "other"


_ATTN_V_LIKE = ("attn_v", "attn_qkv", "attn_kv_b")  # category_is_attn_v, llama-quant.cpp:157


def n_dims(shape) -> int:
    """ggml_n_dims of a tensor given in HF order (ggml ne reversed): trailing ne of 1 do not count, so
    HF (1, 256) -- qwen2moe's ffn_gate_inp_shexp -- is 1-D."""
    shape = tuple(int(s) for s in shape)
    while len(shape) > 1 and shape[0] == 1:
        shape = shape[1:]
    return max(1, len(shape))


# names llama-quantize copies as they are (tensor_allows_quantization, llama-quant.cpp:287-383)
_KEPT_SUBSTRINGS = ("_norm.weight", "ffn_gate_inp.weight", "ffn_gate_tid2eid.weight", "altup", "laurel",
                    "per_layer_model_proj", "ssm_conv1d", "shortconv.conv.weight", "indexer.k_proj.weight",
                    "indexer.q_proj.weight", "time_mix_first.weight", "time_mix_w0.weight", "time_mix_w1.weight",
                    "time_mix_w2.weight", "time_mix_v0.weight", "time_mix_v1.weight", "time_mix_v2.weight",
                    "time_mix_a0.weight", "time_mix_a1.weight", "time_mix_a2.weight", "time_mix_g1.weight",
                    "time_mix_g2.weight", "time_mix_decay_w1.weight", "time_mix_decay_w2.weight",
                    "time_mix_lerp_fused.weight", "attn_rel_b.weight", ".position_embd", "sam.pos_embd", "sam.neck.",
                    "sam.net_", ".rel_pos", ".patch_embd", ".patch_merger", "a.rvq.codebook", "mm.a.code_embd")
_KEPT_NAMES = ("position_embd.weight", "token_types.weight")  # LLM_TN(arch)(POS_EMBD / TOKEN_TYPES)


def quantized_by_llama_cpp(gguf_name: str, shape) -> bool:
    """Whether llama-quantize quantizes this tensor at all: 2-D and 3-D (experts) weights only, never
    norms, MoE routers (ffn_gate_inp; ffn_gate_inp_shexp is 1-D for ggml), biases such as DeepSeek's
    exp_probs_b.bias, or the small tables of tensor_allows_quantization (llama-quant.cpp:287-383)."""
    if n_dims(shape) < 2 or not gguf_name.endswith("weight"):
        return False
    return gguf_name not in _KEPT_NAMES and not any(s in gguf_name for s in _KEPT_SUBSTRINGS)


def quantize_order(names: Iterable[str]) -> list[str]:
    """The order llama-quantize walks the tensors in: by the layer of `blk.N.` (tensors outside the
    blocks first), then by name (llama-model-loader.h weight_name_comparer)."""
    return sorted(names, key=lambda n: (_layer(n), n.encode()))


def is_llm_type_70b(arch: str, n_layers: int, n_head: int, n_head_kv: int, n_expert: int = 0) -> bool:
    """llama.cpp's LLM_TYPE_70B, the only model type the preset rules look at: llama with 80 layers and
    GQA (models/llama.cpp; an 8-expert llama is 8x7B / 8x22B instead), qwen2 / deci / olmo with 80
    layers, jais2 with 68."""
    if arch == "llama":
        return n_expert != 8 and n_layers == 80 and n_head != n_head_kv
    return {"qwen2": 80, "deci": 80, "olmo": 80, "jais2": 68}.get(arch) == n_layers


def model_facts_from_gguf_names(names_and_shapes, arch: str, n_layers: int, n_head: int, n_head_kv: int,
                                n_expert: int = 0, manual: Iterable[str] = ()) -> ModelFacts:
    """The facts llama-quantize derives from a GGUF file: its tensors (name -> HF-order shape, a mapping
    or (name, shape) pairs) and its hparams (block_count, head_count, head_count_kv of layer 0,
    expert_count). `manual`: names given a type by --tensor-type, which llama-quantize leaves out of its
    running counters (llama-quant.cpp:747-766 skips llama_tensor_get_type_impl for them)."""
    items = dict(names_and_shapes.items() if isinstance(names_and_shapes, Mapping) else names_and_shapes)
    manual = set(manual)
    n_expert = int(n_expert or 0)
    counters = {"attn_v": 0, "ffn_down": 0}
    ranks: dict[str, int] = {}
    for name in quantize_order(items):
        cat = _category(name)
        counter = "attn_v" if cat in _ATTN_V_LIKE else "ffn_down" if cat == "ffn_down" else None
        if counter and quantized_by_llama_cpp(name, items[name]) and name not in manual:
            ranks[name] = counters[counter]
            counters[counter] += 1
    return ModelFacts(
        n_layers=int(n_layers), n_gqa=int(n_head) // int(n_head_kv) if n_head_kv else 0,
        tied="output.weight" not in items, n_expert=n_expert, arch=arch,
        n_attention_wv=sum(_category(n) in _ATTN_V_LIKE for n in items),
        llm_type_70b=is_llm_type_70b(arch, int(n_layers), int(n_head), int(n_head_kv), n_expert), ranks=ranks)


def preset_of(type_name: str | None) -> Preset | None:
    return PRESETS.get(type_name.strip().lower()) if type_name else None


def _rank(name: str, facts: ModelFacts) -> int:
    """i_attention_wv / i_ffn_down of this tensor: its place in llama-quantize's walk."""
    if facts.ranks is not None and name in facts.ranks:
        return facts.ranks[name]
    return max(_layer(name), 0)


def _output_type(preset: Preset, shape, facts: ModelFacts) -> tuple[str, str]:
    """output.weight, or a tied token_embd (llama-quant.cpp:490-511): Q6_K, but Q8_0 for falcon, for the
    Q8_0 preset and when the rows do not fill the base type's blocks."""
    if facts.arch == "falcon":
        return "Q8_0", f"{preset.name}: falcon output -> Q8_0"
    if shape[-1] % TARGET_LAYOUTS[preset.base].block:
        return "Q8_0", f"{preset.name}: output rows do not fill {preset.base} blocks -> Q8_0"
    if preset.name in _IQ1:
        return "Q5_K", f"{preset.name}: output"  # :502-505
    return ("Q8_0" if preset.base == "Q8_0" else "Q6_K"), f"{preset.name}: output"


def _attn_v_type(p: str, base: str, i: int, facts: ModelFacts) -> str | None:
    """attn_v / attn_qkv / attn_kv_b (llama-quant.cpp:567-604; the separate attn_qkv branch at :689 is
    never reached, as :567 catches attn_qkv first)."""
    t = None
    if p == "q2_k":
        t = "Q4_K" if facts.n_gqa >= 4 else "Q3_K"
    elif p == "q3_k_m":
        t = "Q5_K" if i < 2 else "Q4_K"
    elif p in ("q4_k_m", "q5_k_m") and use_more_bits(i, facts.n_wv):
        t = "Q6_K"
    elif p == "q4_k_s" and i < 4:
        t = "Q5_K"
    if facts.llm_type_70b and (t or base) in ("Q3_K", "Q4_K"):
        t = "Q5_K"  # :593-597, on the type chosen so far, which is the base type where no rule above applied
    if facts.n_expert == 8:
        t = "Q8_0"  # :599-603
    return t


def _ffn_down_type(p: str, i: int, n: int, falcon: bool) -> str | None:
    """ffn_down, ffn_down_exps, ffn_down_shexp (llama-quant.cpp:624-668)."""
    if p == "q2_k":
        return "Q3_K"
    if p == "q3_k_m":
        return "Q5_K" if i < n // 16 else "Q4_K" if not falcon or use_more_bits(i, n) else "Q3_K"
    if p == "q4_k_m":
        if falcon:
            return "Q6_K" if i < n // 16 else "Q5_K" if use_more_bits(i, n) else "Q4_K"
        return "Q6_K" if use_more_bits(i, n) else None
    if p == "q5_k_m":
        return "Q6_K" if use_more_bits(i, n) else None
    if p == "q4_k_s" and not falcon and i < n // 8:
        return "Q5_K"
    return None


def _attn_output_type(p: str, facts: ModelFacts) -> str | None:
    """attn_output (llama-quant.cpp:669-688): Q5_K for the low presets of an 8-expert model; falcon's
    only rule is for Q3_K_L."""
    if facts.arch == "falcon":
        return None
    if facts.n_expert == 8:
        return "Q5_K" if p in ("q2_k", "q3_k_m", "q4_k_s", "q4_k_m") else None
    return {"q2_k": "Q3_K", "q3_k_m": "Q4_K"}.get(p)


def _iq1_type(p: str, cat: str, gguf_name: str, facts: ModelFacts) -> tuple[str | None, str]:
    """The IQ1_S / IQ1_M rules below the output (llama-quant.cpp:525-566): token_embd Q2_K; attn_v-like Q4_K with
    4+ query heads per KV head or 4+ experts, else Q2_K; attn_k of an 8-expert model Q4_K; the first eighth of
    the ffn_down tensors Q2_K, counted by the running counter even in a MoE model (this branch has no
    layer_info); attn_output IQ2_XXS (Q5_K with 8 experts). Falcon has no rules of its own here."""
    if cat == "token_embd":
        return "Q2_K", "token_embd"
    if cat in _ATTN_V_LIKE:
        i = _rank(gguf_name, facts)
        return ("Q4_K" if facts.n_gqa >= 4 or facts.n_expert >= 4 else "Q2_K"), f"{cat} #{i} of {facts.n_wv}"
    if cat == "attn_k" and facts.n_expert == 8:
        return "Q4_K", "attn_k of an 8-expert model"
    if cat == "ffn_down":
        i = _rank(gguf_name, facts)
        return ("Q2_K" if i < facts.n_layers // 8 else None), f"ffn_down #{i}"
    if cat == "attn_output":
        return ("Q5_K" if facts.n_expert == 8 else "IQ2_XXS"), f"attn_output of layer {_layer(gguf_name)}"
    return None, ""


def preset_type(preset: Preset, gguf_name: str, shape, facts: ModelFacts) -> tuple[str, str]:
    """(ggml type, which rule chose it) for a tensor llama-quantize quantizes (quantized_by_llama_cpp),
    before the shape fallback. `shape` in HF order; 3-D expert tensors are (n_expert, rows, cols)."""
    cat = _category(gguf_name)
    p = preset.name
    if cat == "output" or (cat == "token_embd" and facts.tied):
        t, rule = _output_type(preset, shape, facts)
        return t, rule + (" (tied embedding)" if cat == "token_embd" else "")
    layer = _layer(gguf_name)
    chosen, where = None, ""
    if p in _IQ1:
        chosen, where = _iq1_type(p, cat, gguf_name, facts)
        return (chosen, f"{p}: {where}") if chosen else (preset.base, p)
    if cat == "token_embd" and p in _EMBD_Q4_K:
        return "Q4_K", f"{p}: token_embd"
    if cat in _ATTN_V_LIKE:
        i = _rank(gguf_name, facts)
        chosen, where = _attn_v_type(p, preset.base, i, facts), f"{cat} #{i} of {facts.n_wv}"
    elif cat == "attn_k" and facts.n_expert == 8:
        chosen, where = "Q8_0", "attn_k of an 8-expert model"  # :605-610
    elif cat == "ffn_down":
        # MoE: the layer of the name; dense: the running counter (llama-quant.cpp:455-470)
        i = layer if facts.n_expert > 1 else _rank(gguf_name, facts)
        chosen, where = _ffn_down_type(p, i, facts.n_layers, facts.arch == "falcon"), f"ffn_down of layer {i}"
    elif cat == "attn_output":
        chosen, where = _attn_output_type(p, facts), f"attn_output of layer {layer}"
        if facts.n_expert == 8 and chosen:
            where += " (8 experts)"
    if chosen:
        return chosen, f"{p}: {where}"
    return preset.base, p
