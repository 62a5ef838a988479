"""Architecture and tensor names between Hugging Face llama-family checkpoints and GGUF.

Pure functions over names, config dicts and index vectors; no model framework.

* :func:`gguf_arch` picks the llama.cpp architecture string from a config.json dict.
* :func:`gguf_tensor_name` / :func:`hf_tensor_name` map tensor names both ways (gguf's
  ``TensorNameMap`` for the forward direction, its inverse restricted to the HF llama/qwen naming).
* :func:`qk_row_permutation` gives the row permutation llama.cpp's converter applies to the
  ``q_proj`` / ``k_proj`` weights (and biases) of arch ``llama`` (HF "rotate_half" rope -> ggml
  "NORM" rope), as an index vector so that callers can permute rows of quantized codes and scales
  exactly: ``permuted = rows[perm]``. :func:`inverse_permutation` undoes it.
"""

from __future__ import annotations

import re
from functools import lru_cache
from typing import Mapping, Sequence

import gguf
import torch

from ...converters.errors import BadInput, QConvertError
from .archs import arch_by_name, arch_for_config, expert_name, registered, supported_classes
from .archs.mtp import nextn_gguf_name, nextn_hf_module
from .hparams import head_dim

__all__ = [
    "supported_archs",
    "gguf_arch",
    "gguf_tensor_name",
    "hf_tensor_name",
    "layer_index",
    "qk_row_permutation",
    "inverse_permutation",
    "expert_of",
    "expert_member",
    "is_expert_stack",
    "is_own_name",
]

def supported_archs() -> tuple[str, ...]:
    """The GGUF architectures qconvert writes and reads (archs: the registered entries)."""
    return registered()


def _supported_list() -> str:
    return ", ".join(supported_classes())


def gguf_arch(config: Mapping, path: object | None = None) -> str:
    """The llama.cpp architecture string ("llama", "qwen2moe", "gemma3", ...) for an HF config.json dict.

    ``architectures[0]`` decides; ``model_type`` is the fallback. Anything else raises
    :class:`QConvertError` naming the architecture and the supported ones.
    """
    arch, what = arch_for_config(config)
    if arch is None:
        raise QConvertError(f"{what} is not supported for GGUF output; supported: {_supported_list()}", path=path)
    return arch.name


def _arch_enum(arch: str) -> gguf.MODEL_ARCH:
    spec = arch_by_name(arch)
    if spec is None:
        raise QConvertError(f"GGUF architecture {arch!r} is not supported; supported: {', '.join(supported_archs())}")
    return spec.enum


# tensor types gguf maps but llama.cpp does not load for these arches (an extra tensor makes the load
# fail): the rotary inv_freq buffer that old checkpoints saved.
_NOT_LOADED = {gguf.MODEL_TENSOR.ATTN_ROT_EMBD}


def _as_module_name(hf_name: str) -> str:
    """An HF tensor name in the form the name maps are looked up with: a bare parameter that llama.cpp's
    converters name as a module's weight or bias is given that suffix (gguf-py's maps, and the tables of
    `ArchNameTable`, name modules)."""
    # the router's score-correction bias (DeepSeek-V3) is a parameter named ..._bias, mapped as a .bias
    hf_name = re.sub(r"\.e_score_correction_bias$", ".e_score_correction.bias", hf_name)
    # gpt-oss's attention sinks are a bare parameter (self_attn.sinks); llama.cpp names the tensor
    # attn_sinks.weight (its converter appends .weight: conversion/gpt_oss.py filter_tensors)
    hf_name = re.sub(r"\.self_attn\.sinks$", ".self_attn.sinks.weight", hf_name)
    # Gated DeltaNet's step bias (Qwen3.5 / Qwen3-Next linear_attn.dt_bias) is llama.cpp's ssm_dt.bias (its
    # converter renames it dt_proj.bias: conversion/qwen.py Qwen3NextModel.modify_tensors)
    return re.sub(r"\.linear_attn\.dt_bias$", ".linear_attn.dt_proj.bias", hf_name)


def _as_parameter_name(hf_name: str) -> str:
    """`_as_module_name` undone: the HF name of the parameter a looked-up name stands for."""
    hf_name = re.sub(r"\.e_score_correction\.bias$", ".e_score_correction_bias", hf_name)
    hf_name = re.sub(r"\.self_attn\.sinks\.weight$", ".self_attn.sinks", hf_name)
    return re.sub(r"\.linear_attn\.dt_proj\.bias$", ".linear_attn.dt_bias", hf_name)


class ArchNameTable:
    """The name map of an architecture the installed gguf-py (0.19) does not name, from the entry's own table
    (GgufArch.name_table): it answers the two lookups names.py asks of gguf-py's TensorNameMap
    (get_type_and_name, get_name) for block 0, and gives the table's inverse for reading back.

    A new architecture needs a table when `gguf.MODEL_ARCH_NAMES` lacks it (DeepSeek-V4, Kimi-K3): the names
    then come from the gguf-py vendored in llama.cpp's sources (constants.py TENSOR_NAMES / MODEL_TENSORS,
    tensor_mapping.py), which the package never imports at run time, so the entry mirrors them and its test
    checks the mirror against that gguf-py. Drop the table when the installed gguf names the architecture.

    Table keys are HF names of block 0 (`model.layers.0.` + the module; `model.`/`lm_head` outside the layers):
    a module (`...self_attn.q_a_proj` -> `blk.0.attn_q_a`: the tensor's .weight / .bias follows, as in
    gguf-py's maps) or a whole tensor name (`model.hc_head.hc_fn` -> `output_hc_fn.weight`: a bare parameter
    the converter names as a weight). A tensor kind is gguf 0.19's MODEL_TENSOR where it has the GGUF name
    (the expert stacks: names.py recognises them by it), else the name in capitals."""

    def __init__(self, table: Mapping[str, str]) -> None:
        self.mapping: dict[str, tuple[object, str]] = {
            _as_module_name(hf): (_INSTALLED_KINDS.get(_kind_key(name), name.upper()), name)
            for hf, name in table.items()}
        self.inverse: dict[str, str] = {name: hf for hf, (_, name) in self.mapping.items()}

    def get_type_and_name(self, key: str, try_suffixes: Sequence[str] = ()) -> tuple[object, str] | None:
        if key in self.mapping:
            return self.mapping[key]
        for suffix in try_suffixes:
            if key.endswith(suffix) and key[: -len(suffix)] in self.mapping:
                kind, name = self.mapping[key[: -len(suffix)]]
                return kind, name + suffix
        return None

    def get_name(self, key: str, try_suffixes: Sequence[str] = ()) -> str | None:
        found = self.get_type_and_name(key, try_suffixes)
        return None if found is None else found[1]


# gguf 0.19's tensor kinds by name (`blk.{bid}.ffn_gate_exps` -> FFN_GATE_EXP), for the tables' kinds
_INSTALLED_KINDS = {name: kind for kind, name in gguf.TENSOR_NAMES.items()}


def _kind_key(gguf_name: str) -> str:
    """A table's GGUF name as gguf-py's TENSOR_NAMES spells it (block 0 -> {bid}, no .weight / .bias)."""
    base = re.sub(r"\.(weight|bias)$", "", gguf_name)
    return "blk.{bid}." + base[len("blk.0."):] if base.startswith("blk.0.") else base


@lru_cache(maxsize=8)
def _name_map(arch: str) -> gguf.TensorNameMap | ArchNameTable:
    """gguf's name map for one block: names of block i are those of block 0 with the index swapped,
    so mapping a name costs the same whatever num_hidden_layers says (gguf's map of n blocks holds
    every name of every block: a config's 2**31 layers would build it for hours). An architecture gguf 0.19
    does not name maps by its entry's own table (ArchNameTable)."""
    spec = arch_by_name(arch)
    if spec is not None and spec.name_table is not None:
        return ArchNameTable(spec.name_table)
    return gguf.get_tensor_name_map(_arch_enum(arch), 1)


# the first all-digit component of a dotted name is its layer (model.layers.3., layers.3., blk.3.)
_LAYER_INDEX = re.compile(r"^((?:[^.]+\.)+?)(0|[1-9][0-9]*)\.")


def _split_index(name: str) -> tuple[str, int | None]:
    """(name with its layer index set to 0, the index), or (name, None) for a name outside the layers."""
    m = _LAYER_INDEX.match(name)
    if m is None:
        return name, None
    return m.group(1) + "0." + name[m.end():], int(m.group(2))


def layer_index(name: str) -> int | None:
    """The layer a tensor name belongs to (``model.layers.3.mlp.up_proj.qweight`` -> 3), None outside the layers."""
    return _split_index(name)[1]


def gguf_tensor_name(hf_name: str, arch: str, n_layers: int) -> str | None:
    """GGUF name of an HF tensor (``model.layers.3.self_attn.q_proj.weight`` ->
    ``blk.3.attn_q.weight``); ``None`` when the name has no GGUF counterpart for ``arch``
    (e.g. ``rotary_emb.inv_freq``, GPTQ ``qweight``/``scales``, a layer >= ``n_layers``).
    One expert of a MoE layer names the stacked tensor it goes into
    (``model.layers.3.mlp.experts.5.up_proj.weight`` -> ``blk.3.ffn_up_exps.weight``; see
    :func:`expert_of`)."""
    member = expert_name(hf_name)
    if member is not None:
        hf_name = member[0]
    hf_name = _as_module_name(hf_name)
    base, layer = _split_index(hf_name)
    if layer is not None and layer >= int(n_layers):
        return None
    mtp = arch_by_name(arch).mtp if arch_by_name(arch) else None
    if mtp is not None and mtp.kept and nextn_gguf_name(hf_name) is not None:  # an MTP block's own tensor (mtp.py)
        return nextn_gguf_name(hf_name)
    own = _own_names(arch)[0].get(base)  # the architecture's own names (archs: tensor_names)
    if own is not None:
        return own if layer is None else f"blk.{layer}." + own[len("blk.0."):]
    found = _name_map(arch).get_type_and_name(base, try_suffixes=(".weight", ".bias"))
    if found is None or found[0] in _NOT_LOADED:
        return None
    if member is not None and found[0] not in _EXPERT_TENSORS:
        return None  # an indexed expert outside the stacked tensors
    # (a stack name without an index is an already-fused 3-D tensor of every expert: it maps as it is)
    name = found[1]
    if layer is None:
        return None if name.startswith("blk.") else name
    return f"blk.{layer}." + name[len("blk.0."):] if name.startswith("blk.0.") else None


@lru_cache(maxsize=16)
def _own_names(arch: str) -> tuple[dict[str, str], dict[str, str]]:
    """(HF name of block 0 -> GGUF name, the inverse) of the architecture's own `tensor_names` (a name that
    starts with `model.` is the model's, outside the layers)."""
    def hf_of(hf: str) -> str:
        return hf if hf.startswith("model.") else f"model.layers.0.{hf}"

    def gguf_of(hf: str, g: str) -> str:
        return g if hf.startswith("model.") else f"blk.0.{g}"

    pairs = arch_by_name(arch).tensor_names
    return ({hf_of(hf): gguf_of(hf, g) for hf, g in pairs}, {gguf_of(hf, g): hf_of(hf) for hf, g in pairs})


def is_own_name(gguf_name: str, arch: str) -> bool:
    """Whether a GGUF tensor is one the architecture names itself (`tensor_names`): Gemma 4's `.scale` tensors
    are weights of the model, not the NVFP4 global scales that name form otherwise holds, and its expert
    stacks stay fused."""
    return _split_index(gguf_name)[0] in _own_names(arch)[1]


# the GGUF tensors that stack one HF tensor per expert (experts outermost: ggml ne[2])
_EXPERT_TENSORS = {gguf.MODEL_TENSOR.FFN_GATE_EXP, gguf.MODEL_TENSOR.FFN_UP_EXP, gguf.MODEL_TENSOR.FFN_DOWN_EXP}


def expert_of(hf_name: str) -> int | None:
    """The expert index of one expert's tensor (``...experts.5.up_proj.weight`` -> 5), else None."""
    member = expert_name(hf_name)
    return None if member is None else member[1]


def expert_member(stacked_hf_name: str, index: int) -> str:
    """The HF name of expert ``index`` of a stacked tensor's HF name
    (``model.layers.3.mlp.experts.up_proj.weight``, 5 -> ``model.layers.3.mlp.experts.5.up_proj.weight``)."""
    head, sep, tail = stacked_hf_name.rpartition(".experts.")
    if not sep:
        raise ValueError(f"{stacked_hf_name} is not a stacked expert tensor name")
    return f"{head}.experts.{index}.{tail}"


# the model-wide HF modules every architecture shares; the per-block ones are each entry's hf_block
_HF_GLOBAL = ("model.embed_tokens", "model.norm", "lm_head")


@lru_cache(maxsize=16)
def _inverse_map(arch: str) -> dict[str, str]:
    """GGUF base name -> HF module name, for the HF naming of the architecture's class (block 0 stands
    for every block)."""
    tmap = _name_map(arch)
    if isinstance(tmap, ArchNameTable):  # the entry's own table: its inverse, whole tensor names included
        return dict(tmap.inverse)
    inv: dict[str, str] = {}
    block = arch_by_name(arch).hf_block
    for hf in list(_HF_GLOBAL) + [f"model.layers.0.{m}" for m in block]:
        g = tmap.get_name(hf)
        if g is not None:
            inv.setdefault(g, hf)
    return inv


def hf_tensor_name(gguf_name: str, arch: str, n_layers: int) -> str | None:
    """HF tensor name of a GGUF tensor (``blk.3.attn_q.weight`` ->
    ``model.layers.3.self_attn.q_proj.weight``); ``None`` when it has no HF counterpart (e.g.
    ``rope_freqs.weight``, a block >= ``n_layers``). A stacked expert tensor gives the stack's HF name
    (``blk.3.ffn_up_exps.weight`` -> ``model.layers.3.mlp.experts.up_proj.weight``): each expert's own
    name is :func:`expert_member`."""
    base, layer = _split_index(gguf_name)
    if layer is not None and layer >= int(n_layers):
        return None
    own = _own_names(arch)[1].get(base)
    if own is not None:
        return own if layer is None else f"model.layers.{layer}." + own[len("model.layers.0."):]
    mtp = arch_by_name(arch).mtp if arch_by_name(arch) else None
    if mtp is not None and mtp.kept and nextn_hf_module(gguf_name) is not None:  # an MTP block's own tensor
        return nextn_hf_module(gguf_name)
    inv = _inverse_map(arch)
    hf = inv.get(base)  # a bare GGUF name (ssm_a), or a whole tensor name of an ArchNameTable
    if hf is None:
        for suffix in (".weight", ".bias"):
            if base.endswith(suffix):
                module = inv.get(base[: -len(suffix)])
                hf = None if module is None else module + suffix
                break
    if hf is None:
        return None
    hf = _as_parameter_name(hf)
    if layer is None or not base.startswith("blk.0."):
        return None if layer is not None or hf.startswith("model.layers.") else hf
    return f"model.layers.{layer}." + hf[len("model.layers.0."):]


def is_expert_stack(gguf_name: str) -> bool:
    """Whether a GGUF tensor stacks one tensor per expert (``blk.N.ffn_{gate,up,down}_exps.weight``)."""
    return bool(re.match(r"^blk\.\d+\.ffn_(gate|up|down)_exps\.weight$", gguf_name))


_QK_RE = re.compile(r"(?:^|\.)self_attn\.([qk])_proj(?:\.|$)")


def qk_row_permutation(hf_name: str, config: Mapping, arch: str) -> torch.Tensor | None:
    """Row permutation of ``q_proj`` / ``k_proj`` (weights, biases, or any per-output-row tensor of
    those modules, e.g. quantized codes or scales indexed by output feature) for the architectures whose
    entry sets ``permute_qk`` (llama and the families llama.cpp's converter runs as LlamaModel).

    Returns a LongTensor ``perm`` over the output rows such that ``permuted = rows[perm]`` equals
    llama.cpp's converter ``w.reshape(n, 2, rows//n//2, *rest).swapaxes(1, 2).reshape(w.shape)``
    with ``n = num_attention_heads`` for q and ``num_key_value_heads`` for k. ``None`` for any other
    tensor and for arches that use NEOX rope (qwen2, qwen3).
    """
    spec = arch_by_name(arch)
    if spec is None or not spec.permute_qk:  # NEOX-rope families keep HF's rows
        return None
    m = _QK_RE.search(hf_name)
    if m is None:
        return None
    try:
        n_head = int(config["num_attention_heads"])
    except KeyError:
        raise BadInput("config.json lacks num_attention_heads", tensor=hf_name) from None
    n = n_head if m.group(1) == "q" else int(config.get("num_key_value_heads") or n_head)
    hd = head_dim(config)
    if hd % 2:
        raise BadInput(f"head_dim {hd} is odd; the rope row permutation needs an even head size",
                       tensor=hf_name)
    return torch.arange(n * hd, dtype=torch.long).reshape(n, 2, hd // 2).transpose(1, 2).reshape(-1)


def inverse_permutation(perm: torch.Tensor) -> torch.Tensor:
    """``inv`` such that ``rows[perm][inv] == rows`` (and ``perm[inv] == arange``)."""
    perm = torch.as_tensor(perm, dtype=torch.long)
    inv = torch.empty_like(perm)
    inv[perm] = torch.arange(perm.numel(), dtype=torch.long)
    return inv
