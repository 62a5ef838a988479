"""Llama 4's text model (Llama4ForCausalLM; the text part of Llama4ForConditionalGeneration, the released
checkpoints' class, whose vision tower is left out as llama.cpp's converter leaves it: `multimodal`) as llama.cpp's
`llama4`.

- Rope rotates adjacent pairs (transformers' complex-number rope), which is ggml's NORM rope as stored: no q/k
  permutation (the converter's Llama4Model sets undo_permute False).
- MoE every `interleave_moe_layer_step`-th layer (llama4.interleave_moe_layer_step), the others dense and
  `intermediate_size_mlp` wide (feed_forward_length; the experts' width, HF's intermediate_size, is
  expert_feed_forward_length), each MoE layer with one shared expert of the experts' width.
- The experts are fused and transposed in HF ([experts, in, out]: gate_up_proj [E, hidden, 2 * ffn] with the gate
  columns first, down_proj [E, ffn, hidden]); llama.cpp stacks [E, out, in] per projection. split/merge below.
- What llama.cpp hard-codes (models/llama4.cpp load_arch_hparams): chunked attention of 8192 tokens in 3 of
  every 4 layers, the 4th without rope (NoPE); attention temperature tuning with floor 8192 and scale 0.1;
  the L2 q/k norm in the rope layers except for the 128-expert model. Only `sliding_window` 0 (every layer full,
  the converter's MobileLLM case) switches the chunks off. A config asking otherwise is warned about (caveats).
"""

from __future__ import annotations

import re
from typing import Mapping

import gguf
import torch

from .base import SHARED_EXPERT, GgufArch, TextOfMultimodal, expert_keys, moe_config, register_arch, llama_converter_keys

LLAMA4_BLOCK = ("input_layernorm", "post_attention_layernorm", "self_attn.q_proj", "self_attn.k_proj",
                "self_attn.v_proj", "self_attn.o_proj", "feed_forward.gate_proj", "feed_forward.up_proj",
                "feed_forward.down_proj", "feed_forward.router", "feed_forward.experts.gate_proj",
                "feed_forward.experts.up_proj", "feed_forward.experts.down_proj",
                "feed_forward.shared_expert.gate_proj", "feed_forward.shared_expert.up_proj",
                "feed_forward.shared_expert.down_proj")
# what llama.cpp's llama4 hard-codes (load_arch_hparams), as the released models have it
CHUNK, FLOOR_SCALE, ATTN_SCALE, NO_ROPE_STEP = 8192, 8192, 0.1, 4

_FUSED = re.compile(r"^(?P<head>.*\.experts\.)(?P<what>gate_up_proj|down_proj)$")


def llama4_expert_part(hf_name: str) -> tuple[str, str] | None:
    """(`...feed_forward.experts.`, "gate_up_proj" or "down_proj") of a Llama 4 fused expert tensor, else None."""
    m = _FUSED.match(hf_name)
    return None if m is None else (m["head"], m["what"])


def split_llama4_experts(what: str, tensor: torch.Tensor) -> list[torch.Tensor]:
    """[E, in, out] -> llama.cpp's [E, out, in] stacks: gate_up_proj [E, h, 2f] -> gate, up [E, f, h] (the gate
    columns first); down_proj [E, f, h] -> [E, h, f]."""
    t = tensor.transpose(-1, -2)
    if what == "down_proj":
        return [t.contiguous()]
    f = t.shape[1] // 2
    return [t[:, :f].contiguous(), t[:, f:].contiguous()]


def merge_llama4_experts(gate: torch.Tensor, up: torch.Tensor | None = None, bias: bool = False) -> torch.Tensor:
    """The inverse of split_llama4_experts: gate and up [E, f, h] -> gate_up_proj [E, h, 2f]; `up` None: the down
    stack [E, h, f] -> down_proj [E, f, h]. (`bias`: Llama 4 has none; kept for the reader's one signature.)"""
    if up is None:
        return gate.transpose(-1, -2).contiguous()
    return torch.cat([gate, up], dim=1).transpose(-1, -2).contiguous()


def _llama4_extra(writer: gguf.GGUFWriter, config: Mapping) -> None:
    llama_converter_keys(writer, config)
    expert_keys(writer, config)
    writer.add_interleave_moe_layer_step(int(config.get("interleave_moe_layer_step") or 1))
    writer.add_expert_feed_forward_length(int(config["intermediate_size"]))
    types = config.get("layer_types")
    if isinstance(types, list) and types and all(t == "full_attention" for t in types):
        writer.add_sliding_window(0)  # no chunks (MobileLLM), as the converter writes it


def _llama4_caveats(config: Mapping) -> list[str]:
    out = []
    types = config.get("layer_types")
    full = isinstance(types, list) and types and all(t == "full_attention" for t in types)
    if not full and config.get("attention_chunk_size") not in (None, CHUNK):
        out.append(f"attention_chunk_size {config['attention_chunk_size']} is not {CHUNK}, which llama.cpp's llama4 "
                   "hard-codes")
    n = config.get("num_hidden_layers")
    nope = config.get("no_rope_layers")
    if not full and isinstance(nope, list) and isinstance(n, int) and \
            [int(x) for x in nope] != [int((i + 1) % NO_ROPE_STEP != 0) for i in range(n)]:
        out.append(f"no_rope_layers {nope} is not every {NO_ROPE_STEP}th layer without rope, which llama.cpp's "
                   "llama4 hard-codes")
    if not full and (config.get("attn_temperature_tuning") is False or config.get("floor_scale", FLOOR_SCALE)
                     != FLOOR_SCALE or config.get("attn_scale", ATTN_SCALE) != ATTN_SCALE):
        out.append(f"attention temperature tuning (attn_temperature_tuning, floor_scale, attn_scale) differs from "
                   f"llama.cpp's hard-coded on / {FLOOR_SCALE} / {ATTN_SCALE}")
    return out


def _llama4_config(cfg: dict, get, names, cv) -> None:
    moe_config(cfg, get, names, cv)
    # the experts' width is HF's intermediate_size, the dense layers' intermediate_size_mlp
    cfg["intermediate_size_mlp"] = cfg["intermediate_size"]
    cfg["intermediate_size"] = cfg.pop("moe_intermediate_size", cfg["intermediate_size"])
    cfg["interleave_moe_layer_step"] = get("interleave_moe_layer_step", 1, lo=0, hi=cfg["num_hidden_layers"])
    n = cfg["num_hidden_layers"]
    window = get("attention.sliding_window", lo=0)
    if window == 0:  # every layer full and rotating (llama.cpp: swa none, n_no_rope_layer_step = n_layer)
        cfg.update(layer_types=["full_attention"] * n, no_rope_layers=[1] * n, attention_chunk_size=None)
    else:
        nope = [int((i + 1) % NO_ROPE_STEP != 0) for i in range(n)]
        cfg.update(no_rope_layers=nope, attention_chunk_size=CHUNK,
                   layer_types=["chunked_attention" if r else "full_attention" for r in nope])
    # llama.cpp: the L2 q/k norm everywhere but in the 128-expert model
    cfg.update(use_qk_norm=cfg.get("num_local_experts") != 128, attn_temperature_tuning=True,
               floor_scale=FLOOR_SCALE, attn_scale=ATTN_SCALE, no_rope_layer_interval=NO_ROPE_STEP,
               attention_bias=False, pad_token_id=None)


# the released checkpoints' class (a vision tower beside the text model): llama.cpp's converter writes its text
# model as llama4 (Llama4Model registers both classes) and the tower only into an mmproj file (Llama4VisionModel)
LLAMA4_MULTIMODAL = TextOfMultimodal(("Llama4ForConditionalGeneration",))

register_arch(GgufArch("llama4", ("Llama4ForCausalLM", "Llama4ForConditionalGeneration"), ("llama4_text",),
                       "Llama4ForCausalLM", "llama4_text", moe=True, multimodal=LLAMA4_MULTIMODAL, extra_metadata=_llama4_extra, caveats=_llama4_caveats, hf_block=LLAMA4_BLOCK,
                       config_from_gguf=_llama4_config, experts_in_out=True, dense_ffn_key="intermediate_size_mlp",
                       routed_extra=SHARED_EXPERT))  # llama.cpp's llama4 loader: every MoE layer's shared expert
