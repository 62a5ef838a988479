"""DeepSeek-V4 (DeepseekV4ForCausalLM) as llama.cpp's `deepseek4`, from the checkpoint as released: the names
of DeepSeek's own inference code (`embed.weight`, `layers.N.attn.wq_a.weight`, `layers.N.ffn.experts.E.w1.weight`,
`hc_head_fn`, `head.weight`), which is the only layout llama.cpp's converter reads (conversion/deepseek.py,
DeepseekV4Model) and which transformers 5.24 loads through its conversion mapping.

The hf reader renames those names to transformers' (DeepseekV4ForCausalLM's parameters), which the table below
maps. The model: attention over one shared KV head with a q LoRA and a grouped low-rank output (wo_a / wo_b), a sink
per head, a sliding window in every layer and, by each layer's compress ratio, a compressor of the KV (ratio 4:
with the lightning indexer, CSA; ratio 128: HCA; 0: the window alone); manifold-constrained hyper-connections
(hc_mult residual streams mixed per layer and at the head); MoE in every layer (the first num_hash_layers route
each token by a fixed table, tid2eid, the rest by sqrt(softplus) scores with a correction bias) with shared
experts; the routed experts released as MXFP4 (int8 bytes of two E2M1 codes, an E8M0 exponent per 32), which the
converter writes as MXFP4 whatever --outtype says, as it keeps every float32 tensor F32 and every 2-D bfloat16 one
BF16 (`float_type_keeps_source_types`); the multi-token-prediction block
(`mtp.*`) left out, as the converter does by default.

The installed gguf 0.19 does not name the architecture, its tensors (hyper-connections, compressor, indexer,
tid2eid) or several of its keys: the tables below mirror the constants of the gguf-py vendored in llama.cpp's
sources (gguf-py/gguf/constants.py: MODEL_ARCH.DEEPSEEK4, TENSOR_NAMES, MODEL_TENSORS[DEEPSEEK4], Keys), which
the package never imports at run time; tests/formats/gguf/test_gguf_archs_deepseek4.py checks them against it.
"""

from __future__ import annotations

import re
from typing import Mapping

import gguf
import numpy as np

from ....converters.errors import BadInput
from ..hparams import require
from .base import GgufArch, expert_keys, register_arch
from .mtp import skipped

# transformers' name (block 0 stands for every block; the hf reader renames the release's names so,
# formats/hf/deepseek_v4.py) -> (gguf-py's MODEL_TENSOR member, the GGUF name), as llama.cpp's vendored gguf-py
# spells them (TENSOR_NAMES) and its converter maps the release's names to them
# (DeepseekV4Model._map_dsv4_tensor_name; a bare parameter gets `.weight`, the router bias `.bias`)
DEEPSEEK4_TENSORS: dict[str, tuple[str, str]] = {
    "model.embed_tokens.weight": ("TOKEN_EMBD", "token_embd.weight"),
    "model.norm.weight": ("OUTPUT_NORM", "output_norm.weight"),
    "lm_head.weight": ("OUTPUT", "output.weight"),
    "model.hc_head.hc_fn": ("HC_HEAD_FN", "output_hc_fn.weight"),
    "model.hc_head.hc_base": ("HC_HEAD_BASE", "output_hc_base.weight"),
    "model.hc_head.hc_scale": ("HC_HEAD_SCALE", "output_hc_scale.weight"),
    "model.layers.0.input_layernorm.weight": ("ATTN_NORM", "blk.0.attn_norm.weight"),
    "model.layers.0.self_attn.sinks": ("ATTN_SINKS", "blk.0.attn_sinks.weight"),
    "model.layers.0.self_attn.q_a_proj.weight": ("ATTN_Q_A", "blk.0.attn_q_a.weight"),
    "model.layers.0.self_attn.q_b_proj.weight": ("ATTN_Q_B", "blk.0.attn_q_b.weight"),
    "model.layers.0.self_attn.q_a_norm.weight": ("ATTN_Q_A_NORM", "blk.0.attn_q_a_norm.weight"),
    "model.layers.0.self_attn.kv_proj.weight": ("ATTN_KV", "blk.0.attn_kv.weight"),
    "model.layers.0.self_attn.kv_norm.weight": ("ATTN_KV_NORM", "blk.0.attn_kv_a_norm.weight"),
    "model.layers.0.self_attn.o_a_proj.weight": ("ATTN_OUT_A", "blk.0.attn_output_a.weight"),
    "model.layers.0.self_attn.o_b_proj.weight": ("ATTN_OUT_B", "blk.0.attn_output_b.weight"),
    "model.layers.0.attn_hc.fn": ("HC_ATTN_FN", "blk.0.hc_attn_fn.weight"),
    "model.layers.0.attn_hc.base": ("HC_ATTN_BASE", "blk.0.hc_attn_base.weight"),
    "model.layers.0.attn_hc.scale": ("HC_ATTN_SCALE", "blk.0.hc_attn_scale.weight"),
    "model.layers.0.ffn_hc.fn": ("HC_FFN_FN", "blk.0.hc_ffn_fn.weight"),
    "model.layers.0.ffn_hc.base": ("HC_FFN_BASE", "blk.0.hc_ffn_base.weight"),
    "model.layers.0.ffn_hc.scale": ("HC_FFN_SCALE", "blk.0.hc_ffn_scale.weight"),
    "model.layers.0.self_attn.compressor.kv_proj.weight": ("ATTN_COMPRESSOR_WKV", "blk.0.attn_compressor_kv.weight"),
    "model.layers.0.self_attn.compressor.gate_proj.weight": ("ATTN_COMPRESSOR_WGATE", "blk.0.attn_compressor_gate.weight"),
    "model.layers.0.self_attn.compressor.position_bias": ("ATTN_COMPRESSOR_APE", "blk.0.attn_compressor_ape.weight"),
    "model.layers.0.self_attn.compressor.kv_norm.weight": ("ATTN_COMPRESSOR_NORM", "blk.0.attn_compressor_norm.weight"),
    "model.layers.0.self_attn.compressor.indexer.scorer.weights_proj.weight": ("INDEXER_PROJ", "blk.0.indexer.proj.weight"),
    "model.layers.0.self_attn.compressor.indexer.q_b_proj.weight": ("INDEXER_ATTN_Q_B", "blk.0.indexer.attn_q_b.weight"),
    "model.layers.0.self_attn.compressor.indexer.kv_proj.weight": ("INDEXER_COMPRESSOR_WKV", "blk.0.indexer_compressor_kv.weight"),
    "model.layers.0.self_attn.compressor.indexer.gate_proj.weight": ("INDEXER_COMPRESSOR_WGATE",
                                                      "blk.0.indexer_compressor_gate.weight"),
    "model.layers.0.self_attn.compressor.indexer.position_bias": ("INDEXER_COMPRESSOR_APE", "blk.0.indexer_compressor_ape.weight"),
    "model.layers.0.self_attn.compressor.indexer.kv_norm.weight": ("INDEXER_COMPRESSOR_NORM",
                                                     "blk.0.indexer_compressor_norm.weight"),
    "model.layers.0.post_attention_layernorm.weight": ("FFN_NORM", "blk.0.ffn_norm.weight"),
    "model.layers.0.mlp.gate.weight": ("FFN_GATE_INP", "blk.0.ffn_gate_inp.weight"),
    "model.layers.0.mlp.gate.e_score_correction_bias": ("FFN_EXP_PROBS_B", "blk.0.exp_probs_b.bias"),
    "model.layers.0.mlp.gate.tid2eid": ("FFN_GATE_TID2EID", "blk.0.ffn_gate_tid2eid.weight"),
    "model.layers.0.mlp.shared_experts.gate_proj.weight": ("FFN_GATE_SHEXP", "blk.0.ffn_gate_shexp.weight"),
    "model.layers.0.mlp.shared_experts.down_proj.weight": ("FFN_DOWN_SHEXP", "blk.0.ffn_down_shexp.weight"),
    "model.layers.0.mlp.shared_experts.up_proj.weight": ("FFN_UP_SHEXP", "blk.0.ffn_up_shexp.weight"),
    # one expert's gate / down / up (the release's w1 / w2 / w3) goes into the layer's stack
    "model.layers.0.mlp.experts.gate_proj.weight": ("FFN_GATE_EXP", "blk.0.ffn_gate_exps.weight"),
    "model.layers.0.mlp.experts.down_proj.weight": ("FFN_DOWN_EXP", "blk.0.ffn_down_exps.weight"),
    "model.layers.0.mlp.experts.up_proj.weight": ("FFN_UP_EXP", "blk.0.ffn_up_exps.weight"),
}

# the keys gguf 0.19 lacks, as the vendored gguf-py's Keys spell them (its GGUFWriter writes the counts as
# uint32, the bases and epsilon as float32, compress_ratios as an array of ints)
DEEPSEEK4_KEYS = {
    "Attention.OUTPUT_GROUP_COUNT": "{arch}.attention.output_group_count",
    "Attention.OUTPUT_LORA_RANK": "{arch}.attention.output_lora_rank",
    "Attention.COMPRESS_RATIOS": "{arch}.attention.compress_ratios",
    "Attention.COMPRESS_ROPE_FREQ_BASE": "{arch}.attention.compress_rope_freq_base",
    "HyperConnection.COUNT": "{arch}.hyper_connection.count",
    "HyperConnection.SINKHORN_ITERATIONS": "{arch}.hyper_connection.sinkhorn_iterations",
    "HyperConnection.EPSILON": "{arch}.hyper_connection.epsilon",
    "LLM.HASH_LAYER_COUNT": "{arch}.hash_layer_count",
}

# llama.cpp's deepseek4 loader accepts these compress ratios only (0: sliding window alone; 4: CSA with the
# indexer; 128: HCA) and runs exactly 4 hyper-connection streams (models/deepseek4.cpp GGML_ASSERT(hc == 4))
COMPRESS_RATIOS = (0, 4, 128)
HC_STREAMS = 4
# transformers' layer types for each ratio (configuration_deepseek_v4._COMPRESS_RATIO_TO_LAYER_TYPE)
_LAYER_TYPE_RATIO = {"sliding_attention": 0, "compressed_sparse_attention": 4, "heavily_compressed_attention": 128}

# the router's scoring, as the vendored gguf-py's ExpertGatingFuncType numbers it (gguf 0.19 has SOFTMAX and
# SIGMOID only): llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE_SQRT_SOFTPLUS, the one its deepseek4 loader accepts
DEEPSEEK4_GATING = {"SQRTSOFTPLUS": 4}


def _key(name: str, arch: str) -> str:
    return DEEPSEEK4_KEYS[name].format(arch=arch)


def compress_ratios(config: Mapping) -> list[int]:
    """Each layer's compress ratio: the release's compress_ratios, else transformers' layer_types and
    compress_rates (transformers 5 saves those)."""
    n = int(require(config, "num_hidden_layers"))
    ratios = config.get("compress_ratios")
    if ratios is None and isinstance(config.get("layer_types"), list):
        rates = {**{"compressed_sparse_attention": 4, "heavily_compressed_attention": 128},
                 **(config.get("compress_rates") or {})}
        ratios = [0 if t == "sliding_attention" else rates.get(t) for t in config["layer_types"]]
    if not isinstance(ratios, list) or len(ratios) < n or any(r not in COMPRESS_RATIOS for r in ratios[:n]):
        raise BadInput(f"config.json compress_ratios must give each of the {n} layers one of "
                       f"{', '.join(map(str, COMPRESS_RATIOS))} (llama.cpp's deepseek4 runs no other)")
    return [int(r) for r in ratios]


def hash_layer_count(config: Mapping) -> int:
    """The leading hash-routed layers: the release's num_hash_layers, else transformers' mlp_layer_types."""
    if config.get("num_hash_layers") is not None:
        return int(config["num_hash_layers"])
    kinds = config.get("mlp_layer_types")
    if isinstance(kinds, list):
        return next((i for i, k in enumerate(kinds) if k != "hash_moe"), len(kinds))
    return 3  # transformers' default (DeepseekV4Config.default_num_hash_layers)


def rope_head_dim(config: Mapping) -> int:
    if config.get("qk_rope_head_dim") is not None:
        return int(config["qk_rope_head_dim"])
    return int(int(require(config, "head_dim")) * float(require(config, "partial_rotary_factor")))


def _deepseek4_extra(writer: gguf.GGUFWriter, config: Mapping) -> None:
    """The keys llama.cpp's converter writes for DeepSeek-V4 (DeepseekV4Model.set_gguf_parameters) and its
    deepseek4 loader reads."""
    arch = writer.arch
    n_layers = int(require(config, "num_hidden_layers"))
    hc = int(require(config, "hc_mult"))
    if hc != HC_STREAMS:
        raise BadInput(f"config.json hc_mult {hc}: llama.cpp's deepseek4 runs {HC_STREAMS} hyper-connection streams")
    scoring = config.get("scoring_func", "sqrtsoftplus")
    if scoring != "sqrtsoftplus":  # the loader refuses any other (load_arch_hparams)
        raise BadInput(f"config.json scoring_func {scoring!r}: llama.cpp's deepseek4 routes by sqrtsoftplus only")
    expert_keys(writer, config)
    writer.add_uint32(gguf.Keys.LLM.EXPERT_GATING_FUNC.format(arch=arch), DEEPSEEK4_GATING["SQRTSOFTPLUS"])
    writer.add_rope_dimension_count(rope_head_dim(config))
    writer.add_q_lora_rank(int(require(config, "q_lora_rank")))
    writer.add_sliding_window(int(require(config, "sliding_window")))
    writer.add_expert_feed_forward_length(int(require(config, "moe_intermediate_size")))
    writer.add_expert_shared_count(int(require(config, "n_shared_experts")))
    writer.add_expert_weights_scale(float(require(config, "routed_scaling_factor")))
    writer.add_expert_weights_norm(bool(require(config, "norm_topk_prob")))
    limit = float(require(config, "swiglu_limit"))
    writer.add_swiglu_clamp_exp([limit] * n_layers)
    writer.add_swiglu_clamp_shexp([limit] * n_layers)
    writer.add_indexer_head_count(int(require(config, "index_n_heads")))
    writer.add_indexer_key_length(int(require(config, "index_head_dim")))
    writer.add_indexer_top_k(int(require(config, "index_topk")))
    writer.add_uint32(_key("Attention.OUTPUT_GROUP_COUNT", arch), int(require(config, "o_groups")))
    writer.add_uint32(_key("Attention.OUTPUT_LORA_RANK", arch), int(require(config, "o_lora_rank")))
    writer.add_array(_key("Attention.COMPRESS_RATIOS", arch), compress_ratios(config))
    writer.add_float32(_key("Attention.COMPRESS_ROPE_FREQ_BASE", arch), float(require(config, "compress_rope_theta")))
    writer.add_uint32(_key("HyperConnection.COUNT", arch), hc)
    writer.add_uint32(_key("HyperConnection.SINKHORN_ITERATIONS", arch), int(require(config, "hc_sinkhorn_iters")))
    writer.add_float32(_key("HyperConnection.EPSILON", arch), float(require(config, "hc_eps")))
    writer.add_uint32(_key("LLM.HASH_LAYER_COUNT", arch), hash_layer_count(config))
    # the hyper-connection streams side by side: the width the head's mix reads
    writer.add_embedding_length_out(int(require(config, "hidden_size")) * hc)


_GATE_BIAS = re.compile(r"^model\.layers\.(?P<layer>0|[1-9][0-9]*)\.mlp\.gate\.e_score_correction_bias$")


def _dropped(name: str, config: Mapping) -> str | None:
    m = _GATE_BIAS.match(name)
    if m is not None and int(m["layer"]) < hash_layer_count(config):
        return ("a hash-routed layer's router bias: the layer routes by its token table (tid2eid), and llama.cpp's "
                "converter leaves the bias out")
    return None


def _deepseek4_config(cfg: dict, get, names, cv) -> None:
    """DeepSeek-V4's config.json from its keys, in the release's own form (compress_ratios, num_hash_layers,
    qk_rope_head_dim), which transformers folds into layer_types / mlp_layer_types / partial_rotary_factor."""
    arch = "deepseek4"
    n = cfg["num_hidden_layers"]
    n_expert = get("expert_count", required=True, lo=1, hi=1 << 16)
    ratios = cv.get(_key("Attention.COMPRESS_RATIOS", arch))
    if not isinstance(ratios, list) or len(ratios) < n or any(r not in COMPRESS_RATIOS for r in ratios[:n]):
        raise BadInput(f"metadata {_key('Attention.COMPRESS_RATIOS', arch)} must give each of the {n} layers one of "
                       f"{', '.join(map(str, COMPRESS_RATIOS))}", path=cv.path)
    limits = cv.get(f"{arch}.swiglu_clamp_exp")
    limit = limits[0] if isinstance(limits, list) and limits else limits
    if not isinstance(limit, (int, float)) or isinstance(limit, bool):
        raise BadInput(f"metadata {arch}.swiglu_clamp_exp is not a number or an array of numbers", path=cv.path)

    def key(name: str, kind: str = "int", **bounds):
        full = _key(name, arch)
        return cv.int(full, **bounds) if kind == "int" else cv.float(full, **bounds)

    cfg.update(moe_intermediate_size=get("expert_feed_forward_length", required=True, lo=1, hi=1 << 20),
               n_routed_experts=n_expert,
               num_experts_per_tok=get("expert_used_count", required=True, lo=1, hi=n_expert),
               n_shared_experts=get("expert_shared_count", 0, lo=0, hi=1 << 16),
               routed_scaling_factor=get("expert_weights_scale", 1.0, kind="float"),
               norm_topk_prob=bool(cv.bool(f"{arch}.expert_weights_norm", default=False)),
               scoring_func="sqrtsoftplus", q_lora_rank=get("attention.q_lora_rank", required=True, lo=1),
               sliding_window=get("attention.sliding_window", required=True, lo=1), swiglu_limit=float(limit),
               index_n_heads=get("attention.indexer.head_count", required=True, lo=1),
               index_head_dim=get("attention.indexer.key_length", required=True, lo=1),
               index_topk=get("attention.indexer.top_k", required=True, lo=1),
               o_groups=key("Attention.OUTPUT_GROUP_COUNT", lo=1), o_lora_rank=key("Attention.OUTPUT_LORA_RANK", lo=1),
               compress_ratios=[int(r) for r in ratios[:n]],
               compress_rope_theta=key("Attention.COMPRESS_ROPE_FREQ_BASE", kind="float", lo=1e-30),
               hc_mult=key("HyperConnection.COUNT", lo=1, hi=64),
               hc_sinkhorn_iters=key("HyperConnection.SINKHORN_ITERATIONS", lo=0),
               hc_eps=key("HyperConnection.EPSILON", kind="float", lo=0.0),
               num_hash_layers=key("LLM.HASH_LAYER_COUNT", lo=0, hi=n),
               qk_rope_head_dim=get("rope.dimension_count", required=True, lo=1, hi=cfg["head_dim"]),
               num_nextn_predict_layers=0)
    # GGUF holds these as float32: the shortest decimal of that float32 (1e-06, not 9.999999974752427e-07), as
    # the source's config.json wrote it, so that transformers computes with the source's own value
    for name in ("rms_norm_eps", "hc_eps", "compress_rope_theta", "routed_scaling_factor", "swiglu_limit"):
        cfg[name] = float(str(np.float32(cfg[name])))


_EXPERT = re.compile(r"^(?P<head>model\.layers\.\d+\.mlp\.experts)\.(?P<e>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.weight$")


def _fused_experts(rec, config: Mapping, path, held: dict):
    """gguf->hf: the experts' records (one per expert and projection, as the GGUF reader yields a stack) held
    until a layer's stack is complete, then one fused record as DeepseekV4ForCausalLM holds its experts:
    gate_up_proj [experts, 2 * ffn, hidden] (each expert's gate rows, then its up rows) and down_proj
    [experts, hidden, ffn]; decoded to float32 when loaded. Every other record passes as it is."""
    import torch

    from ....converters.records import Dense, TensorRecord

    m = _EXPERT.match(rec.name)
    if m is None:
        yield rec
        return
    n = int(require(config, "n_routed_experts"))
    fused = "down_proj" if m["proj"] == "down_proj" else "gate_up_proj"
    key = f"{m['head']}.{fused}"
    parts = held.setdefault(key, {})
    parts[(m["proj"], int(m["e"]))] = rec
    projs = ("down_proj",) if fused == "down_proj" else ("gate_proj", "up_proj")
    if len(parts) < n * len(projs):
        return
    del held[key]
    order = [[parts[(p, e)] for p in projs] for e in range(n)]
    rows = sum(r.shape[0] for r in order[0])

    def load() -> Dense:
        return Dense(torch.stack([torch.cat([r.load().dequantize(torch.float32) for r in expert])
                                  for expert in order]))

    yield TensorRecord(key, (n, rows, order[0][0].shape[1]), "float32", load, source_file=rec.source_file,
                       source_name=f"{len(parts)} expert records of {m['head']}")


register_arch(GgufArch("deepseek4", ("DeepseekV4ForCausalLM",), ("deepseek_v4",), "DeepseekV4ForCausalLM",
                       "deepseek_v4", moe=True, extra_metadata=_deepseek4_extra, dense_ffn_width=False,
                       attention=("attn_q_a", "attn_q_a_norm", "attn_q_b", "attn_kv", "attn_kv_a_norm",
                                  "attn_output_a", "attn_output_b", "attn_sinks"),
                       dense_ffn=(), mtp=skipped(re.compile(r"^mtp\."), "llama.cpp's converter writes DeepSeek-V4's trunk "
                                                    "only (its mtp.* block is not loaded)"),
                       name_table={hf: name for hf, (_, name) in DEEPSEEK4_TENSORS.items()},
                       float_type_keeps_source_types=True, dropped_tensor=_dropped, config_from_gguf=_deepseek4_config,
                       from_gguf_record=_fused_experts,
                       integer_tensors=re.compile(r"\.ffn_gate_tid2eid\.weight$")))
