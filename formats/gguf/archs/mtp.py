"""Multi-token-prediction (MTP, "NextN") blocks: the draft head some checkpoints ship beside the trunk, and the one
description (`MtpBlock`, GgufArch.mtp) of what llama.cpp's converter does with it for an architecture.

Why one mechanism: the checkpoints keep the block in three places (DeepSeek-V3 and GLM-4.5 / GLM-5 as layers after
the trunk, `model.layers.<num_hidden_layers + i>.*`; Qwen3.5 / Qwen3-Next beside the model, `mtp.*`; ERNIE 4.5 as
`model.mtp_*`), and the converter either skips it always (DeepSeek-V3, ERNIE) or keeps it by default and drops it
with `--no-mtp` (GLM-4.5, GLM-5, Qwen3.5, Qwen3-Next). Kept, it becomes the blocks after the trunk: block_count
counts them, `{arch}.nextn_predict_layers` says how many, the decoder layer is named as a trunk layer and the
block's own tensors `blk.N.nextn.*` (eh_proj, enorm, hnorm, shared_head_norm, ...). llama.cpp runs
block_count - nextn_predict_layers layers and loads the MTP ones only for its MTP draft context, so the logits are
those of the trunk either way.

An entry says where its block is (`is_mtp`), how its names become trunk-layer names and back (`as_layer` /
`from_layer`), how many blocks the config declares (`declared`) and whether the converter keeps them (`kept`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Callable, Mapping

import gguf

__all__ = ["MtpBlock", "layers_after_trunk", "qwen_mtp", "skipped", "NEXTN_MODULES", "nextn_gguf_name",
           "nextn_hf_module"]

# the block's own modules as the trunk-layer names llama.cpp's converter maps (gguf-py's TensorNameMap:
# model.layers.{bid}.eh_proj -> blk.{bid}.nextn.eh_proj, ...), by their GGUF tensor. gguf 0.19 (PyPI) lists
# them for glm4moe / glm-dsa but not for qwen35 / qwen3next, whose converter (the vendored gguf-py) has them:
# the names are the same for every architecture, so they are taken from here
NEXTN_MODULES = {
    gguf.MODEL_TENSOR.NEXTN_EH_PROJ: "eh_proj",
    gguf.MODEL_TENSOR.NEXTN_EMBED_TOKENS: "embed_tokens",
    gguf.MODEL_TENSOR.NEXTN_ENORM: "enorm",
    gguf.MODEL_TENSOR.NEXTN_HNORM: "hnorm",
    gguf.MODEL_TENSOR.NEXTN_SHARED_HEAD_HEAD: "shared_head.head",
    gguf.MODEL_TENSOR.NEXTN_SHARED_HEAD_NORM: "shared_head.norm",
}
# "nextn.eh_proj" -> "eh_proj", ... (the GGUF name after `blk.N.`)
_GGUF_TO_HF = {gguf.TENSOR_NAMES[t].split(".", 2)[2]: m for t, m in NEXTN_MODULES.items()}
_HF_TO_GGUF = {m: g for g, m in _GGUF_TO_HF.items()}
_LAYER = re.compile(r"^model\.layers\.(0|[1-9][0-9]*)\.(.+)$")
_BLOCK = re.compile(r"^blk\.(0|[1-9][0-9]*)\.(.+)$")


def nextn_gguf_name(hf_name: str) -> str | None:
    """`model.layers.N.eh_proj.weight` -> `blk.N.nextn.eh_proj.weight` (one of the block's own tensors), else None."""
    m = _LAYER.match(hf_name)
    if m is None:
        return None
    module, dot, suffix = m[2].rpartition(".")
    if not dot or suffix not in ("weight", "bias") or module not in _HF_TO_GGUF:
        return None
    return f"blk.{m[1]}.{_HF_TO_GGUF[module]}.{suffix}"


def nextn_hf_module(gguf_name: str) -> str | None:
    """The inverse of nextn_gguf_name: `blk.N.nextn.eh_proj.weight` -> `model.layers.N.eh_proj.weight`, else None."""
    m = _BLOCK.match(gguf_name)
    if m is None:
        return None
    base, dot, suffix = m[2].rpartition(".")
    if not dot or base not in _GGUF_TO_HF:
        return None
    return f"model.layers.{m[1]}.{_GGUF_TO_HF[base]}.{suffix}"


def _identity(name: str, n_layers: int) -> str:
    return name


@dataclass(frozen=True)
class MtpBlock:
    # (HF name, num_hidden_layers) -> whether the tensor belongs to the MTP block
    is_mtp: Callable[[str, int], bool] = field(repr=False)
    # llama.cpp's converter keeps the block by default (`--no-mtp` drops it); False: it skips it always
    kept: bool
    # why a dropped block is dropped (the plan's note)
    dropped_because: str
    # (HF name, num_hidden_layers) -> the name as a trunk layer `model.layers.<n + i>.*` (the block's own modules
    # as NEXTN_MODULES name them), and the inverse for gguf->hf
    as_layer: Callable[[str, int], str] = field(default=_identity, repr=False)
    from_layer: Callable[[str, int], str] = field(default=_identity, repr=False)
    # the MTP blocks config.json declares (None: none declared, and no nextn_predict_layers key is written)
    declared: Callable[[Mapping], int | None] = field(default=lambda config: None, repr=False)
    # without a declared count, the count is the blocks the tensors hold (Qwen3-Next's configs state none)
    counted_from_tensors: bool = False
    # the config.json key gguf->hf writes the count back to (None: the source's configs carry none)
    config_key: str | None = None
    # the block's own GGUF tensors (within blk.N.) a kept block must hold, beside the tensors of a trunk layer of
    # its kind: what llama.cpp's loaders create without TENSOR_NOT_REQUIRED when the MTP context loads the block
    # (src/models/{qwen35,qwen35moe,qwen3next,glm4-moe,glm-dsa}.cpp: eh_proj, enorm, hnorm). Without them the file
    # loads for plain decoding but the draft context refuses it, so a checkpoint missing one is refused before
    # anything is written (checks.py), whether or not transformers is installed to compare the class
    required: tuple[str, ...] = ("nextn.eh_proj", "nextn.enorm", "nextn.hnorm")

    def count(self, config: Mapping, found: int) -> int | None:
        """The blocks block_count adds and nextn_predict_layers states when the block is kept (`found`: the MTP
        blocks among the tensors), or None when there is nothing to state."""
        n = self.declared(config)
        if n is None and self.counted_from_tensors:
            n = found or None
        return n


def _layer_of(name: str) -> int | None:
    m = _LAYER.match(name)
    return None if m is None else int(m[1])


def layers_after_trunk(kept: bool, declared: Callable[[Mapping], int | None] = lambda config: None,
                       dropped_because: str = "", config_key: str | None = None) -> MtpBlock:
    """DeepSeek-V3 / GLM: the block is layer num_hidden_layers + i of model.layers."""
    return MtpBlock(is_mtp=lambda name, n: (_layer_of(name) or 0) >= n, kept=kept, declared=declared,
                    dropped_because=dropped_because, config_key=config_key)


# Qwen3.5 / Qwen3-Next's block beside the model: mtp.fc over [embedding, hidden], its two input norms and final norm,
# mtp.layers.<i>.* decoder layers; llama.cpp's converter names them as layer num_hidden_layers + i (_QwenMtpMixin)
_QWEN_OWN = {"fc": "eh_proj", "pre_fc_norm_embedding": "enorm", "pre_fc_norm_hidden": "hnorm",
             "norm": "shared_head.norm"}
_QWEN_BACK = {v: k for k, v in _QWEN_OWN.items()}


def _qwen_as_layer(name: str, n: int) -> str:
    tail = name.removeprefix("model.").removeprefix("mtp.")
    parts = tail.split(".", 2)
    if parts[0] == "layers" and len(parts) == 3 and parts[1].isdecimal():
        return f"model.layers.{n + int(parts[1])}.{parts[2]}"
    module, _, suffix = tail.rpartition(".")
    if module in _QWEN_OWN:
        return f"model.layers.{n}.{_QWEN_OWN[module]}.{suffix}"
    return name  # not a tensor of the block llama.cpp maps: left for the name map to refuse


def _qwen_from_layer(name: str, n: int) -> str:
    m = _LAYER.match(name)
    if m is None or int(m[1]) < n:
        return name
    module, _, suffix = m[2].rpartition(".")
    if module in _QWEN_BACK:
        return f"mtp.{_QWEN_BACK[module]}.{suffix}"
    return f"mtp.layers.{int(m[1]) - n}.{m[2]}"


def qwen_mtp(config_key: str | None) -> MtpBlock:
    """Qwen3.5 (`config_key` mtp_num_hidden_layers, which its configs state) and Qwen3-Next (None: the converter
    counts the block's layers in the tensors)."""
    def declared(config: Mapping) -> int | None:
        n = config.get(config_key) if config_key else None
        return int(n) if n else None

    return MtpBlock(is_mtp=lambda name, n: name.startswith(("mtp.", "model.mtp.")) or (_layer_of(name) or 0) >= n,
                    kept=True, dropped_because="", as_layer=_qwen_as_layer, from_layer=_qwen_from_layer,
                    declared=declared, counted_from_tensors=config_key is None, config_key=config_key,
                    required=_QWEN_REQUIRED)


# Qwen's block also needs its final norm (mtp.norm, shared_head_norm): llama.cpp's loader would fall back on the
# trunk's output_norm for a file without it, but every Qwen3.5 / Qwen3-Next block holds its own, so a block
# without it is damaged, not a variant, and drafting with the trunk's norm would be silently wrong (transformers'
# side of the check, class_tensors._compare_mtp_block, refuses it as well)
_QWEN_REQUIRED = ("nextn.eh_proj", "nextn.enorm", "nextn.hnorm", "nextn.shared_head_norm")


def skipped(pattern: re.Pattern, why: str) -> MtpBlock:
    """A block llama.cpp's converter skips outright (ERNIE 4.5's model.mtp_*), matched by its names."""
    return MtpBlock(is_mtp=lambda name, n: bool(pattern.search(name)), kept=False, dropped_because=why)
