"""Tiny models 256 wide of the MoE and newer architectures, shaped to exercise llama-quantize's preset
rules (tests/formats/gguf/test_gguf_presets_moe.py): K-type super-blocks need rows of 256, layer positions need
several layers (use_more_bits splits 8 layers into first/last eighth and every third), the n_expert == 8
rules need 8 experts, and a few rows are deliberately not whole 256-blocks (DeepSeek's MLA k_b rows of
48 and attn_output rows of 128, Gemma 2's 192-wide heads) so that the shape fallback is hit, down to F16.

Each model is a real transformers ``*ForCausalLM`` with its default random weights (the types do not
depend on the values), saved in float16 with the offline byte-level BPE tokenizer of fixtures.py.
"""

from __future__ import annotations

import json
from pathlib import Path

VOCAB = 512


from fixtures_archs import _fixtures  # tests/support/fixtures.py, loaded by path


def _common(layers: int, ffn: int, tie: bool, heads: int = 4, kv_heads: int = 2) -> dict:
    return dict(vocab_size=VOCAB, hidden_size=256, intermediate_size=ffn, num_hidden_layers=layers,
                num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=256,
                tie_word_embeddings=tie, bos_token_id=1, eos_token_id=0, pad_token_id=None)


def _mixtral():
    from transformers import MixtralConfig, MixtralForCausalLM
    # 8 experts: llama.cpp's n_expert == 8 rules (attn_v / attn_k Q8_0, attn_output Q5_K); 8 layers
    cfg = MixtralConfig(**_common(8, 256, tie=False), head_dim=64, num_local_experts=8, num_experts_per_tok=2)
    return cfg, MixtralForCausalLM, {}


def _qwen2_moe():
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM
    # 4 experts (n_expert > 1 but not 8) plus a gated shared expert, 6 layers
    cfg = Qwen2MoeConfig(**_common(6, 512, tie=False), num_experts=4, num_experts_per_tok=2,
                         moe_intermediate_size=256, shared_expert_intermediate_size=512, norm_topk_prob=False,
                         qkv_bias=True, decoder_sparse_step=1, mlp_only_layers=[], use_sliding_window=False)
    return cfg, Qwen2MoeForCausalLM, {}


def _qwen3_moe():
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
    # 8 experts, 4 layers, 8 heads on 2 KV heads (GQA 4: Q2_K's attn_v rule)
    cfg = Qwen3MoeConfig(**_common(4, 512, tie=False, heads=8, kv_heads=2), head_dim=32, num_experts=8,
                         num_experts_per_tok=2, moe_intermediate_size=256, norm_topk_prob=True,
                         decoder_sparse_step=1, mlp_only_layers=[], use_sliding_window=False)
    return cfg, Qwen3MoeForCausalLM, {}


def _gemma2():
    from transformers import Gemma2Config, Gemma2ForCausalLM
    # tied embeddings (the output rule on token_embd); heads of 48: attn_output rows of 192 (Q5_0 fallback)
    cfg = Gemma2Config(**_common(3, 512, tie=True), head_dim=48, query_pre_attn_scalar=48, sliding_window=8,
                       hidden_activation="gelu_pytorch_tanh")
    return cfg, Gemma2ForCausalLM, {}


def _gemma3():
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig
    cfg = Gemma3TextConfig(**_common(7, 512, tie=True), head_dim=64, query_pre_attn_scalar=64, sliding_window=8,
                           hidden_activation="gelu_pytorch_tanh")
    return cfg, Gemma3ForCausalLM, {}


def _phi3():
    from transformers import Phi3Config, Phi3ForCausalLM
    # fused attn_qkv (an attn_v-like tensor for llama.cpp's counters) and fused ffn_up; 9 layers
    cfg = Phi3Config(**_common(9, 512, tie=False), original_max_position_embeddings=256, sliding_window=None)
    return cfg, Phi3ForCausalLM, {"tokenizer_class": "GPT2Tokenizer"}


def _deepseek_v3():
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM
    # MLA: q LoRA 256, kv LoRA 256; k_b rows are qk_nope = 48 (not even a 32-block: F16), attn_output rows
    # 4 * v_head 32 = 128 (the legacy fallback); 8 routed experts + 1 shared, the first 2 of 5 layers dense
    cfg = DeepseekV3Config(**_common(5, 512, tie=False), moe_intermediate_size=256, n_routed_experts=8,
                           num_experts_per_tok=2, n_shared_experts=1, n_group=1, topk_group=1,
                           first_k_dense_replace=2, norm_topk_prob=True, q_lora_rank=256, kv_lora_rank=256,
                           qk_nope_head_dim=48, qk_rope_head_dim=16, v_head_dim=32, rope_interleave=True,
                           num_nextn_predict_layers=0)
    cfg.num_key_value_heads = cfg.num_attention_heads  # MLA: every head has its own decompressed k/v
    return cfg, DeepseekV3ForCausalLM, {}


def _falcon():
    from transformers import FalconConfig, FalconForCausalLM
    # falcon has branches of its own (output Q8_0, ffn_down by layer for Q3_K_M / Q4_K_M); Falcon-40B's
    # layout: fused query_key_value over 2 KV groups, two layer norms; tied embeddings as Falcon ships
    cfg = FalconConfig(vocab_size=VOCAB, hidden_size=256, num_hidden_layers=8, num_attention_heads=4, num_kv_heads=2,
                       new_decoder_architecture=True, parallel_attn=True, bias=False, tie_word_embeddings=True,
                       bos_token_id=1, eos_token_id=0)
    return cfg, FalconForCausalLM, {}


BUILDERS = {"mixtral": _mixtral, "qwen2_moe": _qwen2_moe, "qwen3_moe": _qwen3_moe, "gemma2": _gemma2,
            "gemma3": _gemma3, "phi3": _phi3, "deepseek_v3": _deepseek_v3, "falcon": _falcon}
KINDS = tuple(BUILDERS)


def build_preset_model(out_dir, kind: str, seed: int = 0) -> Path:
    """The ``kind`` model (float16 safetensors, config, tokenizer) in ``out_dir``."""
    import torch

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    cfg, cls, tok_extra = BUILDERS[kind]()
    torch.manual_seed(seed)
    model = cls(cfg).eval()
    model.to(torch.float16).save_pretrained(str(out), safe_serialization=True)
    _fixtures().build_tokenizer(out)
    if tok_extra:
        path = out / "tokenizer_config.json"
        path.write_text(json.dumps({**json.loads(path.read_text()), **tok_extra}, indent=2) + "\n")
    return out
