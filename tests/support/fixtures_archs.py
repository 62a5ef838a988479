"""Tiny random transformers models of the architectures beyond Llama/Qwen2/Qwen3 that qconvert writes to
GGUF: mixtral, qwen2_moe, qwen3_moe, gemma2, gemma3 (text), phi3 (Phi-4 style), deepseek_v3 and gpt_oss
(dense float experts: the MXFP4 `_blocks`/`_scales` form is not built here).

Each is a real ``*ForCausalLM`` of transformers 5.24 with seeded weights, saved in float32 safetensors
with the offline byte-level BPE tokenizer of fixtures.py (vocab 512). The configs are chosen so that
llama.cpp runs the same model as transformers (checked against llama.cpp's own converter with
scripts/llama_cpp_reference.py); where llama.cpp hard-codes something the config could vary, the
config takes llama.cpp's value (see the comments at each builder).

Widths: every linear in-feature is a multiple of 32 (Q8_0/Q4_0 blocks); ``wide=True`` makes them
multiples of 256 (K-quant super-blocks).

Weights are drawn so that the logits are far from uniform: linear weights ~ N(0, 1/fan_in), RMSNorm
weights 1 +- 0.1 (Gemma stores w with the norm applying 1 + w, so w ~ N(0, 0.1) there), embeddings
N(0, 1) (N(0, 1/hidden) when tied to the output), biases N(0, 0.1), DeepSeek's router correction bias
N(0, 0.5) so that it changes which experts are chosen. gpt-oss: attention sinks N(0, 1) (they take
a visible share of each softmax), expert weights stored [experts, in, out] drawn with fan_in = in and
gate_up scaled by 4 so that the SwiGLU clamp at 7 (swiglu_limit) bites on some activations.

Load by path (pytest runs with --import-mode=importlib)::

    spec = importlib.util.spec_from_file_location("fixtures_archs", Path(__file__).with_name("fixtures_archs.py"))
"""

from __future__ import annotations

import importlib.util
import json
import random
import re
import sys
from pathlib import Path
from typing import Callable, Dict, List, Tuple

KINDS = ("mixtral", "qwen2_moe", "qwen3_moe", "gemma2", "gemma3", "phi3", "deepseek_v3", "gpt_oss")
ARCH_PROMPT_LEN = 16
ARCH_PROMPT_SEED = 2718


def _fixtures():
    """tests/support/fixtures.py, loaded by path (its tokenizer and vocab size)."""
    name = "qconvert_test_fixtures"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, Path(__file__).with_name("fixtures.py"))
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod
        spec.loader.exec_module(mod)
    return sys.modules[name]


def arch_prompt(n: int = ARCH_PROMPT_LEN) -> List[int]:
    """A fixed prompt of ``n`` token ids in [2, 512) (0 and 1 are the special tokens). Longer than the
    Gemma sliding windows of these fixtures (8), so that the window is exercised."""
    rng = random.Random(ARCH_PROMPT_SEED)
    return [rng.randint(2, _fixtures().VOCAB_SIZE - 1) for _ in range(n)]


# --------------------------------------------------------------------------------------------------
# Sizes
# --------------------------------------------------------------------------------------------------
def _dims(wide: bool) -> dict:
    """hidden, head_dim (4 heads: o_proj in-features 4 * head_dim = hidden), dense ffn, expert ffn."""
    if wide:
        return dict(hidden=256, head_dim=64, ffn=512, moe_ffn=256)
    return dict(hidden=128, head_dim=32, ffn=256, moe_ffn=64)


def _common(layers: int, hidden: int, ffn: int, tie: bool) -> dict:
    return dict(vocab_size=_fixtures().VOCAB_SIZE, hidden_size=hidden, intermediate_size=ffn,
                num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                max_position_embeddings=256, tie_word_embeddings=tie, bos_token_id=1, eos_token_id=0,
                pad_token_id=None)


# --------------------------------------------------------------------------------------------------
# Configs, one per kind: (config, model class, extra tokenizer_config entries)
# --------------------------------------------------------------------------------------------------
def _mixtral(layers: int, wide: bool):
    from transformers import MixtralConfig, MixtralForCausalLM
    d = _dims(wide)
    # intermediate_size is the expert width in Mixtral (there is no dense ffn)
    cfg = MixtralConfig(**_common(layers, d["hidden"], d["moe_ffn"], tie=False), head_dim=d["head_dim"],
                        num_local_experts=4, num_experts_per_tok=2, rms_norm_eps=1e-5,
                        rope_parameters={"rope_type": "default", "rope_theta": 1e6})
    return cfg, MixtralForCausalLM, {}


def _qwen2_moe(layers: int, wide: bool):
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM
    d = _dims(wide)
    # q/k/v biases (qkv_bias, Qwen1.5-MoE's default), a gated shared expert; norm_topk_prob False as
    # Qwen1.5-MoE-A2.7B, which llama.cpp's qwen2moe graph assumes (it never renormalises the top-k; the
    # shared expert's output is scaled by sigmoid(shared_expert_gate . x)).
    cfg = Qwen2MoeConfig(**_common(layers, d["hidden"], d["ffn"], tie=False), num_experts=4,
                         num_experts_per_tok=2, moe_intermediate_size=d["moe_ffn"],
                         shared_expert_intermediate_size=2 * d["moe_ffn"], norm_topk_prob=False,
                         qkv_bias=True, decoder_sparse_step=1, mlp_only_layers=[], use_sliding_window=False,
                         rms_norm_eps=1e-6, rope_parameters={"rope_type": "default", "rope_theta": 1e6})
    return cfg, Qwen2MoeForCausalLM, {}


def _qwen3_moe(layers: int, wide: bool):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
    d = _dims(wide)
    # norm_topk_prob True as in Qwen3-30B-A3B: llama.cpp's qwen3moe graph always renormalises the top-k
    # weights (and its qwen2moe graph never does). Every layer is MoE (decoder_sparse_step 1, no
    # mlp_only_layers): neither graph has dense layers.
    cfg = Qwen3MoeConfig(**_common(layers, d["hidden"], d["ffn"], tie=False), num_experts=4,
                         num_experts_per_tok=2, moe_intermediate_size=d["moe_ffn"], norm_topk_prob=True,
                         attention_bias=False, decoder_sparse_step=1, mlp_only_layers=[],
                         use_sliding_window=False, rms_norm_eps=1e-6,
                         rope_parameters={"rope_type": "default", "rope_theta": 1e6})
    return cfg, Qwen3MoeForCausalLM, {}


def _gemma2(layers: int, wide: bool):
    from transformers import Gemma2Config, Gemma2ForCausalLM
    d = _dims(wide)
    # llama.cpp scales queries by 1/sqrt(head_dim) (1/sqrt(hidden/heads) for the 27B) and does not read
    # query_pre_attn_scalar, so it must equal head_dim. The caps are small enough to bite on these
    # logits (Gemma 2 ships 50/30). layer_types: sliding, full, ... = llama.cpp's default pattern 2.
    cfg = Gemma2Config(**_common(layers, d["hidden"], d["ffn"], tie=True), head_dim=d["head_dim"],
                       query_pre_attn_scalar=d["head_dim"], sliding_window=8,
                       attn_logit_softcapping=5.0, final_logit_softcapping=10.0,
                       hidden_activation="gelu_pytorch_tanh", rms_norm_eps=1e-6,
                       rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    return cfg, Gemma2ForCausalLM, {}


def _gemma3(layers: int, wide: bool):
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig
    d = _dims(wide)
    # Sliding layers rope_theta 10000 (Gemma 3's rope_local_base_freq; written as rope.freq_base_swa),
    # global layers 1e6 (rope.freq_base). layer_types default to Gemma 3's pattern (5 sliding, then 1
    # full), which is what llama.cpp assumes without a sliding_window_pattern key (the reference converter
    # writes none): only 6+ layers have a global one. query_pre_attn_scalar = head_dim as for Gemma 2.
    cfg = Gemma3TextConfig(**_common(layers, d["hidden"], d["ffn"], tie=True), head_dim=d["head_dim"],
                           query_pre_attn_scalar=d["head_dim"], sliding_window=8,
                           hidden_activation="gelu_pytorch_tanh", rms_norm_eps=1e-6,
                           rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                            "full_attention": {"rope_type": "default", "rope_theta": 1e6}})
    return cfg, Gemma3ForCausalLM, {}


def _phi3(layers: int, wide: bool):
    from transformers import Phi3Config, Phi3ForCausalLM
    d = _dims(wide)
    # Phi-4: untied, no sliding window (llama.cpp tells Phi-4 from Phi-3 by sliding_window 0), full rotary
    # (partial_rotary_factor 1.0), no long-rope factors, GPT2Tokenizer (byte-level BPE).
    cfg = Phi3Config(**_common(layers, d["hidden"], d["ffn"], tie=False), rms_norm_eps=1e-5,
                     original_max_position_embeddings=256, sliding_window=None,
                     rope_parameters={"rope_type": "default", "rope_theta": 250000.0,
                                      "partial_rotary_factor": 1.0})
    # the converter reads Phi-4's byte-level BPE vocab only when tokenizer_class says GPT2Tokenizer
    return cfg, Phi3ForCausalLM, {"tokenizer_class": "GPT2Tokenizer"}


def _deepseek_v3(layers: int, wide: bool):
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM
    d = _dims(wide)
    # MLA with a q LoRA; layer 0 dense, the rest MoE with one shared expert; sigmoid routing with the
    # correction bias, one expert group (n_group = topk_group = 1: no group pruning); rope_interleave True
    # (DeepSeek-V3's checkpoints: llama.cpp's NORM rope rotates adjacent pairs); no MTP layer (transformers
    # builds none, so none is saved).
    nope = 256 if wide else 32
    rank = 256 if wide else 64
    cfg = DeepseekV3Config(**_common(layers, d["hidden"], d["ffn"], tie=False), moe_intermediate_size=d["moe_ffn"],
                           n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1, n_group=1,
                           topk_group=1, first_k_dense_replace=1, routed_scaling_factor=2.5,
                           norm_topk_prob=True, q_lora_rank=rank, kv_lora_rank=rank,
                           qk_nope_head_dim=nope, qk_rope_head_dim=16, v_head_dim=d["head_dim"],
                           rope_interleave=True, num_nextn_predict_layers=0, rms_norm_eps=1e-6,
                           rope_parameters=_deepseek_rope())
    cfg.num_key_value_heads = cfg.num_attention_heads  # MLA: every head has its own decompressed k/v
    # DeepSeek-V3's config.json carries these (transformers ignores them: its router is always sigmoid
    # with the correction bias); llama.cpp's deepseek2 reads expert_gating_func, written from
    # scoring_func, and falls back to softmax (DeepSeek-V2) without it.
    cfg.scoring_func = "sigmoid"
    cfg.topk_method = "noaux_tc"
    return cfg, DeepseekV3ForCausalLM, {}


def _deepseek_rope() -> dict:
    """YaRN as DeepSeek-V3 ships it (factor 40 over 4096 there; 4 over 64 here, so the 256 context is
    extended), mscale = mscale_all_dim = 1 (llama.cpp reads only mscale_all_dim and assumes mscale 1)."""
    return {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64,
            "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}


def _gpt_oss(layers: int, wide: bool):
    from transformers import GptOssConfig, GptOssForCausalLM
    d = _dims(wide)
    # gpt-oss-20b's shape in miniature: untied output (llama.cpp's gpt-oss requires output.weight), q/k/v/o
    # biases, one sink per head, a router with a bias, experts with biases; layer_types left to the default
    # (sliding, full, ...: llama.cpp's fixed pattern 2) with a window of 8 < the 16-token prompt; YaRN as
    # gpt-oss ships it (factor 32 over 4096 there, truncate false; 4 over 64 here) but truncate true:
    # llama.cpp always rounds the YaRN correction range (ggml_rope_yarn_corr_dims floors/ceils it), which
    # transformers does only with truncate true (the gpt-oss default false is measured in
    # test_gguf_archs.test_gpt_oss_yarn_truncate_false). swiglu_alpha/limit are llama.cpp's hard-coded
    # 1.702 / 7.0 (llama-graph.cpp, LLM_FFN_SWIGLU_OAI_MOE). intermediate_size is the expert width.
    cfg = GptOssConfig(**_common(layers, d["hidden"], d["moe_ffn"], tie=False), head_dim=d["head_dim"],
                       num_local_experts=4, num_experts_per_tok=2, sliding_window=8, rms_norm_eps=1e-5,
                       swiglu_alpha=1.702, swiglu_limit=7.0, attention_bias=True,
                       rope_parameters=_gpt_oss_rope())
    return cfg, GptOssForCausalLM, {}


def _gpt_oss_rope(truncate: bool = True) -> dict:
    return {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 4.0, "original_max_position_embeddings": 64,
            "beta_fast": 32.0, "beta_slow": 1.0, "truncate": truncate}


def _glm_moe_dsa(layers: int, wide: bool):
    from transformers import GlmMoeDsaConfig, GlmMoeDsaForCausalLM
    d = _dims(wide)
    # GLM-5 in miniature: MLA with a q LoRA, DeepSeek's sigmoid router with the correction bias, one shared
    # expert, dense lead layer(s), and the DSA indexer (64 heads: llama.cpp's indexer kernels want the head
    # count a multiple of 64, as every released GLM-5 / DeepSeek-V3.2 has). index_topk 8 < the 16-token
    # prompt, so the indexer's choice changes the logits; with 3+ layers the last one is "shared" (it
    # reuses the previous layer's top-k and has no indexer tensors), as GLM-5.2's pattern has them.
    nope = 256 if wide else 32
    rank = 256 if wide else 64
    indexer_types = ["full"] * layers if layers < 3 else ["full"] * (layers - 1) + ["shared"]
    cfg = GlmMoeDsaConfig(**_common(layers, d["hidden"], d["ffn"], tie=False), moe_intermediate_size=d["moe_ffn"],
                          n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1, n_group=1, topk_group=1,
                          first_k_dense_replace=1, routed_scaling_factor=2.5, norm_topk_prob=True,
                          q_lora_rank=rank, kv_lora_rank=rank, qk_nope_head_dim=nope, qk_rope_head_dim=16,
                          v_head_dim=d["head_dim"], index_n_heads=64, index_head_dim=64, index_topk=8,
                          indexer_types=indexer_types, rms_norm_eps=1e-5,
                          rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    cfg.num_key_value_heads = cfg.num_attention_heads  # MLA: every head has its own decompressed k/v
    return cfg, GlmMoeDsaForCausalLM, {}


# GLM's converters look their special tokens up by name (llama.cpp's _set_vocab_glm): the GLM fixtures'
# tokenizer has them as added special tokens after the trained vocabulary
GLM_SPECIAL_TOKENS = ("[gMASK]", "<|user|>", "<|observation|>", "<sop>")
GLM_KINDS = ("glm_moe_dsa",)


def _add_glm_tokens(out: Path) -> None:
    """Retrain the fixture tokenizer 4 short and append GLM's special tokens (the vocabulary stays 512;
    <|endoftext|> is already id 0)."""
    from tokenizers import AddedToken, Tokenizer

    fx = _fixtures()
    fx.build_tokenizer(out, vocab_size=fx.VOCAB_SIZE - len(GLM_SPECIAL_TOKENS))
    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in GLM_SPECIAL_TOKENS])
    assert tok.get_vocab_size() == fx.VOCAB_SIZE
    tok.save(str(out / "tokenizer.json"))
    path = out / "tokenizer_config.json"
    tok_cfg = json.loads(path.read_text())
    for t in GLM_SPECIAL_TOKENS:
        tok_cfg["added_tokens_decoder"][str(tok.token_to_id(t))] = {
            "content": t, "lstrip": False, "normalized": False, "rstrip": False, "single_word": False,
            "special": True}
    path.write_text(json.dumps(tok_cfg, indent=2) + "\n")


BUILDERS: Dict[str, Callable[[int, bool], Tuple[object, type, dict]]] = {
    "mixtral": _mixtral, "qwen2_moe": _qwen2_moe, "qwen3_moe": _qwen3_moe, "gemma2": _gemma2,
    "gemma3": _gemma3, "phi3": _phi3, "deepseek_v3": _deepseek_v3, "gpt_oss": _gpt_oss,
    "glm_moe_dsa": _glm_moe_dsa,
}
GEMMA_KINDS = ("gemma2", "gemma3")
# kind -> a function of the model folder that adds to the fixture tokenizer what the family's converter looks up
TOKENIZER_EXTRAS: Dict[str, Callable[[Path], None]] = {}


# --------------------------------------------------------------------------------------------------
# Hybrid linear-attention families (arch-hybrid): Qwen3.5
# --------------------------------------------------------------------------------------------------
HYBRID_KINDS = ("qwen3_5", "qwen3_5_moe", "qwen3_next")


def _qwen3_5(layers: int, wide: bool):
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig
    d = _dims(wide)
    # Qwen3.5 (dense): three Gated-DeltaNet (linear attention) layers then one full-attention layer, as the
    # released models repeat (full_attention_interval 4); linear attention with 2 key heads and 4 value heads, so llama.cpp's converter reorders the value heads (grouped -> tiled), as on the real models
    # (16 key / 32 value heads). Full attention: 4 heads of head_dim with the output gate (q_proj twice as
    # wide), rope on a quarter of each head (partial_rotary_factor 0.25) in MRoPE sections, which for text
    # (all sections at the same position) is plain rope. Layers 4 unless asked otherwise.
    layers = max(layers, 4)
    hd = d["head_dim"]
    cfg = Qwen3_5TextConfig(**_common(layers, d["hidden"], d["ffn"], tie=False), head_dim=hd,
                            linear_conv_kernel_dim=4, linear_key_head_dim=hd, linear_value_head_dim=hd,
                            linear_num_key_heads=2, linear_num_value_heads=4, rms_norm_eps=1e-6,
                            layer_types=["full_attention" if (i + 1) % 4 == 0 else "linear_attention"
                                         for i in range(layers)],
                            rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25,
                                             "mrope_section": [hd // 16, hd // 32, hd // 8 - hd // 16 - hd // 32],
                                             "mrope_interleaved": True})
    return cfg, Qwen3_5ForCausalLM, {}


BUILDERS["qwen3_5"] = _qwen3_5


def _qwen3_5_moe(layers: int, wide: bool):
    from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig
    d = _dims(wide)
    # Qwen3.5-MoE (35B-A3B's layout): the layer mix of _qwen3_5, every layer routed (4 experts, top 2,
    # renormalised as transformers' router always does) with a sigmoid-gated shared expert; no dense FFN
    dense, _, _ = _qwen3_5(layers, wide)
    kept = {k: getattr(dense, k) for k in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                                           "num_key_value_heads", "max_position_embeddings", "tie_word_embeddings",
                                           "bos_token_id", "eos_token_id", "pad_token_id", "head_dim",
                                           "linear_conv_kernel_dim", "linear_key_head_dim", "linear_value_head_dim",
                                           "linear_num_key_heads", "linear_num_value_heads", "rms_norm_eps",
                                           "layer_types", "rope_parameters")}
    cfg = Qwen3_5MoeTextConfig(**kept, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=d["moe_ffn"],
                               shared_expert_intermediate_size=2 * d["moe_ffn"])
    return cfg, Qwen3_5MoeForCausalLM, {}


BUILDERS["qwen3_5_moe"] = _qwen3_5_moe


def _qwen3_next(layers: int, wide: bool):
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM
    d = _dims(wide)
    # Qwen3-Next-80B-A3B's layout: the layer mix of _qwen3_5 with its linear attention's projections fused
    # (in_proj_qkvz, in_proj_ba, per key head), every layer routed (decoder_sparse_step 1, no mlp_only_layers:
    # llama.cpp's qwen3next has no dense layers) with a gated shared expert, top-k renormalised
    # (norm_topk_prob, which llama.cpp's graph always does), plain rope on a quarter of each head
    dense, _, _ = _qwen3_5(layers, wide)
    kept = {k: getattr(dense, k) for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                                           "num_attention_heads", "num_key_value_heads", "max_position_embeddings",
                                           "tie_word_embeddings", "bos_token_id", "eos_token_id", "pad_token_id",
                                           "head_dim", "linear_conv_kernel_dim", "linear_key_head_dim",
                                           "linear_value_head_dim", "linear_num_key_heads", "linear_num_value_heads",
                                           "rms_norm_eps", "layer_types")}
    cfg = Qwen3NextConfig(**kept, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=d["moe_ffn"],
                          shared_expert_intermediate_size=2 * d["moe_ffn"], norm_topk_prob=True,
                          decoder_sparse_step=1, mlp_only_layers=[],
                          rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25})
    return cfg, Qwen3NextForCausalLM, {}


BUILDERS["qwen3_next"] = _qwen3_next


def _qwen_mtp_block(out: Path, seed: int, count_in_config: bool = True) -> None:
    """Add the multi-token-prediction block Qwen3.5 / Qwen3-Next checkpoints ship beside the model (`mtp.*`:
    fc over [embedding, hidden], its two input norms, a final norm and one full-attention decoder layer;
    transformers ignores it on load, `_keys_to_ignore_on_load_unexpected`), and `mtp_num_hidden_layers` in
    config.json as the released configs say. llama.cpp's converter refuses a Qwen3.5 without it unless told
    --no-mtp; the values are random (no runtime here runs the block)."""
    import torch
    from safetensors.torch import load_file, save_file

    path = out / "model.safetensors"
    tensors = load_file(str(path))
    config = json.loads((out / "config.json").read_text())
    full = config["layer_types"].index("full_attention")
    gen = torch.Generator().manual_seed(seed + 1)
    hidden = config["hidden_size"]
    mtp = {"mtp.fc.weight": torch.randn(hidden, 2 * hidden, generator=gen) / (2 * hidden) ** 0.5}
    for norm in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        mtp[f"mtp.{norm}.weight"] = 0.1 * torch.randn(hidden, generator=gen)
    prefix = f"model.layers.{full}."
    for name in sorted(n for n in tensors if n.startswith(prefix)):
        t = tensors[name]
        mtp["mtp.layers.0." + name[len(prefix):]] = torch.randn(t.shape, generator=gen) * t.std()
    tensors.update(mtp)
    save_file(tensors, str(path), metadata={"format": "pt"})
    if count_in_config:  # Qwen3.5's configs say so; Qwen3-Next's do not (its converter counts the tensors)
        config["mtp_num_hidden_layers"] = 1
    (out / "config.json").write_text(json.dumps(config, indent=2))


def _glm_mtp_layer(out: Path, seed: int) -> None:
    """Add the multi-token-prediction layer GLM-4.5 / GLM-5 checkpoints ship after the trunk (transformers builds
    none, `_keys_to_ignore_on_load_unexpected`): model.layers.<num_hidden_layers> holds a decoder layer like the
    last one of the trunk with the most tensors (a routed layer; GLM-5's with the indexer), the projection eh_proj
    over [embedding, hidden], its input norms enorm / hnorm, and shared_head (norm, head) and embed_tokens as
    DeepSeek-V3's MTP layer has them; config.json declares one (num_nextn_predict_layers). Values random with the
    trunk's scales (no runtime here runs the block: llama.cpp loads it only for its MTP draft context)."""
    import torch
    from safetensors.torch import load_file, save_file

    path = out / "model.safetensors"
    tensors = load_file(str(path))
    config = json.loads((out / "config.json").read_text())
    n, hidden, vocab = config["num_hidden_layers"], config["hidden_size"], config["vocab_size"]
    counts = [sum(1 for k in tensors if k.startswith(f"model.layers.{i}.")) for i in range(n)]
    template = max(range(n), key=lambda i: (counts[i], i))
    gen = torch.Generator().manual_seed(seed + 2)
    prefix, mtp = f"model.layers.{template}.", {}
    for name in sorted(k for k in tensors if k.startswith(prefix)):
        t = tensors[name]
        mtp[f"model.layers.{n}." + name[len(prefix):]] = torch.randn(t.shape, generator=gen) * t.std() + (
            t.mean() if name.endswith("norm.weight") else 0.0)
    mtp[f"model.layers.{n}.eh_proj.weight"] = torch.randn(hidden, 2 * hidden, generator=gen) / (2 * hidden) ** 0.5
    for norm in ("enorm", "hnorm", "shared_head.norm"):
        mtp[f"model.layers.{n}.{norm}.weight"] = 1.0 + 0.1 * torch.randn(hidden, generator=gen)
    mtp[f"model.layers.{n}.embed_tokens.weight"] = torch.randn(vocab, hidden, generator=gen)
    mtp[f"model.layers.{n}.shared_head.head.weight"] = torch.randn(vocab, hidden, generator=gen) / hidden ** 0.5
    tensors.update(mtp)
    save_file(tensors, str(path), metadata={"format": "pt"})
    config["num_nextn_predict_layers"] = 1
    (out / "config.json").write_text(json.dumps(config, indent=2))


# what a kind's checkpoint carries beyond transformers' own save (called with the folder and the seed)
AFTER_SAVE: Dict[str, Callable[[Path, int], None]] = {
    "qwen3_5": _qwen_mtp_block, "qwen3_5_moe": _qwen_mtp_block,
    "qwen3_next": lambda out, seed: _qwen_mtp_block(out, seed, count_in_config=False),
    "glm4_moe": _glm_mtp_layer, "glm_moe_dsa": _glm_mtp_layer}


# --------------------------------------------------------------------------------------------------
# Weights
# --------------------------------------------------------------------------------------------------
def _is_norm(name: str) -> bool:
    return name.endswith("norm.weight") or name.endswith("layernorm.weight")


# gpt-oss's fused experts are stored [experts, in, out] (transformers' GptOssExperts: x @ gate_up_proj[e])
_IN_OUT_EXPERTS = (".experts.gate_up_proj", ".experts.down_proj")


def _draw(name: str, shape: tuple, gen, gemma: bool, tie: bool, kind: str = ""):
    """The value of one parameter or buffer (float32)."""
    import torch

    if kind == "gpt_oss":
        if name.endswith(".sinks"):
            return torch.randn(shape, generator=gen)
        if name.endswith("_bias"):  # the experts' gate_up_proj_bias / down_proj_bias
            return 0.1 * torch.randn(shape, generator=gen)
        if name.endswith(_IN_OUT_EXPERTS):
            gain = 4.0 if name.endswith("gate_up_proj") else 1.0
            return gain * torch.randn(shape, generator=gen) / shape[-2] ** 0.5

    if kind.startswith("gemma4") and len(shape) == 1 and name.endswith(_GEMMA4_SCALES):
        # Gemma 4's router input scale, per-expert output scale and per-layer output scalar: ~1, each
        # value distinct so that a misplaced one shows
        return 1.0 + 0.4 * (torch.rand(shape, generator=gen) - 0.5)
    if kind.startswith("gemma4") and len(shape) == 1 and name.endswith(("layernorm_1.weight", "layernorm_2.weight")):
        return 1.0 + 0.2 * (torch.rand(shape, generator=gen) - 0.5)  # the MoE branch's own norms
    if name.startswith(("vision_model.", "multi_modal_projector.")):  # a multimodal tower (Llama 4's): not run here
        return 0.02 * torch.randn(shape, generator=gen)
    if kind.startswith("gemma4_vl") and name.startswith(("model.vision_tower.", "model.embed_vision.",
                                                         "model.audio_tower.", "model.embed_audio.")):
        # Gemma 4's towers: not run here either
        return 0.02 * torch.randn(shape, generator=gen)
    if name.endswith("indexer.k_norm.bias"):  # a LayerNorm's bias (GLM-5's indexer)
        return 0.1 * torch.randn(shape, generator=gen)
    if kind in HYBRID_KINDS:
        # Gated DeltaNet: A = -exp(A_log) decays each value head's state (HF draws A_log = log U(1, 16)),
        # dt_bias the softplus step's bias; every RMSNorm but the gated one of the linear attention
        # multiplies by (1 + w), as Gemma's
        if name.endswith(".A_log"):
            return torch.log(1 + 15 * torch.rand(shape, generator=gen))
        if name.endswith(".dt_bias"):
            return 0.5 * torch.randn(shape, generator=gen)
        if len(shape) == 1 and _is_norm(name) and not name.endswith("linear_attn.norm.weight"):
            return 0.1 * torch.randn(shape, generator=gen)
    if len(shape) == 1 and _is_norm(name):
        if gemma:  # Gemma's RMSNorm multiplies by (1 + w)
            return 0.1 * torch.randn(shape, generator=gen)
        return 1.0 + 0.2 * (torch.rand(shape, generator=gen) - 0.5)
    if name.endswith("e_score_correction_bias"):
        return 0.5 * torch.randn(shape, generator=gen)
    if name.endswith(".bias"):
        return 0.1 * torch.randn(shape, generator=gen)
    if "embed_tokens" in name:
        # tied: the embedding is also the output matrix, so it is scaled like a linear (logits O(1..10))
        std = shape[-1] ** -0.5 if tie else 1.0
        return std * torch.randn(shape, generator=gen)
    if len(shape) >= 2:  # [out, in] or fused experts [E, out, in]
        return torch.randn(shape, generator=gen) / shape[-1] ** 0.5
    raise RuntimeError(f"no initialiser for {name} {shape}")


def _initialise(model, seed: int, gemma: bool, tie: bool, kind: str = "") -> None:
    import torch

    gen = torch.Generator().manual_seed(seed)
    named = dict(model.named_parameters())
    # persistent buffers that are weights (DeepSeek's router correction bias); rotary tables are not
    named.update({n: b for n, b in model.named_buffers() if n.endswith("e_score_correction_bias")})
    if kind.startswith("gemma4"):  # Gemma 4's per-layer output scalar is a saved buffer, not a parameter
        named.update({n: b for n, b in model.named_buffers() if n.endswith(".layer_scalar")})
    with torch.no_grad():
        for name in sorted(named):
            t = named[name]
            t.copy_(_draw(name, tuple(t.shape), gen, gemma, tie, kind).to(t.dtype))


def build_arch_model(out_dir, kind: str, seed: int = 0, layers: int = 2, wide: bool = False) -> Path:
    """A tiny random ``kind`` model (see KINDS) with the fixtures tokenizer, float32 safetensors, in
    ``out_dir`` (created; existing files are overwritten). Returns ``out_dir``."""
    import torch

    if kind not in BUILDERS:
        raise KeyError(f"unknown kind {kind!r}; known: {', '.join(KINDS)}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    cfg, cls, tok_extra = BUILDERS[kind](layers, wide)
    cfg.dtype = torch.float32
    torch.manual_seed(seed)
    model = cls(cfg).to(torch.float32).eval()
    _initialise(model, seed, gemma=kind in GEMMA_KINDS, tie=bool(cfg.tie_word_embeddings), kind=kind)
    if model.generation_config is not None:
        model.generation_config.bos_token_id = 1
        model.generation_config.eos_token_id = 0
    model.save_pretrained(str(out), safe_serialization=True)
    if kind in AFTER_SAVE:
        AFTER_SAVE[kind](out, seed)
    if kind in GLM_KINDS:
        _add_glm_tokens(out)
    else:
        _fixtures().build_tokenizer(out)
    if kind in TOKENIZER_EXTRAS:
        TOKENIZER_EXTRAS[kind](out)
    if tok_extra:
        path = out / "tokenizer_config.json"
        tok_cfg = json.loads(path.read_text())
        tok_cfg.update(tok_extra)
        path.write_text(json.dumps(tok_cfg, indent=2) + "\n")
    return out


# FP4 (E2M1) values by code: bit 3 the sign, as gpt-oss's checkpoints and ggml's MXFP4 index them
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def _mxfp4_pack(w):
    """[E, rows, cols] float -> (blocks uint8 [E, rows, cols / 32, 16], scales uint8 [E, rows, cols / 32]) in
    gpt-oss's checkpoint layout: per block of 32 along a row one E8M0 exponent (bias 127) with the block's
    largest magnitude at most 6 times 2^(e - 127), each value the nearest FP4 code, element 2i in the low
    nibble of byte i and 2i + 1 in the high one (transformers' integrations/mxfp4.py decodes it so)."""
    import torch

    e, rows, cols = w.shape
    x = w.reshape(e, rows, cols // 32, 32).float()
    amax = x.abs().amax(-1).clamp_min(2.0 ** -120)
    exp = torch.ceil(torch.log2(amax / 6.0)).clamp(-127, 127)
    scaled = x / torch.exp2(exp)[..., None]
    values = torch.tensor(FP4_VALUES[:8])
    mag = (scaled.abs()[..., None] - values).abs().argmin(-1)
    codes = (mag | ((scaled < 0) & (mag > 0)).to(torch.int64) << 3).to(torch.uint8)
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return blocks.contiguous(), (exp + 127).to(torch.uint8)


def gpt_oss_mxfp4_checkpoint(src, out) -> Path:
    """The gpt_oss fixture at `src` saved in gpt-oss's MXFP4 checkpoint form (`quantization_config`
    quant_method mxfp4): every expert weight as `<name>_blocks` / `<name>_scales` in [experts, out, in]
    order (gate_up_proj's rows gate/up interleaved as its columns were), biases and the rest as they were."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    src, out = Path(src), Path(out)
    shutil.copytree(src, out)
    tensors = load_file(str(src / "model.safetensors"))
    saved = {}
    for name, t in tensors.items():
        if name.endswith((".experts.gate_up_proj", ".experts.down_proj")):
            blocks, scales = _mxfp4_pack(t.transpose(1, 2))  # [E, in, out] -> [E, out, in]
            saved[name + "_blocks"], saved[name + "_scales"] = blocks, scales
        else:
            saved[name] = t
    save_file(saved, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((out / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4",
                                     "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                                                "model.embed_tokens", "lm_head"]}
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out


def transformers_logits(model_dir, ids: List[int]):
    """float32 logits [T, vocab] of the saved model, eager attention (the reference implementation of
    softcapping and sliding windows)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32, attn_implementation="eager")
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float().numpy()


# --------------------------------------------------------------------------------------------------
# The arch-std kinds (issue 26): Ministral 3, SmolLM3, ... Kept apart from KINDS, which
# test_gguf_archs.py runs; their own tests are tests/formats/gguf/test_gguf_archs_arch_std.py.
# --------------------------------------------------------------------------------------------------
STD_KINDS = ("mistral3", "smollm3", "olmo3", "olmo2", "exaone4", "llama4", "glm4_moe", "minimax_m2",
             "ernie4_5_moe")


def _mistral3(layers: int, wide: bool):
    from transformers import Ministral3Config, Ministral3ForCausalLM
    d = _dims(wide)
    # Ministral 3's YaRN (factor 16 over 16384 there; 32 over 8 here, the 256 context) with Llama-4's attention temperature
    # (llama_4_scaling_beta): queries at position p are scaled by 1 + beta * log(1 + floor(p / original)),
    # which llama.cpp's mistral3 graph does with n_attn_temp_floor_scale = the original context. The
    # original context of 8 is below the 16-token prompt, so the temperature bites on its second half.
    # mscale = mscale_all_dim = 1 as released (llama.cpp reads mscale_all_dim as yarn_log_mul).
    rope = {"rope_type": "yarn", "rope_theta": 1e6, "factor": 32.0, "original_max_position_embeddings": 8,
            "max_position_embeddings": 256, "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0,
            "mscale_all_dim": 1.0, "llama_4_scaling_beta": 0.1}
    cfg = Ministral3Config(**_common(layers, d["hidden"], d["ffn"], tie=False), head_dim=d["head_dim"],
                           rms_norm_eps=1e-5, rope_parameters=rope)
    return cfg, Ministral3ForCausalLM, {}


def _smollm3(layers: int, wide: bool):
    from transformers import SmolLM3Config, SmolLM3ForCausalLM
    d = _dims(wide)
    # SmolLM3: every 4th layer has no rope (no_rope_layers [1, 1, 1, 0], transformers' default interval 4),
    # which llama.cpp's smollm3 hard-codes (n_no_rope_layer_step = 4): 4 layers, so that one is NoPE. Tied
    # embeddings as SmolLM3-3B.
    n = max(layers, 4)
    cfg = SmolLM3Config(**_common(n, d["hidden"], d["ffn"], tie=True), rms_norm_eps=1e-6,
                        rope_parameters={"rope_type": "default", "rope_theta": 5e6})
    return cfg, SmolLM3ForCausalLM, {}


def _olmo3(layers: int, wide: bool):
    from transformers import Olmo3Config, Olmo3ForCausalLM
    d = _dims(wide)
    # Olmo 3: post-norms only (post_attention / post_feedforward), q/k RMSNorm over the whole projection, and
    # layer_types left to Olmo 3's default (3 sliding, then 1 full): 4 layers so that one is full. A window
    # of 8 < the 16-token prompt. llama.cpp's converter writes the pattern (olmo2.attention.sliding_window_pattern).
    n = max(layers, 4)
    cfg = Olmo3Config(**_common(n, d["hidden"], d["ffn"], tie=False), rms_norm_eps=1e-6, sliding_window=8,
                      rope_parameters={"rope_type": "default", "rope_theta": 5e5})
    return cfg, Olmo3ForCausalLM, {}


def _olmo2(layers: int, wide: bool):
    from transformers import Olmo2Config, Olmo2ForCausalLM
    d = _dims(wide)
    # OLMo 2: OLMo 3's blocks without sliding windows (the same llama.cpp architecture, olmo2)
    cfg = Olmo2Config(**_common(layers, d["hidden"], d["ffn"], tie=False), rms_norm_eps=1e-6,
                      rope_parameters={"rope_type": "default", "rope_theta": 5e5})
    return cfg, Olmo2ForCausalLM, {}


def _exaone4(layers: int, wide: bool):
    from transformers import Exaone4Config, Exaone4ForCausalLM
    d = _dims(wide)
    # EXAONE 4: post-norms only, per-head q/k RMSNorm. llama.cpp's exaone4 has sliding layers only for the 64-layer
    # (32B) model, every other size attends fully with rope in every layer: the 1.2B's config (sliding_window
    # null, every layer full_attention) is what this tiny model has.
    n = layers
    cfg = Exaone4Config(**_common(n, d["hidden"], d["ffn"], tie=False), head_dim=d["head_dim"], rms_norm_eps=1e-5,
                        sliding_window=None, layer_types=["full_attention"] * n,
                        rope_parameters={"rope_type": "default", "rope_theta": 1e6})
    return cfg, Exaone4ForCausalLM, {}


def _llama4(layers: int, wide: bool):
    from transformers import Llama4ForCausalLM, Llama4TextConfig
    d = _dims(wide)
    # Llama 4's text model: 4 layers so that layer 3 is NoPE (no_rope_layer_interval 4, as llama.cpp's
    # n_no_rope_layer_step); interleave_moe_layer_step 2 (as Maverick) so that layers 0 and 2 are dense
    # (intermediate_size_mlp) and 1 and 3 routed (4 experts of intermediate_size, top-1, plus the shared expert);
    # the L2 q/k norm of the rope layers (use_qk_norm). The attention chunk (8192), the temperature tuning
    # (floor_scale 8192, attn_scale 0.1) are the released values, which llama.cpp hard-codes; the 16-token
    # prompt is inside one chunk and below the floor, as any prompt shorter than 8192 is.
    n = max(layers, 4)
    cfg = Llama4TextConfig(**_common(n, d["hidden"], d["moe_ffn"], tie=False), intermediate_size_mlp=d["ffn"],
                           head_dim=d["head_dim"], num_local_experts=4, num_experts_per_tok=1,
                           interleave_moe_layer_step=2, use_qk_norm=True, attention_chunk_size=8192,
                           attn_temperature_tuning=True, floor_scale=8192, attn_scale=0.1, rms_norm_eps=1e-5,
                           rope_parameters={"rope_type": "default", "rope_theta": 5e5})
    return cfg, Llama4ForCausalLM, {}


def _glm4_moe(layers: int, wide: bool):
    from transformers import Glm4MoeConfig, Glm4MoeForCausalLM
    d = _dims(wide)
    # GLM-4.5 in miniature: layer 0 dense (first_k_dense_replace 1), layers 1-2 routed (4 experts, top-2, sigmoid
    # with the correction bias, one group) plus one shared expert; q/k/v biases, per-head q/k RMSNorm (GLM-4.5's
    # use_qk_norm), half the head rotated (partial_rotary_factor 0.5, NEOX), routed_scaling_factor 2.5 (GLM-4.5's),
    # one MTP module declared (num_nextn_predict_layers 1).
    n = max(layers, 3)
    cfg = Glm4MoeConfig(**_common(n, d["hidden"], d["ffn"], tie=False), head_dim=d["head_dim"],
                        moe_intermediate_size=d["moe_ffn"], n_routed_experts=4, num_experts_per_tok=2,
                        n_shared_experts=1, n_group=1, topk_group=1, first_k_dense_replace=1,
                        routed_scaling_factor=2.5, norm_topk_prob=True, use_qk_norm=True, attention_bias=True,
                        num_mtp_layers=1, rms_norm_eps=1e-5,
                        rope_parameters={"rope_type": "default", "rope_theta": 1e6, "partial_rotary_factor": 0.5})
    cfg.vocab_size = _fixtures().VOCAB_SIZE + 3  # glm_tokenizer's three special tokens
    return cfg, Glm4MoeForCausalLM, {}


def glm_tokenizer(out) -> None:
    """The fixture tokenizer with the special tokens GLM's converter looks up by name (`[gMASK]` its bos,
    `<|user|>` eot, `<|observation|>` eom; `<|endoftext|>` is the fixture's eos already), added after the 512
    trained ones (ids 512-514: GLM configs declare vocab_size 515 here)."""
    from tokenizers import AddedToken, Tokenizer

    path = Path(out) / "tokenizer.json"
    tok = Tokenizer.from_file(str(path))
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t in ("[gMASK]", "<|user|>", "<|observation|>")])
    tok.save(str(path))


def _llama4_vl(layers: int, wide: bool):
    from transformers import Llama4Config, Llama4ForConditionalGeneration
    # the released Llama 4 checkpoints' class: _llama4's text model (language_model.*) beside a one-layer vision
    # tower and its projector (vision_model.*, multi_modal_projector.*), which llama.cpp's converter leaves out of
    # the text GGUF; the tower's values are small random ones (nothing here runs it)
    text, _, _ = _llama4(layers, wide)
    vision = dict(hidden_size=64, num_hidden_layers=1, num_attention_heads=2, intermediate_size=128, image_size=56,
                  patch_size=14, vision_output_dim=text.hidden_size, projector_input_dim=text.hidden_size,
                  projector_output_dim=text.hidden_size, pixel_shuffle_ratio=0.5)
    cfg = Llama4Config(text_config=text.to_dict(), vision_config=vision, tie_word_embeddings=False)
    return cfg, Llama4ForConditionalGeneration, {}


BUILDERS.update({"mistral3": _mistral3, "smollm3": _smollm3, "olmo3": _olmo3, "olmo2": _olmo2, "exaone4": _exaone4,
                 "llama4": _llama4, "glm4_moe": _glm4_moe, "llama4_vl": _llama4_vl})


def _llama4_scout(layers: int, wide: bool):
    # _llama4 with every layer routed (interleave_moe_layer_step 1, as Llama-4-Scout-17B-16E is released; _llama4
    # interleaves dense layers as Maverick): the base of gptqmodel's GPTQ (scripts/producers/gptqmodel_archs.py),
    # whose Llama 4 module tree has experts in every layer and stops at a dense one
    cfg, cls, extra = _llama4(layers, wide)
    cfg.interleave_moe_layer_step = 1
    cfg.moe_layers = list(range(cfg.num_hidden_layers))
    return cfg, cls, extra


BUILDERS["llama4_scout"] = _llama4_scout
TOKENIZER_EXTRAS["glm4_moe"] = glm_tokenizer


def _minimax_m2(layers: int, wide: bool):
    from transformers import MiniMaxM2Config, MiniMaxM2ForCausalLM
    d = _dims(wide)
    # MiniMax-M2 in miniature: every layer routed (4 experts of intermediate_size, top-2, sigmoid scores with the
    # correction bias, renormalised), q/k RMSNorm over the whole projection, half of each head rotated. Its
    # config.json carries rotary_dim and scoring_func "sigmoid" (llama.cpp's converter reads both; transformers
    # derives partial_rotary_factor from rotary_dim and always routes by sigmoid).
    cfg = MiniMaxM2Config(**_common(layers, d["hidden"], d["moe_ffn"], tie=False), head_dim=d["head_dim"],
                          num_local_experts=4, num_experts_per_tok=2, rms_norm_eps=1e-6,
                          rope_parameters={"rope_type": "default", "rope_theta": 5e6,
                                           "partial_rotary_factor": 0.5})
    cfg.rotary_dim = d["head_dim"] // 2
    cfg.scoring_func = "sigmoid"
    return cfg, MiniMaxM2ForCausalLM, {}


BUILDERS["minimax_m2"] = _minimax_m2


def _ernie4_5_moe(layers: int, wide: bool):
    from transformers import Ernie4_5_MoeConfig, Ernie4_5_MoeForCausalLM
    d = _dims(wide)
    # ERNIE-4.5-21B-A3B in miniature: layer 0 dense (moe_layer_start_index 1), then routed layers (4 experts, top-2,
    # softmax with the correction bias moe_statics.e_score_correction_bias) beside 2 shared experts. llama.cpp's
    # converter writes the shared experts' width as intermediate_size // num_key_value_heads, which is
    # moe_intermediate_size * moe_num_shared_experts in the released 21B (12288 // 4 = 1536 * 2) and here
    # (ffn // 2 = moe_ffn * 2). A SentencePiece tokenizer.model, as ERNIE ships (ernie_tokenizer).
    n = max(layers, 3)
    cfg = Ernie4_5_MoeConfig(**_common(n, d["hidden"], d["ffn"], tie=False), moe_intermediate_size=d["moe_ffn"],
                             moe_k=2, moe_num_experts=4, moe_num_shared_experts=2, moe_layer_start_index=1,
                             moe_layer_end_index=n - 1, moe_layer_interval=1, use_bias=False, rms_norm_eps=1e-5,
                             rope_parameters={"rope_type": "default", "rope_theta": 5e5})
    cfg.eos_token_id = 2  # SentencePiece's </s>
    return cfg, Ernie4_5_MoeForCausalLM, {}


def sentencepiece_tokenizer(out) -> None:
    """A SentencePiece BPE tokenizer.model (vocab 512: <unk> 0, <s> 1, </s> 2, byte fallback) trained on the
    fixture corpus, in place of the byte-level tokenizer.json (ERNIE's converter reads tokenizer.model only)."""
    import io

    import sentencepiece as spm

    out = Path(out)
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(sentence_iterator=iter(_fixtures()._corpus()), model_writer=model,
                                   vocab_size=_fixtures().VOCAB_SIZE, model_type="bpe", byte_fallback=True,
                                   character_coverage=1.0, minloglevel=2)
    (out / "tokenizer.model").write_bytes(model.getvalue())
    (out / "tokenizer.json").unlink(missing_ok=True)
    (out / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "LlamaTokenizer", "bos_token": "<s>",
                                                           "eos_token": "</s>", "unk_token": "<unk>"}, indent=2))
    (out / "special_tokens_map.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>",
                                                             "unk_token": "<unk>"}, indent=2))


BUILDERS["ernie4_5_moe"] = _ernie4_5_moe
TOKENIZER_EXTRAS["ernie4_5_moe"] = sentencepiece_tokenizer


# --------------------------------------------------------------------------------------------------
# Gemma 4 (text), in its two layouts. Both: Gemma4ForCausalLM, plain RMSNorms (w, not 1 + w), q/k norms
# and a scale-free v norm, attention scale 1, sliding layers with head_dim 32 and full ones with their own
# global_head_dim 64 and "proportional" rope (partial_rotary_factor 0.25: llama.cpp's rope_freqs tensor),
# a per-layer output scalar, the final logits soft-capped (10: it bites on these logits).
# - gemma4_moe (26B-A4B style): every layer has the dense MLP and, beside it, 4 routed experts (top 2) with
#   a router input scale and per-expert output scales; full layers reuse their keys as values
#   (attention_k_eq_v: no v_proj) with their own KV head count (num_global_key_value_heads 1); no PLE.
# - gemma4_ple (E2B/E4B style): per-layer embeddings (hidden_size_per_layer_input 16), the last two layers
#   read the KV of the last earlier layer of their kind (num_kv_shared_layers 2: no k/v projections) and
#   have a double-wide MLP.
# Six layers, sliding x3, full, sliding, full: the two shared layers (4 sliding, 5 full) read layers 2 and 3,
# the last stored layer of their kind, which is what llama.cpp's runtime hard-codes (the last stored layer
# must be a full one and the one before it a sliding one; E2B's 4 sliding + 1 full pattern is so).
# --------------------------------------------------------------------------------------------------
GEMMA4_KINDS = ("gemma4_moe", "gemma4_ple")
_GEMMA4_SCALES = (".router.scale", ".router.per_expert_scale", ".layer_scalar")
GEMMA4_LAYER_TYPES = ["sliding_attention"] * 3 + ["full_attention", "sliding_attention", "full_attention"]


def _gemma4_common(layers: int, wide: bool) -> dict:
    d = _dims(wide)
    layer_types = (GEMMA4_LAYER_TYPES * layers)[:layers]
    layer_types[-1] = "full_attention"  # transformers forces the last layer to be a full one
    common = _common(layers, d["hidden"], d["ffn"], tie=True)
    common.update(head_dim=d["head_dim"], global_head_dim=2 * d["head_dim"], sliding_window=8,
                  layer_types=layer_types, final_logit_softcapping=10.0, rms_norm_eps=1e-6,
                  hidden_activation="gelu_pytorch_tanh", vocab_size_per_layer_input=_fixtures().VOCAB_SIZE,
                  rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                   "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                                                      "rope_theta": 1e6}})
    return common


def _gemma4_moe(layers: int, wide: bool):
    from transformers import Gemma4ForCausalLM, Gemma4TextConfig
    d = _dims(wide)
    cfg = Gemma4TextConfig(**_gemma4_common(layers, wide), hidden_size_per_layer_input=0, num_kv_shared_layers=0,
                           enable_moe_block=True, num_experts=4, top_k_experts=2, moe_intermediate_size=d["moe_ffn"],
                           attention_k_eq_v=True, num_global_key_value_heads=1)
    return cfg, Gemma4ForCausalLM, {}


def _gemma4_ple(layers: int, wide: bool):
    from transformers import Gemma4ForCausalLM, Gemma4TextConfig
    cfg = Gemma4TextConfig(**_gemma4_common(layers, wide), hidden_size_per_layer_input=16, num_kv_shared_layers=2,
                           use_double_wide_mlp=True)
    return cfg, Gemma4ForCausalLM, {}


BUILDERS["gemma4_moe"] = _gemma4_moe
BUILDERS["gemma4_ple"] = _gemma4_ple


# Gemma 4's tokenizer (issue 26): its named special tokens, in Gemma's id order, and chat markers
GEMMA4_SPECIAL = ("<pad>", "<eos>", "<bos>", "<unk>", "<mask>")
GEMMA4_EXTRA_SPECIAL = ("<|turn>", "<turn|>", "<|channel>", "<channel|>", "<|\"|>")


def gemma4_tokenizer(out: Path, vocab_size: int | None = None) -> Path:
    """A tokenizer of Gemma 4's kind, offline: transformers' GemmaTokenizer (BPE with byte fallback, spaces
    normalised to U+2581, no prefix space, <bos> added) over a vocabulary laid out as Gemma's (pad, eos, bos,
    unk, mask first, chat tokens as extra special tokens, the 256 <0xXX> byte tokens, then BPE merges trained
    here on the fixtures' corpus), written with save_pretrained over the byte-level one in ``out``."""
    from tokenizers import Tokenizer, models, normalizers, trainers
    from transformers import GemmaTokenizer

    fx = _fixtures()
    vocab_size = vocab_size or fx.VOCAB_SIZE
    fixed = list(GEMMA4_SPECIAL) + list(GEMMA4_EXTRA_SPECIAL) + [f"<0x{b:02X}>" for b in range(256)]
    trained = Tokenizer(models.BPE())
    trained.normalizer = normalizers.Replace(" ", "\u2581")
    trained.train_from_iterator(fx._corpus(), trainer=trainers.BpeTrainer(
        vocab_size=vocab_size, min_frequency=1, show_progress=False))
    model = json.loads(trained.to_str())["model"]
    learned = [t for t, _ in sorted(model["vocab"].items(), key=lambda kv: kv[1])]
    room = vocab_size - len(fixed)
    vocab = {t: i for i, t in enumerate(fixed + learned[:room])}
    assert len(vocab) == vocab_size, len(vocab)
    merges = [m for m in model["merges"] if "".join(m if isinstance(m, list) else m.split(" ")) in vocab]
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        (Path(out) / name).unlink(missing_ok=True)
    pairs = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in merges]
    tok = GemmaTokenizer(vocab=vocab, merges=pairs, extra_special_tokens=list(GEMMA4_EXTRA_SPECIAL), add_bos_token=True)
    tok.save_pretrained(str(out))
    return Path(out)


# --------------------------------------------------------------------------------------------------
# DeepSeek-V4 (issue 26, tests/formats/gguf/test_gguf_archs_deepseek4.py): the checkpoint as the release
# lays it out, which is the only form llama.cpp's converter reads (conversion/deepseek.py DeepseekV4Model:
# `embed.weight`, `layers.N.attn.wq_a.weight`, `layers.N.ffn.experts.E.w1.weight` int8-packed MXFP4 with
# its `.scale` E8M0 exponents, `hc_head_fn`, `head.weight`), and its config.json in the release's own keys
# (compress_ratios, num_hash_layers, qk_rope_head_dim: transformers folds them into layer_types /
# mlp_layer_types / partial_rotary_factor, llama.cpp's converter reads them as they are).
# --------------------------------------------------------------------------------------------------
DEEPSEEK_V4_KIND = "deepseek_v4"


def deepseek_v4_config(layers: int = 4, wide: bool = False) -> dict:
    """DeepSeek-V4-Flash's config.json in miniature: 4 heads of 64 over one shared KV head (half of each head
    rotated), a q LoRA of 64, the grouped output projection (2 groups, rank 32), one sliding-window layer then
    compressed ones (ratio 4 with the indexer: CSA; ratio 128: HCA, as released), window 8 and top-k 4 below
    the 16-token prompt, hyper-connections of 4 streams (llama.cpp asserts 4), the first layer hash-routed (tid2eid), the rest
    routed by sqrt(softplus) with the correction bias, 4 experts of 64 (2 used) and one shared expert; the
    indexer's 64 heads of 64 (llama.cpp rotates its keys by a Hadamard matrix of at least 64). `wide`: every
    linear's in-features a multiple of 256 (K-quant super-blocks): hidden 256, heads of 128, ranks 256."""
    ratios = ([0, 4, 128, 4] * layers)[:layers]
    sizes = dict(hidden_size=256, moe_intermediate_size=256, head_dim=128, q_lora_rank=256, o_lora_rank=128) \
        if wide else {}
    return {**_dsv4_base(layers, ratios), **sizes}


def _dsv4_base(layers: int, ratios: list) -> dict:
    return {"architectures": ["DeepseekV4ForCausalLM"], "model_type": "deepseek_v4",
            "vocab_size": _fixtures().VOCAB_SIZE, "hidden_size": 128, "moe_intermediate_size": 64,
            "num_hidden_layers": layers, "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 64,
            "qk_rope_head_dim": 32, "q_lora_rank": 64, "o_groups": 2, "o_lora_rank": 32,
            "n_routed_experts": 4, "n_shared_experts": 1, "num_experts_per_tok": 2, "scoring_func": "sqrtsoftplus",
            "norm_topk_prob": True, "routed_scaling_factor": 1.5, "num_hash_layers": 1,
            "compress_ratios": ratios, "compress_rope_theta": 160000.0, "rope_theta": 10000.0,
            "hc_mult": 4, "hc_sinkhorn_iters": 3, "hc_eps": 1e-6, "index_n_heads": 64, "index_head_dim": 64,
            "index_topk": 4, "sliding_window": 8, "swiglu_limit": 10.0, "num_nextn_predict_layers": 0,
            "max_position_embeddings": 256, "rms_norm_eps": 1e-6, "hidden_act": "silu",
            "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 0}


# transformers' names (modeling_deepseek_v4) -> the release's, the inverse of its conversion_mapping renames
_DSV4_ROOT = {"model.embed_tokens.weight": "embed.weight", "lm_head.weight": "head.weight",
              "model.norm.weight": "norm.weight", "model.hc_head.hc_fn": "hc_head_fn",
              "model.hc_head.hc_base": "hc_head_base", "model.hc_head.hc_scale": "hc_head_scale"}
_DSV4_LAYER = (("self_attn.compressor.indexer.scorer.weights_proj.", "attn.indexer.weights_proj."),
               ("self_attn.compressor.indexer.q_b_proj.", "attn.indexer.wq_b."),
               ("self_attn.compressor.indexer.", "attn.indexer.compressor."), ("self_attn.", "attn."),
               ("mlp.", "ffn."), ("input_layernorm.", "attn_norm."), ("post_attention_layernorm.", "ffn_norm."),
               ("attn_hc.fn", "hc_attn_fn"), ("attn_hc.base", "hc_attn_base"), ("attn_hc.scale", "hc_attn_scale"),
               ("ffn_hc.fn", "hc_ffn_fn"), ("ffn_hc.base", "hc_ffn_base"), ("ffn_hc.scale", "hc_ffn_scale"),
               (".sinks", ".attn_sink"), ("compressor.kv_norm.", "compressor.norm."), ("position_bias", "ape"), ("q_a_proj.", "wq_a."),
               ("q_b_proj.", "wq_b."), ("kv_proj.", "wkv."), ("gate_proj.", "wgate."), ("o_a_proj.", "wo_a."),
               ("o_b_proj.", "wo_b."), ("q_a_norm.", "q_norm."), ("e_score_correction_bias", "bias"),
               ("shared_experts.wgate.", "shared_experts.w1."), ("shared_experts.down_proj.", "shared_experts.w2."),
               ("shared_experts.up_proj.", "shared_experts.w3."))


def _dsv4_release_name(name: str) -> str:
    if name in _DSV4_ROOT:
        return _DSV4_ROOT[name]
    name = name.removeprefix("model.")
    for old, new in _DSV4_LAYER:
        name = name.replace(old, new)
    return name


def _mxfp4_release(w):
    """[rows, cols] float -> (int8 [rows, cols / 2] two E2M1 codes a byte, E8M0 [rows, cols / 32]): the
    release's expert layout (the even element in the low nibble, as gpt-oss's), and the values it decodes to."""
    import torch

    blocks, exps = _mxfp4_pack(w[None])
    packed = blocks[0].reshape(w.shape[0], w.shape[1] // 2)
    codes = torch.stack((packed & 15, packed >> 4), -1).reshape(w.shape).long()
    values = torch.tensor(FP4_VALUES)[codes] * torch.exp2(exps[0].float() - 127).repeat_interleave(32, 1)
    return packed.view(torch.int8), exps[0].view(torch.float8_e8m0fnu), values


def build_deepseek_v4(out_dir, seed: int = 0, layers: int = 4, wide: bool = False) -> Path:
    """The tiny DeepSeek-V4 checkpoint in the release's layout (see deepseek_v4_config): transformers'
    DeepseekV4ForCausalLM built and seeded as the other kinds, its weights renamed to the release's names,
    the routed experts packed to MXFP4 (w1 = gate, w2 = down, w3 = up), the hash table tid2eid as int32,
    everything else float32; the fixtures tokenizer."""
    import torch
    from safetensors.torch import save_file
    from transformers import DeepseekV4Config, DeepseekV4ForCausalLM

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    config = deepseek_v4_config(layers, wide)
    torch.manual_seed(seed)
    model = DeepseekV4ForCausalLM(DeepseekV4Config(**config)).to(torch.float32).eval()
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    state = model.state_dict()
    for name in sorted(state):
        if "rotary_emb" in name:
            continue
        t = state[name]
        if name.endswith(".tid2eid"):  # which experts each token id goes to: distinct draws per row
            n_exp = config["n_routed_experts"]
            t = torch.stack([torch.randperm(n_exp, generator=gen)[: t.shape[1]] for _ in range(t.shape[0])])
            tensors[_dsv4_release_name(name)] = t.to(torch.int32).contiguous()
            continue
        if name.endswith((".hc_fn", ".fn")) or name.endswith((".hc_base", ".base", ".hc_scale", ".scale")):
            value = 0.5 * torch.randn(t.shape, generator=gen) if not name.endswith("fn") else \
                torch.randn(t.shape, generator=gen) / t.shape[-1] ** 0.5
        elif name.endswith(".sinks"):
            value = torch.randn(t.shape, generator=gen)
        elif name.endswith("position_bias"):
            value = 0.1 * torch.randn(t.shape, generator=gen)
        else:
            value = _draw(name, tuple(t.shape), gen, gemma=False, tie=False)
        if name.endswith((".experts.gate_up_proj", ".experts.down_proj")):  # [E, out, in]
            layer = _dsv4_release_name(name).rsplit(".experts.", 1)[0] + ".experts"
            halves = (("w2", value),) if name.endswith("down_proj") else \
                (("w1", value[:, : value.shape[1] // 2]), ("w3", value[:, value.shape[1] // 2:]))
            for w, part in halves:
                for e in range(part.shape[0]):
                    packed, exps, _ = _mxfp4_release(part[e].contiguous())
                    tensors[f"{layer}.{e}.{w}.weight"], tensors[f"{layer}.{e}.{w}.scale"] = packed, exps
            continue
        tensors[_dsv4_release_name(name)] = value.to(torch.float32).contiguous()
    # the release keeps a router bias in its hash-routed layers too (unused there: llama.cpp's converter drops it,
    # transformers' hash router has none)
    for i in range(config["num_hash_layers"]):
        tensors[f"layers.{i}.ffn.gate.bias"] = 0.5 * torch.randn(config["n_routed_experts"], generator=gen)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    (out / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 0}) + "\n")
    _fixtures().build_tokenizer(out)
    return out


def deepseek_v4_dequantized(src, out) -> Path:
    """The DeepSeek-V4 release-layout checkpoint at `src` with each FP4 expert weight decoded to float32 (the
    E2M1 value of each code times 2**(e - 127), the `.scale` gone): the same model in a form transformers loads
    without a quantization config (its conversion mapping merges the experts' w1 / w3 / w2)."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    src, out = Path(src), Path(out)
    shutil.copytree(src, out)
    tensors = load_file(str(src / "model.safetensors"))
    saved = {}
    for name, t in tensors.items():
        scale = name[: -len(".weight")] + ".scale"
        if name.endswith(".scale") and name[: -len(".scale")] + ".weight" in tensors:
            continue
        if scale in tensors and t.dtype == torch.int8:
            packed = t.view(torch.uint8)
            codes = torch.stack((packed & 15, packed >> 4), -1).reshape(t.shape[0], -1).long()
            exps = tensors[scale].view(torch.uint8).float() - 127
            saved[name] = torch.tensor(FP4_VALUES)[codes] * torch.exp2(exps).repeat_interleave(32, 1)
        else:
            saved[name] = t
    save_file(saved, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def deepseek_v4_bf16(src, out) -> Path:
    """The DeepSeek-V4 release-layout checkpoint at `src` with every float32 tensor stored as bfloat16 (as the
    release stores its norms, embeddings and hyper-connection tables), the MXFP4 experts and tid2eid as they are."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    src, out = Path(src), Path(out)
    shutil.copytree(src, out)
    tensors = load_file(str(src / "model.safetensors"))
    save_file({n: t.to(torch.bfloat16) if t.dtype == torch.float32 else t for n, t in tensors.items()},
              str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


# the linears DeepSeek-V4's release stores in FP8 here (attention, compressors, the indexer's queries, shared
# experts); the router, the embedding, the head, norms and hyper-connection tables stay as they are
_DSV4_FP8 = re.compile(r"\.(?:attn\.(?:wq_a|wq_b|wkv|wo_a|wo_b|compressor\.wkv|compressor\.wgate|indexer\.wq_b"
                       r"|indexer\.compressor\.wkv|indexer\.compressor\.wgate)|ffn\.shared_experts\.w[123])\.weight$")


def deepseek_v4_fp8(src, out) -> Path:
    """The DeepSeek-V4 release-layout checkpoint at `src` in the full release's form: its attention, compressor,
    indexer-query and shared-expert linears as F8_E4M3 with one E8M0 exponent per 128x128 block (the smallest
    power of two that brings the block's largest magnitude within 448; the edge blocks partial) in `<module>.scale`,
    and the release's quantization_config (quant_method fp8, weight_block_size [128, 128], scale_fmt ue8m0)."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    src, out = Path(src), Path(out)
    shutil.copytree(src, out)
    tensors = load_file(str(src / "model.safetensors"))
    saved = {}
    for name, t in tensors.items():
        if not _DSV4_FP8.search(name):
            saved[name] = t
            continue
        w = t.float()
        rows, cols = -(-w.shape[0] // 128), -(-w.shape[1] // 128)
        padded = torch.zeros(rows * 128, cols * 128)
        padded[: w.shape[0], : w.shape[1]] = w
        amax = padded.reshape(rows, 128, cols, 128).abs().amax(dim=(1, 3)).clamp_min(2.0 ** -100)
        exp = torch.ceil(torch.log2(amax / 448.0)).clamp(-127, 127)
        scale = torch.exp2(exp).repeat_interleave(128, 0).repeat_interleave(128, 1)[: w.shape[0], : w.shape[1]]
        saved[name] = (w / scale).to(torch.float8_e4m3fn)
        saved[name[: -len(".weight")] + ".scale"] = (exp + 127).to(torch.uint8).view(torch.float8_e8m0fnu)
    save_file(saved, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((out / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "scale_fmt": "ue8m0",
                                     "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out


# --------------------------------------------------------------------------------------------------
# Kimi-K3 (KimiK3ForConditionalGeneration): no transformers class (remote code only), so the checkpoint is
# written tensor by tensor as the model's repository lays it out, learnt from llama.cpp's converter
# (conversion/kimi_k3.py) and its runtime (src/models/kimi-k3.cpp): the text model under `language_model.`
# beside a vision tower and projector (the converter skips both), bf16 weights, KDA (linear) layers and MLA
# layers by linear_attn_config.full_attn_layers (1-indexed), a dense lead layer, then latent MoE layers (router
# with a score-correction bias, shared experts at the model width, routed experts in a down-projected space
# between routed_expert_down_proj / routed_expert_up_proj) whose routed experts ship as compressed-tensors
# mxfp4-pack-quantized (uint8 `weight_packed` [rows, cols/2] low nibble first, uint8 E8M0 `weight_scale`
# [rows, cols/32]); the cross-layer attention residuals as <x>_res_norm / <x>_res_proj vector pairs.
# --------------------------------------------------------------------------------------------------
KIMI_K3_LAYERS = 4  # layer 4 (1-indexed) full MLA attention, 1-3 KDA: the released 3:1 mix; layer 0 dense


def kimi_k3_config(layers: int = KIMI_K3_LAYERS, hidden: int = 256, experts: int = 4, expert_ff: int = 128,
                   latent: int = 128) -> dict:
    """config.json of the tiny Kimi-K3: the text model's keys in `text_config` (the converter moves them to the
    root; mlx-lm's kimi_k3 reads them there), named as mlx-lm 0.32's kimi_k3 TextArgs names them; `experts`,
    `expert_ff` and `latent` widen the routed experts (the streaming check)."""
    heads, kda_head = 4, 64
    text = {
        "model_type": "kimi_linear",
        "vocab_size": _fixtures().VOCAB_SIZE, "hidden_size": hidden, "intermediate_size": 256,
        "num_hidden_layers": layers, "num_attention_heads": heads, "num_key_value_heads": heads,
        "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": False,
        "bos_token_id": 1, "eos_token_id": 0, "pad_token_id": 0, "torch_dtype": "bfloat16",
        "hidden_act": "situ", "activation_situ_beta": 2.0, "activation_situ_linear_beta": 3.0,
        # MLA, nope-only (mla_use_nope): no rope, qk_rope_head_dim only sizes the un-absorbed key part
        "q_lora_rank": None, "kv_lora_rank": 64, "qk_nope_head_dim": 64, "qk_rope_head_dim": 32,
        "v_head_dim": 64, "mla_use_nope": True, "mla_use_output_gate": True,
        "linear_attn_config": {"head_dim": kda_head, "num_heads": heads, "short_conv_kernel_size": 4,
                               "full_attn_layers": [layers], "kda_layers": list(range(1, layers)),
                               "gate_lower_bound": -5.0, "use_full_rank_gate": True},
        "num_experts": experts, "num_experts_per_token": 2, "moe_intermediate_size": expert_ff,
        "num_shared_experts": 1, "routed_expert_hidden_size": latent, "latent_moe_use_norm": True,
        "first_k_dense_replace": 1, "moe_layer_freq": 1, "routed_scaling_factor": 2.5, "moe_renormalize": True,
        "moe_router_activation_func": "sigmoid", "use_grouped_topk": True, "num_expert_group": 1, "topk_group": 1,
        "attn_res_block_size": 2,
    }
    return {
        "architectures": ["KimiK3ForConditionalGeneration"], "model_type": "kimi_k3",
        "text_config": text,
        "vision_config": {"hidden_size": 64, "patch_size": 4},  # only its tensors' presence matters here
        "quantization_config": {
            "quant_method": "compressed-tensors", "format": "mxfp4-pack-quantized",
            "quantization_status": "compressed",
            "config_groups": {"group_0": {
                "format": "mxfp4-pack-quantized",
                "targets": [r"re:.*block_sparse_moe\.experts\.\d+\.w[123]$"],
                "weights": {"num_bits": 4, "type": "float", "strategy": "group", "group_size": 32,
                            "symmetric": True, "dynamic": False, "scale_dtype": "torch.uint8",
                            "actorder": None, "block_structure": None, "zp_dtype": None},
                "input_activations": None, "output_activations": None}},
            "ignore": ["lm_head", r"re:.*self_attn.*", r"re:.*shared_experts.*", r"re:.*mlp\..*",
                       r"re:.*block_sparse_moe\.gate$", r"re:.*routed_expert_.*", r"re:vision_tower.*",
                       r"re:mm_projector.*"]},
    }


def kimi_k3_tensors(cfg: dict, seed: int = 0, drawn_experts: bool = True) -> dict:
    """The checkpoint's tensors for `cfg` (kimi_k3_config), seeded: linears N(0, 1/fan_in), norms 1 +- 0.1,
    residual-attention vectors N(0, 1), A_log log U(1, 16), the router's correction bias N(0, 0.5); routed
    experts drawn in float and stored as the nearest MXFP4 (_mxfp4_pack), or (`drawn_experts` False, for wide
    experts) random codes and exponents 2^-9 .. 2^-1."""
    import math

    import torch

    g = torch.Generator().manual_seed(seed)
    cfg = {**cfg, **cfg["text_config"]}  # the text model's keys

    def lin(rows, cols):
        return (torch.randn(rows, cols, generator=g) / math.sqrt(cols)).to(torch.bfloat16)

    def norm(n):
        return (1 + 0.1 * torch.randn(n, generator=g)).to(torch.bfloat16)

    def vec(n, std=1.0):
        return (std * torch.randn(n, generator=g)).to(torch.bfloat16)

    H, V, L = cfg["hidden_size"], cfg["vocab_size"], cfg["num_hidden_layers"]
    la = cfg["linear_attn_config"]
    nh, hd, conv = cfg["num_attention_heads"], la["head_dim"], la["short_conv_kernel_size"]
    d_inner = nh * hd
    nope, rope, vdim, kv_lora = cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"], cfg["v_head_dim"], cfg["kv_lora_rank"]
    E, ff_exp, latent = cfg["num_experts"], cfg["moe_intermediate_size"], cfg["routed_expert_hidden_size"]
    ff_sh = ff_exp * cfg["num_shared_experts"]
    t = {}
    lm = "language_model."
    t[lm + "model.embed_tokens.weight"] = torch.randn(V, H, generator=g).to(torch.bfloat16)
    t[lm + "model.norm.weight"] = norm(H)
    t[lm + "lm_head.weight"] = lin(V, H)
    t[lm + "model.output_attn_res_norm.weight"] = norm(H)
    t[lm + "model.output_attn_res_proj.weight"] = vec(H).reshape(1, H)  # a Linear(hidden, 1)
    for i in range(L):
        p = f"{lm}model.layers.{i}."
        t[p + "input_layernorm.weight"] = norm(H)
        t[p + "post_attention_layernorm.weight"] = norm(H)
        t[p + "self_attention_res_norm.weight"] = norm(H)
        t[p + "self_attention_res_proj.weight"] = vec(H).reshape(1, H)
        t[p + "mlp_res_norm.weight"] = norm(H)
        t[p + "mlp_res_proj.weight"] = vec(H).reshape(1, H)
        a = p + "self_attn."
        if (i + 1) in la["full_attn_layers"]:  # MLA
            t[a + "q_proj.weight"] = lin(nh * (nope + rope), H)
            t[a + "kv_a_proj_with_mqa.weight"] = lin(kv_lora + rope, H)
            t[a + "kv_a_layernorm.weight"] = norm(kv_lora)
            t[a + "kv_b_proj.weight"] = lin(nh * (nope + vdim), kv_lora)
            t[a + "g_proj.weight"] = lin(nh * vdim, H)  # the output gate
            t[a + "o_proj.weight"] = lin(H, nh * vdim)
        else:  # KDA
            for x in "qkv":
                t[a + f"{x}_proj.weight"] = lin(d_inner, H)
                t[a + f"{x}_conv1d.weight"] = (torch.randn(d_inner, 1, conv, generator=g) / 2).to(torch.bfloat16)
            t[a + "f_a_proj.weight"] = lin(hd, H)
            t[a + "f_b_proj.weight"] = lin(d_inner, hd)
            t[a + "b_proj.weight"] = lin(nh, H)
            t[a + "A_log"] = torch.log(1 + 15 * torch.rand(nh, generator=g)).to(torch.bfloat16)
            t[a + "dt_bias"] = vec(d_inner, 0.1)
            t[a + "g_proj.weight"] = lin(d_inner, H)  # the full-rank gate
            t[a + "o_norm.weight"] = norm(hd)
            t[a + "o_proj.weight"] = lin(H, d_inner)
        if i < cfg["first_k_dense_replace"]:
            t[p + "mlp.gate_proj.weight"] = lin(cfg["intermediate_size"], H)
            t[p + "mlp.up_proj.weight"] = lin(cfg["intermediate_size"], H)
            t[p + "mlp.down_proj.weight"] = lin(H, cfg["intermediate_size"])
            continue
        m = p + "block_sparse_moe."
        t[m + "gate.weight"] = lin(E, H)
        t[m + "gate.e_score_correction_bias"] = vec(E, 0.5).float()
        t[m + "routed_expert_down_proj.weight"] = lin(latent, H)
        t[m + "routed_expert_up_proj.weight"] = lin(H, latent)
        t[m + "routed_expert_norm.weight"] = norm(latent)
        t[m + "shared_experts.gate_proj.weight"] = lin(ff_sh, H)
        t[m + "shared_experts.up_proj.weight"] = lin(ff_sh, H)
        t[m + "shared_experts.down_proj.weight"] = lin(H, ff_sh)
        for w, (rows, cols) in (("w1", (ff_exp, latent)), ("w2", (latent, ff_exp)), ("w3", (ff_exp, latent))):
            if drawn_experts:
                blocks, scales = _mxfp4_pack(torch.randn(E, rows, cols, generator=g) / math.sqrt(cols))
            for e in range(E):
                if drawn_experts:
                    packed, scale = blocks[e].reshape(rows, cols // 2).contiguous(), scales[e].contiguous()
                else:
                    packed = torch.randint(0, 256, (rows, cols // 2), generator=g, dtype=torch.uint8)
                    scale = torch.randint(118, 127, (rows, cols // 32), generator=g, dtype=torch.uint8)
                t[f"{m}experts.{e}.{w}.weight_packed"], t[f"{m}experts.{e}.{w}.weight_scale"] = packed, scale
    # the vision tower and projector the text conversion leaves out
    t["vision_tower.patch_embed.proj.weight"] = lin(64, 48)
    t["mm_projector.proj.0.weight"] = lin(H, 64)
    return t


def build_kimi_k3(out_dir, seed: int = 0, layers: int = KIMI_K3_LAYERS, **wide) -> Path:
    """The tiny Kimi-K3 checkpoint (kimi_k3_config, kimi_k3_tensors) with the fixtures tokenizer, in `out_dir`;
    `wide` (experts, expert_ff, latent) widens the routed experts, stored as random codes."""
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    cfg = kimi_k3_config(layers, **wide)
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    save_file(kimi_k3_tensors(cfg, seed, drawn_experts=not wide), str(out / "model.safetensors"),
              metadata={"format": "pt"})
    _fixtures().build_tokenizer(out)
    # K3 ships no jinja template (its chats are rendered in python) and the converter then reads one from
    # llama.cpp's models/templates, which the extracted sources lack: the fixture names a template of its own
    path = out / "tokenizer_config.json"
    tok_cfg = json.loads(path.read_text())
    tok_cfg["chat_template"] = ("{% for m in messages %}<|im_{{ m['role'] }}|>{{ m['content'] }}<|im_end|>"
                                "{% endfor %}")
    path.write_text(json.dumps(tok_cfg, indent=2) + "\n")
    return out


# last: every builder above has registered by now
if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(description="Build a tiny random model of one architecture.")
    ap.add_argument("kind", choices=sorted(BUILDERS))
    ap.add_argument("out_dir")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--wide", action="store_true")
    a = ap.parse_args()
    print(build_arch_model(a.out_dir, a.kind, a.seed, a.layers, a.wide))


def _gemma4_vl(layers: int, wide: bool):
    from transformers import Gemma4Config, Gemma4ForConditionalGeneration
    # the released Gemma 4 checkpoints' class: _gemma4_moe's text model (model.language_model.*) beside a one-layer
    # vision tower and its projector (model.vision_tower.*, model.embed_vision.*), which llama.cpp's converter
    # leaves out of the text GGUF (to its --mmproj run), and a one-layer audio tower (model.audio_tower.*,
    # model.embed_audio.*: E2B / E4B carry one) left out the same way; the towers' values are random (not run here)
    text, _, _ = _gemma4_moe(layers, wide)
    text.pad_token_id = 0  # the multimodal forward pads image/audio placeholders with it (released: 0)
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                  num_key_value_heads=2, head_dim=16, patch_size=4, position_embedding_size=64)
    audio = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, output_proj_dims=32,
                 subsampling_conv_channels=[8, 4])
    cfg = Gemma4Config(text_config=text.to_dict(), vision_config=vision, audio_config=audio, tie_word_embeddings=True)
    return cfg, Gemma4ForConditionalGeneration, {}


BUILDERS["gemma4_vl"] = _gemma4_vl


def _gemma4_vl_ple(layers: int, wide: bool):
    from transformers import Gemma4Config, Gemma4ForConditionalGeneration
    # Gemma4ForConditionalGeneration as E2B / E4B are released: _gemma4_ple's text model (per-layer embeddings,
    # KV-shared layers with the double-wide MLP) beside _gemma4_vl's vision and audio towers, with a tokenizer
    # of Gemma 4's own kind (TOKENIZER_EXTRAS: gemma4_tokenizer)
    text, _, _ = _gemma4_ple(layers, wide)
    text.pad_token_id = 0
    vl, _, _ = _gemma4_vl(layers, wide)
    cfg = Gemma4Config(text_config=text.to_dict(), vision_config=vl.vision_config.to_dict(),
                       audio_config=vl.audio_config.to_dict(), tie_word_embeddings=True)
    return cfg, Gemma4ForConditionalGeneration, {}


BUILDERS["gemma4_vl_ple"] = _gemma4_vl_ple
TOKENIZER_EXTRAS["gemma4_vl_ple"] = gemma4_tokenizer
