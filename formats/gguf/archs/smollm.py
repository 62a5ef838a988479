"""SmolLM3 (SmolLM3ForCausalLM): llama's blocks, every 4th layer without rope (NoPE), as llama.cpp's
architecture `smollm3`.

llama.cpp hard-codes the NoPE layers (smollm3's n_no_rope_layer_step = 4: layer i rotates unless (i + 1) % 4
== 0), which is transformers' default `no_rope_layers` (no_rope_layer_interval 4) and what SmolLM3-3B ships;
no GGUF key carries another pattern, so a config with another one is warned about (caveats). The converter
writes no key for it either. q/k rows are permuted as llama's (its SmolLM3 model is a LlamaModel).
"""

from __future__ import annotations

from typing import Mapping

import gguf

from .base import GgufArch, llama_converter_keys, register_arch

# llama.cpp's smollm3: hparams.n_no_rope_layer_step
NO_ROPE_STEP = 4


def llama_cpp_no_rope_layers(n_layers: int) -> list[int]:
    """transformers' no_rope_layers (1: the layer rotates) as llama.cpp's smollm3 runs them."""
    return [0 if (i + 1) % NO_ROPE_STEP == 0 else 1 for i in range(n_layers)]


def _smollm3_extra(writer: gguf.GGUFWriter, config: Mapping) -> None:
    llama_converter_keys(writer, config)


def _smollm3_caveats(config: Mapping) -> list[str]:
    layers = config.get("no_rope_layers")
    n = config.get("num_hidden_layers")
    if isinstance(layers, list) and isinstance(n, int) and [int(x) for x in layers] != llama_cpp_no_rope_layers(n):
        return [f"no_rope_layers {layers} is not every {NO_ROPE_STEP}th layer without rope, which llama.cpp's "
                "smollm3 hard-codes"]
    if config.get("use_sliding_window"):
        return ["use_sliding_window is true but llama.cpp's smollm3 attends to the whole context"]
    return []


def _smollm3_config(cfg: dict, get, names, cv) -> None:
    n = cfg["num_hidden_layers"]
    cfg.update(no_rope_layers=llama_cpp_no_rope_layers(n), no_rope_layer_interval=NO_ROPE_STEP,
               use_sliding_window=False, sliding_window=None,
               attention_bias=bool(names and "blk.0.attn_q.bias" in names),
               mlp_bias=bool(names and "blk.0.ffn_up.bias" in names),
               pad_token_id=None)  # the GGUF's padding token, if any, replaces it; else not SmolLM3's 128004


register_arch(GgufArch("smollm3", ("SmolLM3ForCausalLM",), ("smollm3",), "SmolLM3ForCausalLM", "smollm3",
                       permute_qk=True, extra_metadata=_smollm3_extra, caveats=_smollm3_caveats,
                       config_from_gguf=_smollm3_config))
