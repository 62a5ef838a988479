"""config.json as mlx-lm 0.32 reads it, from the transformers 5 config of the same model, and back.

mlx-lm builds a model from config.json's `model_type` (models/<type>.py, or its MODEL_REMAPPING) and a
dataclass of the keys that module reads, many of them required; some of those keys transformers 5 no longer
writes, or writes elsewhere. What the writer adds, each for the error or wrong result mlx-lm gives without it:

- `rope_theta` (and `partial_rotary_factor`) at the top level, `rope_scaling` (null for the default rope):
  transformers 5 keeps them in `rope_parameters`. Without them Olmo 3, Llama 4, EXAONE 4, ERNIE 4.5,
  Qwen3-Next and GLM-4.5 fail ("missing ... required positional argument: 'rope_theta'"; EXAONE 4 and GLM-4.5
  also require `rope_scaling`, GLM-4.5 and Qwen3-Next `partial_rotary_factor`), and Olmo 2 and SmolLM3 run
  at mlx-lm's default rope_theta 10000 (logits 0.85 / 1.7 off transformers' on the tiny models).
- GLM-5 (`glm_moe_dsa`): `topk_method` "noaux_tc", `scoring_func` "sigmoid", `moe_layer_freq` 1, required by
  mlx-lm's DeepSeek-V3.2 arguments and present in GLM-5's released config.json; transformers' GLM-5 routes
  that way (sigmoid scores plus the correction bias, grouped top-k) with every layer after
  `first_k_dense_replace` routed, so these are its values.
- MiniMax-M2 (`minimax_m2`, run by mlx-lm's minimax.py): `shared_intermediate_size` ("missing 1 required
  positional argument" without it), a field of its arguments no module reads; 0, as MiniMax-M2 has no shared
  expert (transformers' MiniMaxM2 config has no such key).
- Qwen3-MoE: `num_experts`, which transformers 5 writes as `num_local_experts`, and `head_dim`, which it leaves
  out when it is hidden_size / num_attention_heads ("missing 1 required positional argument: 'num_experts'" /
  "'head_dim'" without them).
- Qwen3.5 text models (`qwen3_5_text`, `qwen3_5_moe_text`, the classes llama.cpp converts): mlx-lm knows
  Qwen3.5 only as the released checkpoints' `qwen3_5` / `qwen3_5_moe` config, the text model's keys nested in
  `text_config` ("Model type qwen3_5_text not supported" otherwise). The text config is nested unchanged,
  so `from_mlx_lm` gives it back whole; mlx-lm prefixes the weights' names itself (`language_model.`).
"""

from __future__ import annotations

from ..common.rope_keys import with_top_level_rope

__all__ = ["to_mlx_lm", "from_mlx_lm"]

# transformers' text-model type -> the multimodal type mlx-lm reads it under (as `text_config`)
_NESTED = {"qwen3_5_text": "qwen3_5", "qwen3_5_moe_text": "qwen3_5_moe"}
# keys an mlx-lm model requires that transformers' config of the same model lacks: {model_type: {key: value}}
_REQUIRED = {"glm_moe_dsa": {"topk_method": "noaux_tc", "scoring_func": "sigmoid", "moe_layer_freq": 1},
             # mlx-lm's MiniMax arguments require it and never read it; MiniMax-M2 has no shared expert
             "minimax_m2": {"shared_intermediate_size": 0}}


def _default_head_dim(config: dict):
    """transformers' Qwen3-MoE attention: getattr(config, "head_dim", hidden_size // num_attention_heads)."""
    hidden, heads = config.get("hidden_size"), config.get("num_attention_heads")
    return hidden // heads if isinstance(hidden, int) and isinstance(heads, int) and heads > 0 else None


# keys mlx-lm requires that transformers 5 leaves out or names otherwise: {model_type: {key: value from the config}}
_DERIVED = {"qwen3_moe": {"num_experts": lambda c: c.get("num_local_experts"), "head_dim": _default_head_dim}}
# what the writer keeps at the top level of a nested config (mlx_lm.load reads them there)
_TOP_LEVEL = ("quantization", "quantization_config", "tie_word_embeddings", "eos_token_id", "bos_token_id")


def to_mlx_lm(config: dict) -> dict:
    """The config.json mlx-lm 0.32 loads for the model transformers describes with `config`."""
    model_type = config.get("model_type")
    out = with_top_level_rope(dict(config), ("rope_theta", "partial_rotary_factor"), scaling=True)
    for key, value in _REQUIRED.get(model_type, {}).items():
        out.setdefault(key, value)
    for key, derive in _DERIVED.get(model_type, {}).items():
        value = derive(config)
        if key not in out and value is not None:
            out[key] = value
    if model_type in _NESTED:
        text = {k: v for k, v in config.items() if k not in ("quantization", "quantization_config")}
        out = {"model_type": _NESTED[model_type], "text_config": text,
               **{k: config[k] for k in _TOP_LEVEL if k in config}}
    return out


def from_mlx_lm(config: dict) -> dict:
    """The transformers config of a folder `to_mlx_lm` wrote: a nested Qwen3.5 text model unnested (with the
    folder's quantization entries); anything else as it is (the keys added above are ones transformers
    ignores or reads the same). A released Qwen3.5 (a `vision_config` beside the text one, a vision tower
    in the weights) stays nested: it is the multimodal model."""
    text = config.get("text_config")
    if isinstance(text, dict) and _NESTED.get(text.get("model_type")) == config.get("model_type") \
            and "vision_config" not in config:
        return {**text, **{k: config[k] for k in ("quantization", "quantization_config") if k in config}}
    return config
