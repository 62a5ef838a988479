"""What a checkpoint's config.json says each tensor's shape must be, checked by the safetensors readers
(gptq, qqq, hf) against the shapes their headers and packed tensors imply.

transformers builds the model from config.json and then loads the tensors into it, refusing any whose
shape differs ("size mismatch"); a converter that does not check the same thing writes a file no runtime
loads, or one that silently reads a truncated matrix. The rules below are those of the llama family
(LlamaForCausalLM, Mistral, Qwen2/3, Gemma, Granite, Mixtral and the Qwen MoE models' dense layers), in
`nn.Linear` orientation [out_features, in_features]:

    model.embed_tokens.weight, lm_head.weight       [vocab_size, hidden_size]
    model.norm.weight, model.layers.N.*_layernorm   [hidden_size]
    self_attn.q_proj                                [num_attention_heads * head_dim, hidden_size]
    self_attn.k_proj / v_proj                       [num_key_value_heads * head_dim, hidden_size]
    self_attn.o_proj                                [hidden_size, num_attention_heads * head_dim]
    mlp.gate_proj / up_proj                         [intermediate_size, hidden_size]
    mlp.down_proj                                   [hidden_size, intermediate_size]

(a bias is [out_features]; head_dim defaults to hidden_size / num_attention_heads and
num_key_value_heads to num_attention_heads, as in transformers' LlamaConfig). Only names of exactly
this form under `model.layers.N.` are checked, so a vision tower, MoE experts or fused projections of
another architecture are never measured against the text model's sizes; attention and MLP sizes are
checked only for the model types listed in `_LLAMA_LIKE` (DeepSeek's latent attention, say, has other
q_proj sizes), or when config.json names no model_type.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from .errors import BadInput
from .validate import ConfigView

__all__ = ["ModelShapes", "Layout", "known_layout", "check_dtype", "MAX_LAYERS", "MAX_DIM", "HfArchitecture",
           "register_architecture", "canonical_name"]

MAX_LAYERS = 1 << 16  # the deepest released models have ~130 layers
MAX_DIM = 1 << 24  # vocabularies reach ~260k, hidden and intermediate sizes ~50k

_LLAMA_LIKE = frozenset({"llama", "mistral", "qwen2", "qwen3", "qwen2_moe", "qwen3_moe", "mixtral", "gemma",
                         "gemma2", "gemma3_text", "granite", "olmo2", "yi", "internlm3", "llama4_text"})
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")
_LINEAR = re.compile(r"^model\.layers\.\d+\.(?P<block>self_attn|mlp)\.(?P<proj>[a-z_]+_proj)(?:\.(?P<part>weight|bias))?$")
_LAYER_NORM = re.compile(r"^model\.layers\.\d+\.[a-z_]*layernorm\.weight$")


class ModelShapes:
    """The config's sizes, validated (typed, in range) on construction, and the expected shape of a tensor."""

    def __init__(self, config: dict, path: Path):
        self.path = Path(path)
        view = ConfigView(config, self.path)

        def size(key: str, hi: int = MAX_DIM, null_is_default: bool = False):
            """A positive integer if the key is there; None if absent (or null where transformers derives it)."""
            if key not in config or (null_is_default and config[key] is None):
                return None
            return view.int(key, lo=1, hi=hi)  # present but null, a string, a list or negative: refused

        self.hidden = size("hidden_size")
        self.intermediate = size("intermediate_size")
        self.layers = size("num_hidden_layers", MAX_LAYERS)
        self.heads = size("num_attention_heads")
        self.kv_heads = size("num_key_value_heads", null_is_default=True) or self.heads
        self.vocab = size("vocab_size")
        head_dim = size("head_dim", null_is_default=True)
        if head_dim is None and self.hidden and self.heads and self.hidden % self.heads == 0:
            head_dim = self.hidden // self.heads
        self.head_dim = head_dim
        self.tie = view.bool("tie_word_embeddings", default=None)
        model_type = view.str("model_type", default=None)
        self.llama_like = model_type is None or model_type in _LLAMA_LIKE

    # -- expected shapes -----------------------------------------------------------------------------
    def _mul(self, a, b):
        return a * b if a is not None and b is not None else None

    def linear(self, prefix: str) -> tuple[tuple, tuple] | None:
        """((out, out_key), (in, in_key)) for a linear module prefix the config sizes (None entries where
        the config lacks the value), or None when the name is not one of the rules."""
        h = (self.hidden, "hidden_size")
        if prefix == "lm_head":
            return (self.vocab, "vocab_size"), h
        m = _LINEAR.match(prefix)
        if not m or m["part"] or not self.llama_like:
            return None
        q = (self._mul(self.heads, self.head_dim), "num_attention_heads * head_dim")
        kv = (self._mul(self.kv_heads, self.head_dim), "num_key_value_heads * head_dim")
        ffn = (self.intermediate, "intermediate_size")
        return {"q_proj": (q, h), "k_proj": (kv, h), "v_proj": (kv, h), "o_proj": (h, q),
                "gate_proj": (ffn, h), "up_proj": (ffn, h), "down_proj": (h, ffn)}.get(m["proj"])

    def expected(self, name: str) -> list[tuple] | None:
        """[(size, config key), ...] per dimension of a (dense) tensor, or None when no rule names it."""
        h = (self.hidden, "hidden_size")
        if name in ("model.embed_tokens.weight", "lm_head.weight"):
            return [(self.vocab, "vocab_size"), h]
        if name == "model.norm.weight" or _LAYER_NORM.match(name):
            return [h]
        m = _LINEAR.match(name)
        if m and m["part"]:
            dims = self.linear(name.rpartition(".")[0])
            if dims is not None:
                return list(dims) if m["part"] == "weight" else [dims[0]]
        return None

    # -- checks --------------------------------------------------------------------------------------
    def check_dense(self, name: str, shape: tuple, where: Path, dtype: str | None = None,
                    stored: str | None = None) -> None:
        """A tensor stored as it is: its header dtype (a safetensors tag, when given: check_dtype) and its
        header shape against the config. `name`: as the model's class names it; `stored`: the file's own name
        where the reader renamed it (DeepSeek-V4's release names), which the message leads with."""
        label = name if stored in (None, name) else f"{stored} (read as {name})"
        if dtype is not None:
            check_dtype(name, dtype, where, label)
        want = self.expected(name)
        if want is None:
            return
        if len(shape) != len(want) or any(w is not None and s != w for s, (w, _) in zip(shape, want)):
            raise BadInput(f"shape {tuple(shape)} does not match config.json: expected "
                           f"{_show_expected(want)}", path=where, tensor=label)

    def check_linear(self, prefix: str, out_features: int, in_features: int, where: Path, tensor: str,
                     implied_by: str) -> None:
        """A quantized linear's sizes as its packed tensors imply them (`implied_by` says how)."""
        dims = self.linear(prefix)
        if dims is None:
            return
        for what, got, (want, key) in (("in_features", in_features, dims[1]), ("out_features", out_features, dims[0])):
            if want is not None and got != want:
                raise BadInput(f"{implied_by} implies {what} {got}, but config.json says {want} ({key})",
                               path=where, tensor=tensor)


def _show_expected(want: list[tuple]) -> str:
    sizes = ", ".join("?" if w is None else str(w) for w, _ in want)
    keys = ", ".join(k for w, k in want if w is not None)
    return f"({sizes}{',' if len(want) == 1 else ''}) from {keys}"


def layer_index(name: str) -> int | None:
    """N of a tensor named `model.layers.N.…`, else None."""
    m = _LAYER.match(name)
    return int(m[1]) if m else None


# -- dtypes -----------------------------------------------------------------------------------------
# A model's parameters are floats: embeddings, heads, norms, linears' weights and biases (nn.Embedding,
# nn.Linear, RMSNorm/LayerNorm). Stored as integers in a dense tensor they are corrupt (a relabelled
# header), never a format: quantized formats keep their integer codes under their own names (GPTQ
# qweight/qzeros/g_idx, QQQ B, HQQ W_q), which the readers consume before this check. The rule is by name
# and anywhere in a name (a multimodal wrapper's `language_model.model.layers...` too); these suffixes are
# never integer in an unquantized checkpoint of any architecture.
_FLOAT_ROLE = re.compile(r"(?:^|\.)(?:(?P<embed>embed_tokens\.weight)|(?P<head>lm_head\.weight)"
                         r"|(?P<norm>[a-z0-9_]*norm[a-z0-9_]*\.(?:weight|bias))|(?P<linear>[a-z0-9_]*_proj\.(?:weight|bias))"
                         r"|(?P<rope>inv_freq))$")
_ROLE_WORDS = {"embed": "an embedding", "head": "the output head", "norm": "a norm weight",
               "linear": "a linear layer's weight or bias", "rope": "a rotary frequency buffer"}
INTEGER_TAGS = frozenset({"I8", "I16", "I32", "I64", "U8", "U16", "U32", "U64", "BOOL"})
# Integer tensors real unquantized checkpoints do carry besides the parameters are buffers: position_ids
# and relative_position_index (int64), BatchNorm's num_batches_tracked (int64), attention masks saved as
# bool or uint8 (GPT-Neo/GPT-J's attn.bias). Every writer copies those five dtypes; 16-bit and unsigned
# 32/64-bit integers are no buffer's dtype and no writer stores them.
BUFFER_TAGS = frozenset({"I8", "U8", "I32", "I64", "BOOL"})


def check_dtype(name: str, dtype: str, where: Path, label: str | None = None) -> None:
    """A dense tensor's safetensors dtype tag against what its name says it is: a float parameter stored
    as an integer, or an integer of a width no buffer has, is a BadInput naming file, tensor (`label`, else
    `name`) and dtype."""
    if dtype not in INTEGER_TAGS:
        return
    shown = label or name
    m = _FLOAT_ROLE.search(name)
    if m:
        role = _ROLE_WORDS[m.lastgroup]
        raise BadInput(f"dtype {dtype} is an integer type, but this is {role}, a float tensor "
                       "(F16, BF16 or F32 in a dense checkpoint)", path=where, tensor=shown)
    if dtype not in BUFFER_TAGS:
        raise BadInput(f"dtype {dtype}: no model tensor is stored as this integer type (integer buffers are "
                       "I8, U8, I32, I64 or BOOL)", path=where, tensor=shown)


# -- the tensors of a known architecture ------------------------------------------------------------
# transformers' state dict of LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM and Qwen3ForCausalLM
# (modeling_llama.py etc.): model.embed_tokens.weight, model.norm.weight, lm_head.weight (absent when
# tie_word_embeddings is true; every one of the four configs defaults it to false), and per decoder layer
# input_layernorm.weight, post_attention_layernorm.weight, self_attn.{q,k,v,o}_proj.weight,
# mlp.{gate,up,down}_proj.weight, plus
#   llama:   self_attn.{q,k,v,o}_proj.bias when attention_bias, mlp.*_proj.bias when mlp_bias (both default false)
#   mistral: no biases
#   qwen2:   self_attn.{q,k,v}_proj.bias always (nn.Linear(..., bias=True)); o_proj has none
#   qwen3:   self_attn.q_norm.weight and k_norm.weight; self_attn.*_proj.bias when attention_bias
# Optional names real checkpoints carry beside these, accepted and never required: a bias on any of the
# seven linears (GPTQ-for-LLaMa's QuantLinear registered a zero bias buffer for every layer and saved it),
# and the rotary `inv_freq` buffer older transformers saved per layer (self_attn.rotary_emb.inv_freq;
# transformers drops it on loading). Quantized parts (GPTQ qweight/qzeros/scales/g_idx, QQQ
# B/s_channel/s_group, HQQ W_q/scale/zero/meta...) never reach these names: every reader yields one
# `<module>.weight` record per quantized linear.
KNOWN_LAYOUTS = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
                 "qwen3": "Qwen3ForCausalLM"}
_ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")
_MLP = ("gate_proj", "up_proj", "down_proj")
TOP_REQUIRED = ("model.embed_tokens.weight", "model.norm.weight")


@dataclass(frozen=True)
class Layout:
    """The tensor names of one known architecture: what every layer must hold (suffixes after
    `model.layers.N.`), what it may hold besides, and the top-level names."""
    model_type: str
    class_name: str
    layer_required: tuple[str, ...]
    layer_optional: frozenset[str]
    top_required: tuple[str, ...]
    top_optional: frozenset[str]
    required_because: dict  # suffix -> the config key that makes it required (biases)

    def allows(self, name: str, n_layers: int | None) -> bool:
        """Whether `name` is one of the architecture's names (a layer index in range when n_layers is known)."""
        m = _LAYER.match(name)
        if m is None:
            return name in self.top_required or name in self.top_optional
        if m[1] != str(int(m[1])) or (n_layers is not None and int(m[1]) >= n_layers):
            return False  # `model.layers.01.` is not a name transformers writes or loads
        suffix = name[m.end():]
        return suffix in self.layer_required or suffix in self.layer_optional


def known_layout(config: dict, where: Path) -> Layout | None:
    """The Layout of config.json's model_type when it is one of KNOWN_LAYOUTS, else None (other
    architectures: MoE, hybrid and multi-token-prediction models vary from layer to layer)."""
    model_type = config.get("model_type")
    if not isinstance(model_type, str) or model_type not in KNOWN_LAYOUTS:
        return None
    view = ConfigView(config, where)
    required = ["input_layernorm.weight", "post_attention_layernorm.weight"]
    required += [f"self_attn.{p}.weight" for p in _ATTN] + [f"mlp.{p}.weight" for p in _MLP]
    because: dict[str, str] = {}
    if model_type in ("llama", "qwen3") and view.bool("attention_bias", default=False):
        because.update({f"self_attn.{p}.bias": "attention_bias true" for p in _ATTN})
    if model_type == "llama" and view.bool("mlp_bias", default=False):
        because.update({f"mlp.{p}.bias": "mlp_bias true" for p in _MLP})
    if model_type == "qwen2":
        because.update({f"self_attn.{p}.bias": "qwen2 (its q/k/v projections always have a bias)"
                        for p in ("q_proj", "k_proj", "v_proj")})
    if model_type == "qwen3":
        required += ["self_attn.q_norm.weight", "self_attn.k_norm.weight"]
    required += list(because)
    optional = {f"self_attn.{p}.bias" for p in _ATTN} | {f"mlp.{p}.bias" for p in _MLP}
    optional |= {"self_attn.rotary_emb.inv_freq"}
    tied = view.bool("tie_word_embeddings", default=False)
    top_required = TOP_REQUIRED if tied else (*TOP_REQUIRED, "lm_head.weight")
    return Layout(model_type, KNOWN_LAYOUTS[model_type], tuple(required), frozenset(optional - set(required)),
                  top_required, frozenset({"lm_head.weight", "model.rotary_emb.inv_freq"}), because)


# --------------------------------------------------------------------------------------------------
# What the core knows of a transformers model class beyond its shapes: one entry per class
@dataclass(frozen=True)
class HfArchitecture:
    """A transformers model class (config.json `architectures`) and the names its loader expects where
    producers save others: `renames`, (regular expression, replacement) pairs applied in order."""

    class_name: str
    renames: tuple[tuple[str, str], ...] = ()

    def canonical(self, name: str) -> str:
        for pattern, replacement in self.renames:
            name = re.sub(pattern, replacement, name)
        return name


_ARCHITECTURES: dict[str, HfArchitecture] = {}


def register_architecture(arch: HfArchitecture) -> HfArchitecture:
    """Add a model class's entry (an entry registered twice must be the same one)."""
    if _ARCHITECTURES.get(arch.class_name, arch) != arch:
        raise ValueError(f"architecture {arch.class_name!r} is already registered")
    _ARCHITECTURES[arch.class_name] = arch
    return arch


def canonical_name(name: str, config: dict) -> str:
    """The name transformers loads a tensor by for the model's class: the source's name, except where a
    producer renamed modules (writers write it; verify matches the two sides by it)."""
    named = config.get("architectures") or []
    for class_name, arch in _ARCHITECTURES.items():
        if class_name in named:
            name = arch.canonical(name)
    return name


# gptqmodel saves Mixtral's experts under Qwen-style names (mlp.experts.E.gate_proj / up_proj / down_proj,
# router mlp.gate); transformers' Mixtral checkpoints, and the key mapping its loader applies, name them
# block_sparse_moe.experts.E.w1 / w3 / w2 and block_sparse_moe.gate: under the other names transformers
# would leave the experts random (measured: logits off by 2)
register_architecture(HfArchitecture("MixtralForCausalLM", renames=(
    (r"\.mlp\.experts\.(\d+)\.gate_proj\.", r".block_sparse_moe.experts.\1.w1."),
    (r"\.mlp\.experts\.(\d+)\.up_proj\.", r".block_sparse_moe.experts.\1.w3."),
    (r"\.mlp\.experts\.(\d+)\.down_proj\.", r".block_sparse_moe.experts.\1.w2."),
    (r"\.mlp\.gate\.", ".block_sparse_moe.gate."),
)))

# llm-compressor 0.14 quantizes MiniMax-M2 with its experts linearized (one Linear per expert, named as its generic
# expert MLP: gate_proj / up_proj / down_proj) and saves them under the release's block_sparse_moe prefix:
# block_sparse_moe.experts.E.gate_proj, neither the release's w1 / w3 / w2 (which transformers' Mixtral mapping
# fuses on load) nor transformers' fused mlp.experts.gate_up_proj. Only llm-compressor's own loader reads them
# back (patch_moe_mappings, scripts/producers/llmcompressor_archs.py); transformers 5.17 / 5.24 leave every expert
# at its initial weights (measured). Named as the release names them, every writer's output loads, and GGUF's
# name map (gguf-py knows w1 / w3 / w2) finds them.
register_architecture(HfArchitecture("MiniMaxM2ForCausalLM", renames=(
    (r"\.block_sparse_moe\.experts\.(\d+)\.gate_proj\.", r".block_sparse_moe.experts.\1.w1."),
    (r"\.block_sparse_moe\.experts\.(\d+)\.up_proj\.", r".block_sparse_moe.experts.\1.w3."),
    (r"\.block_sparse_moe\.experts\.(\d+)\.down_proj\.", r".block_sparse_moe.experts.\1.w2."),
)))
