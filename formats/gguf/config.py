"""GGUF metadata -> a config.json dict (transformers layout): the keys every architecture shares here, the
architecture's own through its entry's `config_from_gguf` hook (archs/). Every value is type- and
range-checked (BadInput naming the file and the key).
"""

from __future__ import annotations

from typing import Any, Iterable, Mapping


from ...converters.errors import BadInput, QConvertError
from ...converters.validate import ConfigView
from .archs import arch_by_name
from .names import supported_archs
from .hparams import DEFAULT_RMS_EPS, DEFAULT_ROPE_THETA, MAX_HEADS, MAX_VOCAB, MAX_WIDTH


def field_values(fields: Any) -> dict[str, Any]:
    """Python values of a GGUF file's metadata: accepts a :class:`gguf.GGUFReader`, its ``fields``
    mapping (``ReaderField`` values) or an already plain ``{key: value}`` mapping."""
    if hasattr(fields, "fields") and not isinstance(fields, Mapping):
        fields = fields.fields
    out = {}
    for k, v in fields.items():
        out[k] = v.contents() if hasattr(v, "contents") and callable(v.contents) else v
    return out


def _typed(kv: Mapping, path: object) -> ConfigView:
    """Typed, range-checked reads of GGUF metadata values (a wrong type or range names the key)."""
    return ConfigView(dict(kv), path, prefix="metadata ")


def config_from_gguf(fields: Any, tensor_names: Iterable[str] | None = None, *, path: object = None) -> dict:
    """A config.json dict (transformers layout) from GGUF metadata, for llama / qwen2 / qwen3.

    ``fields``: a :class:`gguf.GGUFReader`, its ``.fields``, or a plain ``{key: value}`` dict.
    ``tensor_names`` (taken from the reader when one is passed) decides ``tie_word_embeddings``
    (no ``output.weight``) and llama's ``attention_bias`` / ``mlp_bias``; without it the model is
    assumed untied and bias-free. A llama-3 ``rope_freqs`` tensor is not turned back into
    ``rope_scaling`` (its parameters are not recoverable from the factors alone).
    Every value is type- and range-checked (BadInput naming ``path`` and the key); whether the values
    agree with the tensors is :func:`check_gguf_tensors`' job.
    """
    if tensor_names is None and hasattr(fields, "tensors") and not isinstance(fields, Mapping):
        tensor_names = [t.name for t in fields.tensors]
    kv = field_values(fields)
    arch = kv.get("general.architecture")
    if not isinstance(arch, str) or arch_by_name(arch) is None:
        raise QConvertError(f"GGUF architecture {arch!r:.60} cannot be turned into a config.json; "
                            f"supported: {', '.join(supported_archs())}", path=path)
    spec = arch_by_name(arch)
    if spec.not_read:
        raise QConvertError(f"GGUF architecture {arch} is written by qconvert but not read back: {spec.not_read}",
                            path=path)
    cv = _typed(kv, path)  # the hook's view: the arrays as they are
    layer0 = dict(kv)
    for key in spec.per_layer_keys:  # a per-layer array: the shared fields take layer 0's value
        value = kv.get(f"{arch}.{key}")
        if isinstance(value, list) and value:
            layer0[f"{arch}.{key}"] = value[0]
    scalars = _typed(layer0, path)

    def get(key: str, default: Any = None, required: bool = False, kind: str = "int", **bounds) -> Any:
        full = f"{arch}.{key}"
        if full not in kv:
            if required:
                raise BadInput(f"GGUF metadata lacks {full}", path=path)
            return default
        return scalars.int(full, **bounds) if kind == "int" else scalars.float(full, **bounds)

    n_embd = get("embedding_length", required=True, lo=1, hi=MAX_WIDTH)
    n_head = get("attention.head_count", required=True, lo=1, hi=MAX_HEADS)
    n_kv = get("attention.head_count_kv", n_head, lo=1, hi=n_head)
    if n_head % n_kv:
        raise BadInput(f"metadata {arch}.attention.head_count {n_head} is not a multiple of "
                       f"{arch}.attention.head_count_kv {n_kv}", path=path)
    if f"{arch}.attention.key_length" in kv:
        hd = get("attention.key_length", lo=1, hi=MAX_WIDTH)
    elif n_embd % n_head:
        raise BadInput(f"metadata {arch}.embedding_length {n_embd} is not a multiple of "
                       f"{arch}.attention.head_count {n_head} (and no {arch}.attention.key_length is given)", path=path)
    else:
        hd = n_embd // n_head
    hd_v = get("attention.value_length", hd, lo=1, hi=MAX_WIDTH)
    tokens = kv.get("tokenizer.ggml.tokens")
    if tokens is not None and not isinstance(tokens, list):
        raise BadInput("metadata tokenizer.ggml.tokens is not an array", path=path)
    n_vocab = len(tokens) if tokens else get("vocab_size", lo=1, hi=MAX_VOCAB)
    if n_vocab is None:
        raise BadInput("GGUF metadata has neither tokenizer.ggml.tokens nor a vocab_size", path=path)
    cls, model_type = spec.hf_class, spec.model_type
    cfg: dict[str, Any] = {
        "architectures": [cls],
        "model_type": model_type,
        "hidden_size": n_embd,
        "intermediate_size": get("feed_forward_length", required=spec.dense_ffn_width, lo=1, hi=MAX_WIDTH),
        "num_hidden_layers": get("block_count", required=True, lo=1),
        "num_attention_heads": n_head,
        "num_key_value_heads": n_kv,
        "head_dim": hd,
        "max_position_embeddings": get("context_length", required=True, lo=1),
        "rms_norm_eps": get("attention.layer_norm_rms_epsilon", DEFAULT_RMS_EPS, kind="float", lo=0.0, hi=1.0),
        "rope_theta": get("rope.freq_base", DEFAULT_ROPE_THETA, kind="float", lo=1e-30),
        "vocab_size": int(n_vocab),
        "hidden_act": "silu",
    }
    if cfg["intermediate_size"] is None:  # no dense FFN (dense_ffn_width False)
        del cfg["intermediate_size"]
    if hd_v != hd:  # transformers has one head_dim: check_gguf_tensors refuses this after naming any bad shape
        cfg["_value_head_dim"] = hd_v
    names = set(tensor_names) if tensor_names is not None else None
    cfg["tie_word_embeddings"] = bool(names is not None and "output.weight" not in names)
    if arch == "llama":
        cfg["attention_bias"] = bool(names and "blk.0.attn_q.bias" in names)
        cfg["mlp_bias"] = bool(names and "blk.0.ffn_up.bias" in names)
    elif arch == "qwen3":
        cfg["attention_bias"] = bool(names and "blk.0.attn_q.bias" in names)
    if arch in ("qwen2", "qwen3"):
        cfg["use_sliding_window"] = False

    stype = cv.str(f"{arch}.rope.scaling.type", default=None)
    if stype in ("linear", "yarn"):
        scaling: dict[str, Any] = {"rope_type": stype,
                                   "factor": get("rope.scaling.factor", 1.0, kind="float", lo=1e-30)}
        if stype == "yarn":
            for key, hf, kind in (("rope.scaling.original_context_length", "original_max_position_embeddings", "int"),
                                  ("rope.scaling.yarn_ext_factor", "extrapolation_factor", "float"),
                                  ("rope.scaling.yarn_attn_factor", "attention_factor", "float"),
                                  ("rope.scaling.yarn_beta_fast", "beta_fast", "float"),
                                  ("rope.scaling.yarn_beta_slow", "beta_slow", "float")):
                if get(key, kind=kind) is not None:
                    scaling[hf] = get(key, kind=kind)
        cfg["rope_scaling"] = scaling

    if spec.mtp is not None and spec.mtp.kept and f"{arch}.nextn_predict_layers" in kv:
        # block_count counts the multi-token-prediction blocks after the trunk (archs/mtp.py): the config's
        # num_hidden_layers is the trunk, and the block count goes back where the source's config states it
        nextn = get("nextn_predict_layers", lo=0, hi=cfg["num_hidden_layers"] - 1)
        cfg["num_hidden_layers"] -= nextn
        cfg["_mtp_blocks"] = nextn  # for the architecture's hook (per-block arrays), taken off below
        if spec.mtp.config_key:
            cfg[spec.mtp.config_key] = nextn
    spec.config_from_gguf(cfg, get, names, cv)  # the architecture's own fields (archs/)
    cfg.pop("_mtp_blocks", None)
    for typ, key in (("bos", "tokenizer.ggml.bos_token_id"), ("eos", "tokenizer.ggml.eos_token_id"),
                     ("pad", "tokenizer.ggml.padding_token_id")):
        if key in kv:
            tid = cv.int(key, lo=0)
            if tid < n_vocab:  # llama.cpp ignores an id outside the vocabulary; so does the config
                cfg[f"{typ}_token_id"] = tid
    return cfg
