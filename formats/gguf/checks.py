"""The GGUF metadata against the tensors, both directions: a GGUF being read (its hyper-parameters against its
tensors' shapes and the tensors llama.cpp's loader requires of every layer) and a config.json being written
(its values typed and in range, its shapes against the tensors to write), each refused with the key named.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Iterable, Mapping


from ...converters.errors import BadInput
from ...converters.validate import ConfigView
from .archs import EXPERT_COUNT_KEYS, arch_by_name
from .names import hf_tensor_name, layer_index
from .hparams import FLOAT32_MAX, MAX_HEADS, MAX_VOCAB, MAX_WIDTH, phi3_rope_dims, rope_parameters


_BLOCK_RE = re.compile(r"^blk\.(0|[1-9][0-9]*)\.")
# per layer of a MoE model, the routed FFN llama.cpp's loaders require in place of the dense one
_MOE_BLOCK = ("ffn_gate_inp", "ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")
# GGUF tensors gguf-py names with no `.weight` / `.bias` suffix (llama.cpp's tn(LLM_TENSOR_SSM_A_NOSCAN, il))
_BARE = frozenset({"ssm_a"})


def _tensor_name(base: str) -> str:
    """A required entry as the tensor's name within its block: `.weight` unless the entry says `.bias` (the
    tables list `ssm_dt.bias`, `exp_probs_b.bias`) or gguf-py writes it bare (`ssm_a`)."""
    return base if base.endswith((".weight", ".bias")) or base in _BARE else f"{base}.weight"


def _required_block(arch: str, layer_names: set[str], config: Mapping | None = None,
                    mtp: bool = False) -> tuple[str, ...]:
    """The tensors llama.cpp's loader for `arch` requires in a layer (biases are optional), each as its name
    within the block (_tensor_name). A MoE model's layer is routed when it holds any routed tensor (DeepSeek and
    Qwen-MoE may keep dense layers); a hybrid model's layer is a linear-attention one when it holds any of those
    tensors. With `config` (the writer's config.json) also a routed layer's shared expert and router bias
    (GgufArch.routed_extra) and, for a kept MTP block (`mtp`), the block's own tensors (MtpBlock.required)."""
    spec = arch_by_name(arch)
    has_routed = any(n in layer_names for n in _MOE_BLOCK)
    has_dense = any(n in layer_names for n in spec.dense_ffn)
    routed = has_routed or (spec.moe and not has_dense)
    linear = bool(spec.linear_attention) and any(n.removesuffix(".bias") in layer_names
                                                 for n in spec.linear_attention)
    attention = spec.linear_attention if linear else spec.attention
    if routed and spec.routed_beside_dense:
        need = spec.norms + attention + spec.block_extra + spec.dense_ffn + spec.routed_beside_dense
    else:
        need = spec.norms + attention + spec.block_extra + (_MOE_BLOCK if routed else spec.dense_ffn)
    if config is not None and routed:
        count = config.get(spec.shared_experts_key) if spec.shared_experts_key else 1
        shared = isinstance(count, int) and count > 0
        need += tuple(n for n in spec.routed_extra if shared or "_shexp" not in n)
    if mtp and spec.mtp is not None:
        need += spec.mtp.required
    return tuple(_tensor_name(n) for n in need)


def _expected_shapes(cfg: Mapping, keys: Mapping[str, str]) -> dict[str, tuple[tuple[int, ...], str]]:
    """GGUF base name (``blk.N.`` stripped) -> (HF-order shape, the metadata it follows from) for the
    weights and biases of a llama / qwen2 / qwen3 model. ``keys`` names each hyper-parameter."""
    e, f, v = cfg["hidden_size"], cfg.get("intermediate_size") or 0, cfg["vocab_size"]
    hd, nh, nkv = cfg["head_dim"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    k = keys

    def says(*names: str) -> str:
        return ", ".join(f"{k[n]} {cfg.get(n)}" for n in names)

    hdv = cfg.get("_value_head_dim", hd)
    q, kvr, qv, kvv = nh * hd, nkv * hd, nh * hdv, nkv * hdv
    vk = "_value_head_dim" if "_value_head_dim" in cfg else "head_dim"
    heads = ("num_attention_heads", "head_dim", "hidden_size")
    kv_heads = ("num_key_value_heads", "head_dim", "hidden_size")
    ffn = ("intermediate_size", "hidden_size")
    out = {
        "token_embd.weight": ((v, e), says("vocab_size", "hidden_size")),
        "output.weight": ((v, e), says("vocab_size", "hidden_size")),
        "output_norm.weight": ((e,), says("hidden_size")),
        "attn_norm.weight": ((e,), says("hidden_size")),
        "ffn_norm.weight": ((e,), says("hidden_size")),
        "attn_q.weight": ((q, e), says(*heads)),
        "attn_k.weight": ((kvr, e), says(*kv_heads)),
        "attn_v.weight": ((kvv, e), says("num_key_value_heads", vk, "hidden_size")),
        "attn_output.weight": ((e, qv), says("num_attention_heads", vk, "hidden_size")),
        "attn_q.bias": ((q,), says("num_attention_heads", "head_dim")),
        "attn_k.bias": ((kvr,), says("num_key_value_heads", "head_dim")),
        "attn_v.bias": ((kvv,), says("num_key_value_heads", vk)),
        "attn_output.bias": ((e,), says("hidden_size")),
        "attn_q_norm.weight": ((hd,), says("head_dim")),
        "attn_k_norm.weight": ((hd,), says("head_dim")),
        "ffn_gate.weight": ((f, e), says(*ffn)),
        "ffn_up.weight": ((f, e), says(*ffn)),
        "ffn_down.weight": ((e, f), says(*ffn)),
        "ffn_gate.bias": ((f,), says("intermediate_size")),
        "ffn_up.bias": ((f,), says("intermediate_size")),
        "ffn_down.bias": ((e,), says("hidden_size")),
        "rope_freqs.weight": ((hd // 2,), says("head_dim")),
        "post_attention_norm.weight": ((e,), says("hidden_size")),
        "post_ffw_norm.weight": ((e,), says("hidden_size")),
    }
    spec = arch_by_name(cfg.get("_arch", ""))
    if spec is not None and spec.mla:  # latent attention: its projections follow the lora ranks, not head_dim
        for name in [n for n in out if n.startswith(("attn_q.", "attn_k.", "attn_v.", "attn_output.", "attn_q_norm",
                                                       "attn_k_norm"))]:
            del out[name]
    if spec is not None and spec.qk_norm_whole:  # OLMo 2 / 3 normalise the whole q and k projections
        out["attn_q_norm.weight"] = ((q,), says("num_attention_heads", "head_dim"))
        out["attn_k_norm.weight"] = ((kvr,), says("num_key_value_heads", "head_dim"))
    if spec is not None and spec.gated_query:  # each head's query and its output gate
        out["attn_q.weight"] = ((2 * q, e), says(*heads) + " (query and gate)")
    if cfg.get("_arch") == "phi3":  # fused projections: q, k, v rows in one, gate and up rows in one
        out["attn_qkv.weight"] = ((q + 2 * kvr, e), says(*heads, "num_key_value_heads"))
        out["ffn_up.weight"] = ((2 * f, e), says(*ffn))
        del out["ffn_gate.weight"]
    n_exp, f_exp = cfg.get("_n_expert"), cfg.get("_expert_ff")
    if n_exp and f_exp:
        # a latent MoE (Kimi-K3) runs its routed experts in a down-projected space, not at hidden_size
        el, el_key = (cfg["_expert_latent"], "_expert_latent") if cfg.get("_expert_latent") else (e, "hidden_size")
        exp = ("_n_expert", "_expert_ff", el_key)
        out["ffn_gate_inp.weight"] = ((n_exp, e), says("_n_expert", "hidden_size"))
        out["ffn_gate_exps.weight"] = ((n_exp, f_exp, el), says(*exp))
        out["ffn_up_exps.weight"] = ((n_exp, f_exp, el), says(*exp))
        out["ffn_down_exps.weight"] = ((n_exp, el, f_exp), says(*exp))
    if n_exp and f_exp:  # gpt-oss: the router's and every expert's biases
        out["ffn_gate_inp.bias"] = ((n_exp,), says("_n_expert"))
        out["ffn_gate_exps.bias"] = ((n_exp, f_exp), says("_n_expert", "_expert_ff"))
        out["ffn_up_exps.bias"] = ((n_exp, f_exp), says("_n_expert", "_expert_ff"))
        out["ffn_down_exps.bias"] = ((n_exp, e), says("_n_expert", "hidden_size"))
    out["attn_sinks.weight"] = ((nh,), says("num_attention_heads"))
    f_sh = cfg.get("_shared_ff")
    if f_sh:
        out["ffn_gate_shexp.weight"] = ((f_sh, e), says("_shared_ff", "hidden_size"))
        out["ffn_up_shexp.weight"] = ((f_sh, e), says("_shared_ff", "hidden_size"))
        out["ffn_down_shexp.weight"] = ((e, f_sh), says("_shared_ff", "hidden_size"))
    return out


_EXPERT_KEYS = (("_n_expert", EXPERT_COUNT_KEYS, "expert_count"),
                ("_expert_ff", ("moe_intermediate_size",), "expert_feed_forward_length"),
                ("_shared_ff", ("shared_expert_intermediate_size",), "expert_shared_feed_forward_length"),
                ("_expert_latent", ("routed_expert_hidden_size",), "expert_latent_length"))


def _expert_facts(config: Mapping, arch: str, cv: ConfigView, label) -> tuple[dict, dict]:
    """The sizes the expert tensors' shapes follow from (the routed experts, their FFN width, the shared
    expert's), as `_expected_shapes` reads them, and the key each came from (`label(config key)`, for
    the messages). Mixtral's experts are intermediate_size wide."""
    facts: dict = {"_arch": arch}
    keys: dict = {}
    for fact, config_keys, _ in _EXPERT_KEYS:
        for k in config_keys:
            if config.get(k) is not None:
                facts[fact] = cv.int(k, lo=0, hi=MAX_WIDTH)
                keys[fact] = label(k)
                break
    if facts.get("_n_expert") and not facts.get("_expert_ff"):
        facts["_expert_ff"] = int(config["intermediate_size"])
        keys["_expert_ff"] = label("intermediate_size")
    return facts, keys


def _layers_present(names: Iterable[str], path_of, label) -> int:
    """The number of layers the tensor names hold: blocks 0 .. n-1, each with at least one tensor (a
    gap is refused here, so that n is bounded by the tensor count, whatever index a name carries)."""
    first: dict[int, str] = {}
    for n in names:
        if n.startswith("blk."):
            m = _BLOCK_RE.match(n)
            if m is None:
                raise BadInput("block tensor name without a block number blk.N.", path=path_of(n), tensor=label(n))
            first.setdefault(int(m.group(1)), n)
    for expect, index in enumerate(sorted(first)):
        if index != expect:
            raise BadInput(f"the tensors skip layer {expect} (no blk.{expect}.* tensor) but name layer {index}",
                           path=path_of(first[index]), tensor=label(first[index]))
    return len(first)


def _check_against(cfg: Mapping, shapes: Mapping[str, tuple[int, ...]], keys: Mapping[str, str], arch: str,
                   path_of, label, layers_key: str, what: str, config: Mapping | None = None, trunk: int | None = None,
                   missing=None) -> None:
    """``shapes``: GGUF name -> HF-order shape of every tensor present; ``path_of(name)`` the file to
    name (name None: the file of the metadata), ``label(name)`` the tensor name to show. The writer also gives
    its ``config`` (config.json, for the rules that read it), the ``trunk`` layers (the blocks after them are a
    kept MTP block's) and ``missing(name) -> (file, tensor)`` to name a missing tensor by."""
    n_layers = cfg["num_hidden_layers"]
    present = _layers_present(shapes, path_of, label)
    if present != n_layers:
        span = f"blk.0 .. blk.{present - 1}" if present else "no blk.N tensors"
        raise BadInput(f"{layers_key} is {n_layers} but the {what} hold {present} layers ({span})",
                       path=path_of(None))
    required = ["token_embd.weight", "output_norm.weight"]
    in_layer: dict[int, set[str]] = {}
    for name in shapes:
        m = _BLOCK_RE.match(name)
        if m:
            in_layer.setdefault(int(m.group(1)), set()).add(name[m.end():].rsplit(".", 1)[0])
    trunk = n_layers if trunk is None else trunk
    for i in range(n_layers):  # bounded: n_layers equals the layers the tensors name
        required += [f"blk.{i}.{b}" for b in _required_block(arch, in_layer.get(i, set()), config, mtp=i >= trunk)]
    for name in required:
        if name not in shapes:
            layer = _BLOCK_RE.match(name)
            if layer is None:
                why = f"every {arch} model has it"
            elif int(layer[1]) >= trunk:
                why = f"the multi-token-prediction block after the {trunk} layers needs it"
            else:
                why = f"{arch} needs it in each of the {trunk} layers"
            where, tensor = missing(name) if missing else (path_of(None), label(name))
            raise BadInput(f"required tensor is missing ({why})", path=where, tensor=tensor)
    expected = _expected_shapes(cfg, keys)
    order = {base: i for i, base in enumerate(expected)}
    varying = set(arch_by_name(arch).varying_shapes)

    def split(name: str) -> tuple[int, str]:
        m = _BLOCK_RE.match(name)
        return (int(m.group(1)), name[m.end():]) if m else (-1, name)

    # the model's tensors first, then layer by layer in the table's order: the first contradiction is named
    for name in sorted(shapes, key=lambda n: (split(n)[0], order.get(split(n)[1], len(order)), n)):
        shape, base = shapes[name], split(name)[1]
        want = None if base in varying else expected.get(base)
        if want is not None and tuple(shape) != want[0]:
            raise BadInput(f"shape {list(shape)} contradicts the {'metadata' if what == 'tensors' else 'config'} "
                           f"({want[1]}), which give {list(want[0])}", path=path_of(name), tensor=label(name))


def check_gguf_tensors(cfg: Mapping, arch: str, shapes: Mapping[str, tuple[int, ...]], *, path: object = None,
                       where: Mapping[str, object] | None = None) -> None:
    """A GGUF's metadata (as :func:`config_from_gguf` turned it into ``cfg``) against its tensors:
    ``block_count`` equals the layers present, every tensor llama.cpp requires for them is there, and
    every known tensor has the shape the hyper-parameters give. ``shapes``: GGUF name -> HF-order shape."""
    keys = {"hidden_size": f"{arch}.embedding_length", "intermediate_size": f"{arch}.feed_forward_length",
            "vocab_size": "vocab size (tokenizer.ggml.tokens)", "head_dim": f"{arch}.attention.key_length",
            "num_attention_heads": f"{arch}.attention.head_count",
            "num_key_value_heads": f"{arch}.attention.head_count_kv", "num_hidden_layers": f"{arch}.block_count"}
    keys = dict(keys, _value_head_dim=f"{arch}.attention.value_length")
    metadata_key = {hf: f"{arch}.{g}" for _, hfs, g in _EXPERT_KEYS for hf in hfs}
    metadata_key["intermediate_size"] = f"{arch}.feed_forward_length"
    if arch == "gpt-oss":  # its config's intermediate_size is the experts' width (_gpt_oss_config)
        metadata_key["intermediate_size"] = keys["intermediate_size"] = f"{arch}.expert_feed_forward_length"
    facts, fact_keys = _expert_facts(cfg, arch, ConfigView(dict(cfg), path), lambda k: metadata_key.get(k, k))
    cfg = {**cfg, **facts}
    dense_key = arch_by_name(arch).dense_ffn_key
    if dense_key != "intermediate_size":  # Llama 4: the dense layers' width (feed_forward_length)
        cfg["intermediate_size"] = cfg[dense_key]
    keys.update(fact_keys)
    where = where or {}
    _check_against(cfg, shapes, keys, arch, lambda n: where.get(n, path) if n else path, lambda n: n,
                   f"metadata {arch}.block_count", "tensors")
    if cfg.get("_value_head_dim", cfg["head_dim"]) != cfg["head_dim"]:
        raise BadInput(f"metadata {arch}.attention.value_length {cfg['_value_head_dim']} differs from "
                       f"{arch}.attention.key_length {cfg['head_dim']}: transformers' {arch} has one head_dim",
                       path=path)


# --------------------------------------------------------------------------------------------------
# the writer's inputs: config.json against the tensors being written
# --------------------------------------------------------------------------------------------------
def config_json_path(source) -> Path:
    """The file a source's config came from: config.json in a checkpoint folder, else the file itself."""
    p = Path(getattr(source, "path", "."))
    return p / "config.json" if p.is_dir() else p


def layer_count(config: Mapping, path: object) -> int:
    """num_hidden_layers as an integer >= 1 (whether the tensors agree is check_writer_config's job)."""
    return ConfigView(config, path).int("num_hidden_layers", lo=1)


_ROPE_TYPES = ("default", "linear", "yarn", "llama3", "dynamic")


def _check_rope(config: Mapping, path: object, arch: str = "") -> None:
    """The rope settings GGUF can hold (what _add_rope_scaling and rope_freqs_tensor write), checked
    before writing: a type GGUF cannot store, a scaling without its factor, llama3 frequencies that
    would divide by zero."""
    cv = ConfigView(config, path)
    for key in ("rope_scaling", "rope_parameters"):  # a wrong type is named by its own key first
        cv.view(key, default=None)
    rp = rope_parameters(config)
    where = "rope_parameters" if isinstance(config.get("rope_parameters"), Mapping) else "rope_scaling"
    r = ConfigView(rp, path, prefix=f"{where}.")
    rtype = rp["rope_type"]
    allowed = _ROPE_TYPES + (arch_by_name(arch).extra_rope_types if arch_by_name(arch) else ())
    if rtype not in allowed:
        raise BadInput(f"{where} type {rtype!r} cannot be stored in GGUF for this architecture "
                       f"(supported: {', '.join(t for t in allowed if t not in ('default', 'dynamic'))})", path=path)
    if rtype in ("longrope", "su"):
        rope_dims = phi3_rope_dims(config)
        for key in ("long_factor", "short_factor"):
            factors = rp.get(key)
            if not isinstance(factors, list) or len(factors) != rope_dims // 2 or not all(
                    isinstance(f, (int, float)) and not isinstance(f, bool) for f in factors):
                raise BadInput(f"{where}.{key} must be a list of {rope_dims // 2} numbers (half the rotated "
                               "dimensions)", path=path)
    r.float("rope_theta", lo=1e-30, hi=FLOAT32_MAX)
    if rtype in ("linear", "yarn"):
        r.float("factor", lo=1e-30, hi=FLOAT32_MAX)
    if rtype == "llama3":
        r.float("factor", default=8.0, lo=1e-30, hi=FLOAT32_MAX)
        low = r.float("low_freq_factor", default=1.0, lo=1e-30, hi=FLOAT32_MAX)
        high = r.float("high_freq_factor", default=4.0, lo=1e-30, hi=FLOAT32_MAX)
        r.int("original_max_position_embeddings", default=8192, lo=1, hi=2**32 - 1)
        if high <= low:
            raise BadInput(f"{where}.high_freq_factor {high} is not above low_freq_factor {low} (llama3 rope "
                           "interpolates between them)", path=path)


def check_writer_config(config: Mapping, arch: str, shapes: Mapping[str, tuple[int, ...]], path: object,
                        names: Mapping[str, str] | None = None, unmapped: Iterable[str] = (), mtp_blocks: int = 0,
                        source_path: object = None) -> None:
    """The hyper-parameters a GGUF is written with (config.json's), type- and range-checked and compared
    with the tensors being written (``shapes``: GGUF name -> HF-order shape; ``names``: GGUF name ->
    the source's name, for the messages); BadInput naming ``path`` and the key. Run before anything
    is written, so a bad config stops the conversion. ``mtp_blocks``: the multi-token-prediction blocks written
    after the trunk (archs/mtp.py), layers the tensors hold beyond num_hidden_layers.

    Every layer must hold what llama.cpp's loader requires of its kind (_required_block: full or linear attention,
    dense or routed FFN with its shared expert, the MTP block's own tensors), read from the architecture's entry
    alone: this is the completeness check that holds without transformers installed (class_tensors.py compares
    with the transformers class only where it is). A missing tensor is named by its checkpoint (HF) name where
    the name map gives one, its GGUF name beside it, and the refusal names ``source_path`` (the checkpoint's
    weights file or folder; default ``path``)."""
    cv = ConfigView(config, path)
    n_embd = cv.int("hidden_size", lo=1, hi=MAX_WIDTH)
    n_head = cv.int("num_attention_heads", lo=1, hi=MAX_HEADS)
    n_kv = cv.int("num_key_value_heads", default=n_head, lo=1, hi=n_head)
    if n_head % n_kv:
        raise BadInput(f"num_attention_heads {n_head} is not a multiple of num_key_value_heads {n_kv}", path=path)
    hd = cv.int("head_dim", default=None, lo=1, hi=MAX_WIDTH)
    if hd is None:
        if n_embd % n_head:
            raise BadInput(f"hidden_size {n_embd} is not a multiple of num_attention_heads {n_head} (and no "
                           "head_dim is given)", path=path)
        hd = n_embd // n_head
    cfg = {"hidden_size": n_embd, "num_attention_heads": n_head, "num_key_value_heads": n_kv, "head_dim": hd,
           "intermediate_size": cv.int("intermediate_size", lo=1, hi=MAX_WIDTH) if arch_by_name(arch).dense_ffn_width
           else cv.int("intermediate_size", default=None, lo=1, hi=MAX_WIDTH),
           "num_hidden_layers": cv.int("num_hidden_layers", lo=1) + int(mtp_blocks),
           "vocab_size": cv.int("vocab_size", default=None, lo=1, hi=MAX_VOCAB)}
    cv.int("max_position_embeddings", lo=1, hi=2**32 - 1)
    cv.float("rms_norm_eps", default=None, lo=0.0, hi=1.0)
    cv.float("rope_theta", default=None, lo=1e-30, hi=FLOAT32_MAX)
    cv.bool("tie_word_embeddings", default=None)
    _check_rope(config, path, arch)
    for key in ("rope_scaling", "rope_parameters"):
        sub = cv.view(key, default=None)
        if sub is None:
            continue
        groups = [sub] if not (sub.data and all(isinstance(v, Mapping) for v in sub.data.values())) else \
            [sub.view(k) for k in sub.data]
        for g in groups:
            g.str("rope_type", default=None)
            g.str("type", default=None)
            g.float("rope_theta", default=None, lo=1e-30, hi=FLOAT32_MAX)
            g.float("factor", default=None, lo=1e-30, hi=FLOAT32_MAX)
            g.int("original_max_position_embeddings", default=None, lo=1, hi=2**32 - 1)
            for name in ("low_freq_factor", "high_freq_factor", "extrapolation_factor", "attention_factor",
                         "attn_factor", "beta_fast", "beta_slow"):
                g.float(name, default=None, lo=-FLOAT32_MAX, hi=FLOAT32_MAX)
    facts, names_of_keys = _expert_facts(config, arch, cv, lambda k: k)
    cfg.update(facts)
    dense_key = arch_by_name(arch).dense_ffn_key
    if dense_key != "intermediate_size":  # Llama 4: intermediate_size is the experts', this the dense layers'
        cfg["intermediate_size"] = cv.int(dense_key, lo=1, hi=MAX_WIDTH)
    emb = shapes.get("token_embd.weight")
    if cfg["vocab_size"] is None:
        cfg["vocab_size"] = emb[0] if emb else 0
    for name in unmapped:  # a tensor of a layer the config does not count has no GGUF name
        layer = layer_index(name)
        if layer is not None and layer >= cfg["num_hidden_layers"]:
            raise BadInput(f"num_hidden_layers is {cfg['num_hidden_layers']} but the checkpoint has tensors of "
                           f"layer {layer} ({name})", path=path)
    keys = {k: k for k in cfg}
    keys.update(names_of_keys)
    names = names or {}
    trunk = cfg["num_hidden_layers"] - int(mtp_blocks)

    def missing(gguf_name: str) -> tuple[object, str]:
        hf = checkpoint_name(gguf_name, arch, trunk, cfg["num_hidden_layers"])
        return (path if source_path is None else source_path), (f"{hf} ({gguf_name})" if hf else gguf_name)

    _check_against(cfg, shapes, keys, arch, lambda n: path, lambda n: names.get(n, n), "num_hidden_layers",
                   "checkpoint's tensors", config=config, trunk=trunk, missing=missing)


def checkpoint_name(gguf_name: str, arch: str, trunk: int, n_blocks: int) -> str | None:
    """The checkpoint's (HF) name of a GGUF tensor the writer would make, a kept MTP block's as the checkpoint keeps
    it (Qwen's mtp.fc.weight for blk.<trunk>.nextn.eh_proj.weight); None where the name map has none."""
    hf = hf_tensor_name(gguf_name, arch, n_blocks)
    spec = arch_by_name(arch)
    if hf is None or spec is None or spec.mtp is None:
        return hf
    return spec.mtp.from_layer(hf, trunk)
