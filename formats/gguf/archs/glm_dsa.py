"""GLM-5 (GlmMoeDsaForCausalLM) as llama.cpp's `glm-dsa`: DeepSeek-V3's multi-head latent attention and
router (archs/deepseek2.py: kv_b_proj split into k_b / v_b, sigmoid routing with the correction bias, shared
experts, dense lead layers) plus the DeepSeek Sparse Attention indexer, whose tensors sit only in the layers
that run it ("full"; a "shared" layer reuses the previous one's top-k and has none)."""

from __future__ import annotations

from typing import Mapping

import gguf

from ....converters.errors import BadInput
from ..hparams import MAX_WIDTH, rope_parameters
from .base import SHARED_EXPERT, GgufArch, register_arch
from .deepseek2 import DEEPSEEK_BLOCK, _deepseek2_config, _deepseek2_extra
from .glm import GLM_MTP  # GLM-5 keeps its MTP block as GLM-4.5 does (GlmMoeDsaModel)

GLM_DSA_BLOCK = DEEPSEEK_BLOCK + ("self_attn.indexer.wq_b", "self_attn.indexer.wk", "self_attn.indexer.k_norm",
                                  "self_attn.indexer.weights_proj")

# gguf 0.19 names the indexer's head count, key length and top-k but not its per-layer kind (the key
# llama.cpp's glm-dsa loader reads, as the vendored gguf-py spells it: LLM_KV_ATTENTION_INDEXER_TYPES)
INDEXER_TYPES_KEY = "{arch}.attention.indexer.types"
# llama.cpp's DSA kernels (ggml_lightning_indexer) take the indexer heads in groups of 64, as every released
# GLM-5 and DeepSeek-V3.2 has them
INDEXER_HEAD_MULTIPLE = 64


# llama.cpp's converter (_set_vocab_glm) takes these by their text, in this order
GLM_SPECIAL_TOKENS = (("bos", "[gMASK]"), ("eot", "<|user|>"), ("unk", "<|endoftext|>"), ("eom", "<|observation|>"))


def _indexer_types(config: Mapping) -> list[bool] | None:
    """config.json's indexer_types as llama.cpp stores them (True: the layer runs its own indexer)."""
    types = config.get("indexer_types")
    if types is None:
        return None
    n = int(config["num_hidden_layers"])
    if not isinstance(types, list) or len(types) != n or any(t not in ("full", "shared") for t in types):
        raise BadInput(f"config.json indexer_types must name full or shared for each of the {n} layers")
    return [t == "full" for t in types]


def _glm_dsa_extra(writer: gguf.GGUFWriter, config: Mapping) -> None:
    """DeepSeek-V3's MLA and router keys (GLM-5's config names them as DeepSeek's does), then the indexer's."""
    _deepseek2_extra(writer, config)
    heads = int(config["index_n_heads"])
    if heads % INDEXER_HEAD_MULTIPLE:
        raise BadInput(f"config.json index_n_heads {heads} is not a multiple of {INDEXER_HEAD_MULTIPLE}, "
                       "which llama.cpp's DSA indexer needs")
    if float(rope_parameters(config).get("partial_rotary_factor", 1.0)) != 1.0:
        # llama.cpp's converter writes rope.dimension_count = qk_rope_head_dim * partial_rotary_factor over the
        # one _deepseek2_extra wrote; no GLM-5 release sets it, so no test has run it
        raise BadInput("config.json partial_rotary_factor other than 1 is not supported for glm-dsa")
    writer.add_indexer_head_count(heads)
    writer.add_indexer_key_length(int(config["index_head_dim"]))
    writer.add_indexer_top_k(int(config["index_topk"]))
    types = _indexer_types(config)
    if types is not None:
        writer.add_array(INDEXER_TYPES_KEY.format(arch=writer.arch), types)


def _glm_dsa_config(cfg: dict, get, names, cv) -> None:
    """GLM-5's config: DeepSeek-V3's MLA and router fields, the indexer's, and each layer's indexer kind
    (the file's indexer.types; without it every layer runs its own indexer, as llama.cpp assumes)."""
    _deepseek2_config(cfg, get, names, cv)
    # GlmMoeDsaConfig has no rope_interleave / topk_method / scoring_func: its router is always sigmoid with
    # the correction bias, which is what llama.cpp's glm-dsa runs
    for key in ("rope_interleave", "topk_method", "scoring_func"):
        cfg.pop(key, None)
    # (the DeepSeek hook reads deepseek2.expert_weights_norm by its full name)
    cfg["norm_topk_prob"] = bool(cv.bool("glm-dsa.expert_weights_norm", default=False))
    n = cfg["num_hidden_layers"]
    cfg.update(index_n_heads=get("attention.indexer.head_count", required=True, lo=1, hi=MAX_WIDTH),
               index_head_dim=get("attention.indexer.key_length", required=True, lo=1, hi=MAX_WIDTH),
               index_topk=get("attention.indexer.top_k", required=True, lo=1, hi=1 << 24))
    key = INDEXER_TYPES_KEY.format(arch="glm-dsa")
    flags = cv.get(key)
    if flags is not None:
        if not isinstance(flags, list) or len(flags) != n or not all(isinstance(f, bool) for f in flags):
            raise BadInput(f"metadata {key} is not {n} booleans (one per layer)", path=cv.path)
        cfg["indexer_types"] = ["full" if f else "shared" for f in flags]
    else:
        cfg["indexer_types"] = ["full"] * n


register_arch(GgufArch("glm-dsa", ("GlmMoeDsaForCausalLM",), ("glm_moe_dsa",), "GlmMoeDsaForCausalLM",
                       "glm_moe_dsa", moe=True, mla=True, extra_metadata=_glm_dsa_extra, mtp=GLM_MTP,
                       attention=("attn_kv_a_mqa", "attn_kv_a_norm", "attn_k_b", "attn_v_b", "attn_output"),
                       # llama.cpp's glm-dsa loader: the query's low-rank pair in every layer (GLM-5 always has
                       # q_lora_rank), the shared expert in every routed one (the router bias and the indexer's
                       # tensors are TENSOR_NOT_REQUIRED there)
                       block_extra=("attn_q_a_norm", "attn_q_a", "attn_q_b"), routed_extra=SHARED_EXPERT,
                       hf_block=GLM_DSA_BLOCK, config_from_gguf=_glm_dsa_config,
                       named_special_tokens=GLM_SPECIAL_TOKENS))
