"""The model families qconvert writes to GGUF and reads back: one entry (`GgufArch`) per llama.cpp architecture.

An entry says which Hugging Face classes map to it, how its hyper-parameters become `{arch}.*` metadata (as
llama.cpp's convert_hf_to_gguf.py writes them and its llama-model.cpp reads them) and come back into a
config.json, which HF modules its blocks hold, which tensors every layer must have, and its tensor quirks:

- `permute_qk`: llama's q/k rows are reordered from HF's rotate-half rope to ggml's NORM rope (names.py);
- `norm_shift`: Gemma's RMSNorm multiplies by `1 + w` while llama.cpp multiplies by the stored value,
  so every `*norm.weight` is written as `w + 1` (and read back as `value - 1`);
- experts: HF keeps one 2-D tensor per expert (`...experts.<e>.gate_proj.weight`), GGUF one 3-D tensor
  per layer (`blk.N.ffn_gate_exps.weight`, experts outermost); the stacking is the writer's
  (writer.GgufSession), the naming `expert_name` here;
- gpt-oss keeps its experts fused and transposed ([experts, in, out], gate and up columns interleaved in
  gate_up_proj, biases per expert): gpt_oss.py turns them into llama.cpp's stacks and back.
- Llama 4 keeps them fused and transposed too, gate columns then up (`experts_in_out`, llama4.py); its dense
  layers' width is another config key (`dense_ffn_key`); OLMo 2/3 and MiniMax-M2 normalise the whole q/k
  projection (`qk_norm_whole`); the multi-token-prediction blocks (DeepSeek-V3,
  GLM-4.5 / GLM-5, Qwen3.5 / Qwen3-Next, ERNIE 4.5) are one description each (`mtp`, mtp.py): kept or skipped
  as llama.cpp's converter does by default, dropped with --no-mtp.

A new architecture is one module here that calls `register_arch` (base.py), imported below; the names
themselves come from gguf-py's `TensorNameMap` for the architecture (names.py), or from the entry's own
`name_table` where the installed gguf-py does not name the architecture (deepseek4, kimi-k3: names.py's
`ArchNameTable` says when a new one needs it).
"""

from . import llama, qwen, gemma, deepseek2, phi3, gpt_oss  # noqa: F401  (each registers its entries, in this order)
from . import mistral3, smollm, olmo, exaone, llama4, glm  # noqa: F401  (issue 26: Ministral 3, SmolLM3, OLMo 2/3, EXAONE 4,
#                                                           Llama 4, GLM-4.5)
from . import minimax, ernie  # noqa: F401  (issue 26: MiniMax-M2, ERNIE 4.5 MoE)
from .llama4 import llama4_expert_part, merge_llama4_experts, split_llama4_experts
from . import glm_dsa  # noqa: F401  (GLM-5: MLA + the DSA indexer)
from . import qwen35  # noqa: F401  (Qwen3.5: hybrid linear attention)
from . import gemma4  # noqa: F401  (Gemma 4: MoE beside the MLP, per-layer embeddings, KV-shared layers)
from . import deepseek4  # noqa: F401  (DeepSeek-V4: an arch-local name and key table; gguf 0.19 lacks it)
from . import kimi_k3  # noqa: F401  (Kimi-K3: its own name table, gguf 0.19 has no kimi-k3)
from .base import (EXPERT_COUNT_KEYS, GgufArch, arch_by_name, arch_for_config, expert_count, expert_count_key,
                   expert_name, register_arch, registered, supported_classes)
from .deepseek2 import KV_B_HALVES, kv_b_parts, kv_b_value_rows, merge_kv_b, split_kv_b
from .gpt_oss import GPT_OSS_SWIGLU, gpt_oss_expert_part, gpt_oss_layer_types, merge_gpt_oss_experts, split_gpt_oss_experts

__all__ = ["GgufArch", "register_arch", "registered", "arch_by_name", "arch_for_config", "supported_classes",
           "expert_name", "EXPERT_COUNT_KEYS", "expert_count", "expert_count_key", "kv_b_parts", "split_kv_b",
           "merge_kv_b", "gpt_oss_expert_part", "split_gpt_oss_experts", "merge_gpt_oss_experts", "GPT_OSS_SWIGLU",
           "gpt_oss_layer_types", "llama4_expert_part", "split_llama4_experts", "merge_llama4_experts",
           "kv_b_value_rows", "KV_B_HALVES"]
