"""DeepSeek-V4's release names (deepseek-ai/DeepSeek-V4-Flash: `embed.weight`, `layers.N.attn.wq_a.weight`,
`head.weight`...) as transformers names them: the renames of transformers' conversion_mapping.py, applied to the
float release (formats/hf/deepseek_v4.py) and to the quantized checkpoints producers save under the release's names
(formats/common/checkpoint.py CheckpointSource, for the gptq, auto-round and compressed-tensors readers). Here, in
formats/common, because those readers must not import a format's room (tests/core/test_core_import_rules.py).
"""

from __future__ import annotations

import re
from typing import Callable

__all__ = ["release_name_to_hf", "quantized_release_names"]

# transformers 5.24's conversion_mapping.py "deepseek_v4" renames, in its order (each applied to the result of
# the ones before), then the per-expert projections and the `model.` prefix of every name but the head
_RENAMES = tuple((re.compile(a), b) for a, b in (
    (r"\.attn\.", ".self_attn."), (r"\.ffn\.", ".mlp."), (r"\.indexer\.compressor\.", ".compressor.indexer."),
    (r"^embed\.weight$", "embed_tokens.weight"), (r"^head\.weight$", "lm_head.weight"),
    (r"^hc_head_fn$", "hc_head.hc_fn"), (r"^hc_head_base$", "hc_head.hc_base"), (r"^hc_head_scale$", "hc_head.hc_scale"),
    (r"\.attn_norm\.", ".input_layernorm."), (r"\.ffn_norm\.", ".post_attention_layernorm."),
    (r"\.hc_attn_fn$", ".attn_hc.fn"), (r"\.hc_attn_base$", ".attn_hc.base"), (r"\.hc_attn_scale$", ".attn_hc.scale"),
    (r"\.hc_ffn_fn$", ".ffn_hc.fn"), (r"\.hc_ffn_base$", ".ffn_hc.base"), (r"\.hc_ffn_scale$", ".ffn_hc.scale"),
    (r"\.attn_sink$", ".sinks"), (r"\.indexer\.weights_proj\.", ".compressor.indexer.scorer.weights_proj."),
    (r"\.indexer\.wq_b\.", ".compressor.indexer.q_b_proj."), (r"\.norm\.", ".kv_norm."), (r"\.ape$", ".position_bias"),
    (r"\.wq_a\.", ".q_a_proj."), (r"\.self_attn\.wq_b\.", ".self_attn.q_b_proj."), (r"\.wkv\.", ".kv_proj."),
    (r"\.wgate\.", ".gate_proj."), (r"\.wo_a\.", ".o_a_proj."), (r"\.wo_b\.", ".o_b_proj."),
    (r"\.q_norm\.", ".q_a_norm."), (r"\.gate\.bias$", ".gate.e_score_correction_bias"),
    (r"\.shared_experts\.w1\.", ".shared_experts.gate_proj."), (r"\.shared_experts\.w2\.", ".shared_experts.down_proj."),
    (r"\.shared_experts\.w3\.", ".shared_experts.up_proj."),
    (r"\.experts\.(\d+)\.w1\.", r".experts.\1.gate_proj."), (r"\.experts\.(\d+)\.w2\.", r".experts.\1.down_proj."),
    (r"\.experts\.(\d+)\.w3\.", r".experts.\1.up_proj.")))


def release_name_to_hf(name: str) -> str:
    """The transformers name of a released tensor (`layers.3.attn.wq_a.weight` ->
    `model.layers.3.self_attn.q_a_proj.weight`); `mtp.*` and names already transformers' pass unchanged."""
    if name.startswith(("mtp.", "model.")) or name == "lm_head.weight":
        return name
    for pattern, repl in _RENAMES:
        name = pattern.sub(repl, name)
    return name if name == "lm_head.weight" else "model." + name


# A name of the release's, as quantized checkpoints made from the release-named float folder keep them: auto-round
# 0.16's model-free mode (it quantizes the files, no model is built) writes `head.weight`, `embed.weight`,
# `layers.N.attn.wq_a.qweight`; llm-compressor 0.14 loads the folder into transformers 5.17, whose save maps the
# names back only in part: `model.layers.N.attn.wq_a.weight_packed`, `head.weight`, beside transformers'
# `model.embed_tokens.weight` / `model.norm.weight` / `model.hc_head.*`
_RELEASE_NAMED = re.compile(r"^(?:model\.)?(?:embed\.weight$|head\.weight$|hc_head_fn$|layers\.\d+\.(?:attn|ffn)\.)")


def _quantized_name_to_hf(name: str) -> str:
    return release_name_to_hf(name.removeprefix("model."))


def quantized_release_names(config: dict, names) -> Callable[[str], str] | None:
    """For a quantized DeepSeek-V4 checkpoint (config.json model_type deepseek_v4) whose tensor `names` are the
    release's, with or without llm-compressor's `model.` prefix (some or all of them): the function giving a
    tensor name of it transformers' (`release_name_to_hf` after the prefix is dropped; transformers' own names,
    the rest of llm-compressor's, pass unchanged: the renames touch none of them). None for a checkpoint already
    in transformers' names (gptqmodel's: it saves the loaded model's) or of another model."""
    if not isinstance(config, dict) or config.get("model_type") != "deepseek_v4":
        return None
    return _quantized_name_to_hf if any(_RELEASE_NAMED.match(n) for n in names) else None
