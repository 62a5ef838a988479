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
from pathlib import Path

from ..converters.errors import BadInput
from ..converters.validate import ConfigView

__all__ = ["ModelShapes", "MAX_LAYERS", "MAX_DIM"]

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
        model_type = config.get("model_type")
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
    def check_dense(self, name: str, shape: tuple, where: Path) -> None:
        """A tensor stored as it is: its header shape against the config."""
        want = self.expected(name)
        if want is None:
            return
        if len(shape) != len(want) or any(w is not None and s != w for s, (w, _) in zip(shape, want)):
            raise BadInput(f"shape {tuple(shape)} does not match config.json: expected "
                           f"{_show_expected(want)}", path=where, tensor=name)

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
