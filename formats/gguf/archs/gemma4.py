"""Gemma 4 (text; llama.cpp's `gemma4`), in both of its layouts:

- MoE (26B-A4B): every layer runs its dense MLP and, beside it, routed experts (their gate and up stacks kept
  fused as ffn_gate_up_exps), with the router's input scale (ffn_gate_inp.scale) and a per-expert output scale
  (ffn_down_exps.scale); full-attention layers may reuse their keys as values (attention_k_eq_v: no v_proj)
  with their own KV head count (head_count_kv per layer);
- E2B / E4B: per-layer embeddings (per_layer_token_embd, per_layer_model_proj, per_layer_proj_norm, and per
  layer inp_gate / proj / post_norm) and KV-shared layers (the last num_kv_shared_layers have no k/v
  projections; with use_double_wide_mlp their MLP is twice as wide: feed_forward_length per layer).

Both: plain RMSNorms (w, not Gemma 2/3's 1 + w: llama.cpp's converter shifts nothing), a per-layer output
scalar (layer_output_scale), sliding layers with head_dim and full ones with their own global_head_dim, the
full layers' "proportional" rope stored as rope_freqs (factor 1 for the rotated pairs, 1e30 for the rest, as
the converter's generate_extra_tensors), the embedding as the output.

llama.cpp's converter registers Gemma4ForConditionalGeneration (the released checkpoints' class) and
Gemma4ForCausalLM for the text model: both are taken, the multimodal class as its text model (`multimodal`: its
text_config, its model.language_model.* tensors as model.*), its vision and audio towers left out as the converter
leaves them to its --mmproj run.
"""

from __future__ import annotations

from typing import Mapping

import gguf
import numpy as np

from ....converters.errors import BadInput
from .base import HF_DENSE_BLOCK, GgufArch, TextOfMultimodal, expert_count, register_arch
from ..hparams import MAX_HEADS, MAX_WIDTH, rope_parameters


GEMMA4_BLOCK = HF_DENSE_BLOCK + (
    "pre_feedforward_layernorm", "post_feedforward_layernorm", "pre_feedforward_layernorm_2",
    "post_feedforward_layernorm_1", "post_feedforward_layernorm_2", "router.proj", "per_layer_input_gate",
    "per_layer_projection", "post_per_layer_input_norm")

# the tensors gguf-py's name map does not name as llama.cpp's converter writes them, (HF name within a layer,
# or the model's, GGUF name within a block, or the model's): the router's scales (conversion/gemma.py Gemma4Model.modify_tensors), the output
# scalar and the fused expert stacks (its filter_tensors appends `.weight` to these bare parameters)
GEMMA4_TENSOR_NAMES = (
    ("router.scale", "ffn_gate_inp.scale"),
    ("router.per_expert_scale", "ffn_down_exps.scale"),
    ("layer_scalar", "layer_output_scale.weight"),
    ("experts.gate_up_proj", "ffn_gate_up_exps.weight"),
    ("experts.down_proj", "ffn_down_exps.weight"),
    # the per-layer embeddings' model-wide tensors (gguf-py maps them one way only)
    ("model.embed_tokens_per_layer.weight", "per_layer_token_embd.weight"),
    ("model.per_layer_model_projection.weight", "per_layer_model_proj.weight"),
    ("model.per_layer_projection_norm.weight", "per_layer_proj_norm.weight"),
)


def _int(config: Mapping, key: str, lo: int = 0, hi: int = MAX_WIDTH) -> int | None:
    value = config.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise BadInput(f"{key} is {value!r}, not a whole number in [{lo}, {hi}]")
    return value


def layer_types(config: Mapping) -> list[str]:
    n = _int(config, "num_hidden_layers", 1, 1 << 16)
    types = config.get("layer_types")
    if not isinstance(types, list) or len(types) != n or any(t not in ("sliding_attention", "full_attention")
                                                             for t in types):
        raise BadInput(f"layer_types must name sliding_attention or full_attention for each of the {n} layers")
    return types


def _full_layer_override(config: Mapping, key: str) -> int | None:
    """A full-attention layer's own value of `key` (head_dim, num_key_value_heads): transformers 5.24 keeps
    them in per_layer_config (layer index -> overrides), older configs as global_head_dim /
    num_global_key_value_heads; llama.cpp's converter takes the first full layer's."""
    types = layer_types(config)
    per_layer = config.get("per_layer_config")
    if isinstance(per_layer, Mapping):
        for index, overrides in per_layer.items():
            if str(index).isdigit() and int(index) < len(types) and types[int(index)] == "full_attention" \
                    and isinstance(overrides, Mapping) and key in overrides:
                return _int(overrides, key, 1, MAX_WIDTH)
    return None


def full_head_dim(config: Mapping) -> int:
    hd = _int(config, "global_head_dim", 1) or _full_layer_override(config, "head_dim")
    if hd is None:
        raise BadInput("config.json lacks global_head_dim (or a full layer's head_dim in per_layer_config), the "
                       "head size of Gemma 4's full-attention layers")
    return hd


def full_kv_heads(config: Mapping) -> int | None:
    return _int(config, "num_global_key_value_heads", 1, MAX_HEADS) or _full_layer_override(config,
                                                                                            "num_key_value_heads")


def _replace(writer: gguf.GGUFWriter, key: str) -> None:
    """Drop a key the shared writer set, before writing Gemma 4's own value (gguf-py warns on a rewrite)."""
    for kv in writer.kv_data:
        kv.pop(key.format(arch=writer.arch), None)


def _gemma4_extra(writer: gguf.GGUFWriter, config: Mapping) -> None:
    """The keys conversion/gemma.py writes (Gemma3Model then Gemma4Model.set_gguf_parameters)."""
    types = layer_types(config)
    n = len(types)
    swa = [t == "sliding_attention" for t in types]
    shared = _int(config, "num_kv_shared_layers", 0, n) or 0
    if config.get("final_logit_softcapping"):
        writer.add_final_logit_softcapping(float(config["final_logit_softcapping"]))
    if config.get("sliding_window") is None:
        raise BadInput("config.json lacks sliding_window, which llama.cpp's gemma4 needs for its sliding layers")
    writer.add_sliding_window(int(config["sliding_window"]))
    local = rope_parameters(config, layer_type="sliding_attention")
    writer.add_rope_freq_base_swa(float(local["rope_theta"]))
    if expert_count(config) is not None:
        writer.add_expert_count(int(expert_count(config)))
        if config.get("top_k_experts") is None:
            raise BadInput("config.json lacks top_k_experts, the experts each token is routed to")
        writer.add_expert_used_count(int(config["top_k_experts"]))
    writer.add_shared_kv_layers(shared)
    writer.add_embedding_length_per_layer_input(_int(config, "hidden_size_per_layer_input") or 0)
    writer.add_sliding_window_pattern(swa)
    hd_full, hd_swa = full_head_dim(config), _int(config, "head_dim", 1)
    for key in ("{arch}.attention.key_length", "{arch}.attention.value_length"):
        _replace(writer, key)
    writer.add_key_length(hd_full)
    writer.add_value_length(hd_full)
    writer.add_key_length_swa(hd_swa)
    writer.add_value_length_swa(hd_swa)
    ff_exp = _int(config, "moe_intermediate_size", 1)
    if ff_exp is not None:
        writer.add_expert_feed_forward_length(ff_exp)
    if config.get("use_double_wide_mlp"):  # the KV-shared layers' MLP is twice as wide
        ff = _int(config, "intermediate_size", 1)
        _replace(writer, "{arch}.feed_forward_length")
        writer.add_feed_forward_length([ff if i < n - shared else 2 * ff for i in range(n)])
    kv_full, kv_swa = full_kv_heads(config), _int(config, "num_key_value_heads", 1, MAX_HEADS)
    if kv_full is not None and kv_swa is not None:
        _replace(writer, "{arch}.attention.head_count_kv")
        writer.add_head_count_kv([kv_swa if s else kv_full for s in swa])
    factor = float(local.get("partial_rotary_factor", 1.0))
    writer.add_rope_dimension_count(hd_full)  # the unrotated pairs are rope_freqs' 1e30 factors
    writer.add_rope_dimension_count_swa(int(hd_swa * factor))


def gemma4_rope_freqs(config: Mapping) -> list[tuple[str, np.ndarray]]:
    """rope_freqs.weight, read by the full layers only: ggml's NEOX rope rotates the first pairs of a head while
    the proportional rope rotates the first partial_rotary_factor of them and leaves the rest, so the rest get a
    frequency factor of 1e30 (an angle of ~0)."""
    full = rope_parameters(config, layer_type="full_attention")
    if full.get("rope_type") != "proportional":
        raise BadInput(f"rope_parameters.full_attention.rope_type is {full.get('rope_type')!r}; llama.cpp's gemma4 "
                       "runs the proportional rope of Gemma 4's full layers only")
    hd = full_head_dim(config)
    rotated = int(hd * float(full.get("partial_rotary_factor", 1.0)) / 2)
    return [("rope_freqs.weight", np.array([1.0] * rotated + [1e30] * (hd // 2 - rotated), dtype=np.float32))]


def _gemma4_caveats(config: Mapping) -> list[str]:
    out = []
    types = layer_types(config)
    n, shared = len(types), _int(config, "num_kv_shared_layers", 0, len(types)) or 0
    if shared:
        # llama.cpp's KV cache (llama-model.cpp: the reuse callback) gives a shared sliding layer the KV of layer
        # n - shared - 2 and a shared full layer that of n - shared - 1; transformers the last unshared layer of
        # the same kind
        first = n - shared
        for i in range(first, n):
            want = max(j for j in range(first) if types[j] == types[i]) if types[i] in types[:first] else None
            got = first - (2 if types[i] == "sliding_attention" else 1)
            if want != got:
                out.append(f"num_kv_shared_layers {shared} with these layer_types: layer {i} reads the KV of "
                           f"layer {want} in transformers but of layer {got} in llama.cpp (which assumes the "
                           "last unshared layer is a full one and the one before it a sliding one)")
                break
    return out


def _rotated_share(path, hd_full: int) -> float:
    """The full layers' partial_rotary_factor, from the rope_freqs.weight the file holds (its factors are 1 for
    the rotated pairs and 1e30 for the rest: gemma4_rope_freqs)."""
    if path is None:
        raise BadInput("Gemma 4's partial_rotary_factor is read from the file's rope_freqs.weight: no file given")
    reader = gguf.GGUFReader(str(path))
    freqs = next((np.asarray(t.data, dtype=np.float32) for t in reader.tensors if t.name == "rope_freqs.weight"), None)
    if freqs is None or freqs.size != hd_full // 2 or not np.all((freqs == 1.0) | (freqs >= 1e29)):
        raise BadInput(f"rope_freqs.weight is missing or is not {hd_full // 2} factors of 1 then 1e30 (Gemma 4's "
                       "proportional rope)", path=path, tensor="rope_freqs.weight")
    rotated = int(np.count_nonzero(freqs == 1.0))
    if np.any(freqs[:rotated] != 1.0):
        raise BadInput("rope_freqs.weight rotates pairs after unrotated ones", path=path, tensor="rope_freqs.weight")
    return 2 * rotated / hd_full


def _gemma4_config(cfg: dict, get, names, cv) -> None:
    """Gemma4TextConfig from the keys _gemma4_extra writes: the sliding layers' head size and the full ones' own
    (global_head_dim, and num_global_key_value_heads where the full layers reuse keys as values), the layer
    kinds, the KV-shared layers and their double-wide MLP, the per-layer embeddings, the routed experts."""
    arch = "gemma4"
    n = cfg["num_hidden_layers"]
    flags = cv.get(f"{arch}.attention.sliding_window_pattern")
    if not isinstance(flags, list) or len(flags) != n or not all(isinstance(f, bool) for f in flags):
        raise BadInput(f"metadata {arch}.attention.sliding_window_pattern is not {n} booleans (one per layer)",
                       path=cv.path)
    types = ["sliding_attention" if f else "full_attention" for f in flags]
    hd_full = get("attention.key_length", required=True, lo=1, hi=MAX_WIDTH)
    hd_swa = get("attention.key_length_swa", required=True, lo=1, hi=MAX_WIDTH)
    shared = get("attention.shared_kv_layers", 0, lo=0, hi=n)
    first_shared = n - shared

    def per_layer(key: str, hi: int) -> list[int]:
        value = cv.get(f"{arch}.{key}")
        if not isinstance(value, list):
            return [get(key, required=True, lo=1, hi=hi)] * n
        if len(value) != n or not all(isinstance(v, int) and not isinstance(v, bool) and 0 < v <= hi for v in value):
            raise BadInput(f"metadata {arch}.{key} is not {n} whole numbers in [1, {hi}]", path=cv.path)
        return value

    ffn = per_layer("feed_forward_length", MAX_WIDTH)
    base_ff = ffn[0]
    double = ffn != [base_ff] * n
    if double and ffn != [base_ff if i < first_shared else 2 * base_ff for i in range(n)]:
        raise BadInput(f"metadata {arch}.feed_forward_length {ffn}: Gemma 4 widens only the KV-shared layers' MLP, "
                       "twice", path=cv.path)
    kv = per_layer("attention.head_count_kv", MAX_HEADS)
    kv_swa = next((h for h, t in zip(kv, types) if t == "sliding_attention"), kv[0])
    kv_full = next((h for h, t in zip(kv, types) if t == "full_attention"), kv_swa)
    if any(h != (kv_swa if t == "sliding_attention" else kv_full) for h, t in zip(kv, types)):
        raise BadInput(f"metadata {arch}.attention.head_count_kv {kv}: Gemma 4 has one count per kind of layer",
                       path=cv.path)
    first_full = types.index("full_attention") if "full_attention" in types else None
    k_eq_v = bool(names is not None and first_full is not None and first_full < first_shared
                  and f"blk.{first_full}.attn_v.weight" not in names)
    local = get("rope.freq_base_swa", 10000.0, kind="float", lo=1e-30)
    rot_swa = get("rope.dimension_count_swa", hd_swa, lo=1, hi=hd_swa)
    sliding_rope = {"rope_type": "default", "rope_theta": local}
    if rot_swa != hd_swa:
        sliding_rope["partial_rotary_factor"] = rot_swa / hd_swa
    full_rope = {"rope_type": "proportional", "rope_theta": cfg.pop("rope_theta"),
                 "partial_rotary_factor": _rotated_share(cv.path, hd_full)}
    cfg.pop("hidden_act", None)
    cfg.update(hidden_activation="gelu_pytorch_tanh", head_dim=hd_swa, global_head_dim=hd_full,
               num_key_value_heads=kv_swa, layer_types=types, tie_word_embeddings=True,
               sliding_window=get("attention.sliding_window", required=True, lo=1),
               final_logit_softcapping=get("final_logit_softcapping", kind="float"),
               num_kv_shared_layers=shared, use_double_wide_mlp=double, intermediate_size=base_ff,
               hidden_size_per_layer_input=get("embedding_length_per_layer_input", 0, lo=0, hi=MAX_WIDTH),
               vocab_size_per_layer_input=cfg["vocab_size"], attention_k_eq_v=k_eq_v,
               rope_parameters={"sliding_attention": sliding_rope, "full_attention": full_rope})
    cfg.pop("_value_head_dim", None)  # value_length is key_length: both the full layers' size
    if k_eq_v or kv_full != kv_swa:
        cfg["num_global_key_value_heads"] = kv_full
    n_expert = get("expert_count", lo=1, hi=1 << 16)
    cfg["enable_moe_block"] = n_expert is not None
    if n_expert is not None:
        cfg.update(enable_moe_block=True, num_experts=n_expert,
                   top_k_experts=get("expert_used_count", required=True, lo=1, hi=n_expert),
                   moe_intermediate_size=get("expert_feed_forward_length", required=True, lo=1, hi=MAX_WIDTH))


# the released checkpoints' class: the text model under model.language_model. (the converter's TextModel deletes
# `language_model.`), the towers under model.vision_tower / model.embed_vision / model.audio_tower / model.embed_audio
# (its filter_tensors skips any name holding vision_ or audio_; Gemma4VisionAudioModel writes them to the mmproj)
GEMMA4_MULTIMODAL = TextOfMultimodal(("Gemma4ForConditionalGeneration",), prefix="model.language_model.",
                                     towers=("model.vision_tower.", "model.embed_vision.", "model.audio_tower.",
                                             "model.embed_audio."), renamed="model.")

register_arch(GgufArch(
    "gemma4", ("Gemma4ForCausalLM", "Gemma4ForConditionalGeneration"), ("gemma4_text",), "Gemma4ForCausalLM",
    "gemma4_text", multimodal=GEMMA4_MULTIMODAL, byte_fallback_tokenizer="gemma4",
    extra_metadata=_gemma4_extra, norms=("attn_norm", "post_attention_norm", "ffn_norm", "post_ffw_norm"),
    attention=("attn_q", "attn_output"), block_extra=("attn_q_norm",), tied_output_dropped=True,
    caveats=_gemma4_caveats, hf_block=GEMMA4_BLOCK, tensor_names=GEMMA4_TENSOR_NAMES,
    config_from_gguf=_gemma4_config, per_layer_keys=("feed_forward_length", "attention.head_count_kv"),
    fused_gate_up_experts=True, routed_beside_dense=("ffn_gate_inp", "ffn_gate_up_exps", "ffn_down_exps"),
    varying_shapes=tuple(f"{t}.weight" for t in ("attn_q", "attn_k", "attn_v", "attn_output", "attn_q_norm",
                                                 "attn_k_norm", "ffn_gate", "ffn_up", "ffn_down", "rope_freqs")), arch_rope_tensors=gemma4_rope_freqs, extra_rope_types=("proportional",)))
