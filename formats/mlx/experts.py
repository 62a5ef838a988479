"""mlx-lm's layout of a mixture of experts: every expert of a layer stacked in one switch layer per projection.

mlx-lm 0.32 runs the routed experts of a layer as one SwitchGLU (mlx_lm/models/switch_layers.py): `gate_proj`,
`up_proj`, `down_proj`, each a [experts, out, in] weight, quantized as a whole (QuantizedSwitchLinear: uint32
words [experts, out, in*bits/32], scales and biases [experts, out, in/group]). A model's `sanitize` stacks Hugging
Face's per-expert tensors into it at load, and mlx_lm.convert saves the model after that, so its folders hold
`<block>.switch_mlp.<proj>.{weight,scales,biases}` stacked and quantized after stacking. Several sanitizes stack
only the experts' float `weight` (Qwen3-MoE, Qwen3-Next, Qwen3.5-MoE, ERNIE 4.5, MiniMax-M2): per-expert
quantized tensors are refused there ("Received N parameters not in model: ...experts.E.up_proj.scales"). So the
writer writes the stacked layout for every architecture of `LAYOUTS` (the name mlx-lm's model file uses after
sanitize), and the reader splits a stacked switch layer back into Hugging Face's per-expert tensors.

Streaming: the experts of a stack arrive one at a time (interleaved with the layer's other stacks, possibly across
shards); each goes to its slot of a temporary file (`StackSpill`) and the stacked tensor is read back once its last
expert arrived, so no more than one stacked output tensor is held at once.
"""

from __future__ import annotations

import os
import re
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

__all__ = ["ExpertLayout", "Presanitized", "LAYOUTS", "layout_for", "StackSpill"]


@dataclass(frozen=True)
class Presanitized:
    """What else an architecture's sanitize changes, when it changes it only while it stacks per-expert weights:
    mlx-lm's Qwen3-Next sanitize returns at once when no `experts.0.up_proj.weight` is found (a folder it saved
    itself), so a folder with stacked experts must hold the rest in sanitize's output form too, as mlx_lm.convert's
    does: `shifted_norms` stored as 1 + w (mlx-lm's RMSNorm multiplies by the weight, transformers' Qwen3-Next by
    1 + w), the depthwise conv1d weights [channels, kernel, 1] (transformers' [channels, 1, kernel]), and the tensors
    under `dropped` (the MTP block mlx-lm does not run) left out."""

    shifted_norms: tuple[str, ...]
    dropped: str

    def drops(self, name: str) -> bool:
        return self.dropped in name

    def _shifted(self, name: str, tensor: torch.Tensor) -> bool:
        return tensor.dim() == 1 and name.endswith(self.shifted_norms)

    @staticmethod
    def _conv(name: str) -> bool:
        return "conv1d.weight" in name

    def to_mlx(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """The tensor as mlx-lm's sanitize leaves it (1 + w rounds once in the tensor's dtype)."""
        if self._shifted(name, tensor):
            return tensor + 1.0
        if self._conv(name) and tensor.dim() == 3 and tensor.shape[-1] != 1:
            return tensor.movedim(2, 1).contiguous()
        return tensor

    def from_mlx(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """Transformers' tensor from sanitize's form: a shifted norm as float32 (stored - 1, which is w where
        1 + w was exact), the conv1d weight's axes back."""
        if self._shifted(name, tensor):
            return tensor.to(torch.float32) - 1.0
        if self._conv(name) and tensor.dim() == 3 and tensor.shape[-1] == 1 and tensor.shape[1] != 1:
            return tensor.movedim(2, 1).contiguous()
        return tensor

    def hf_shape(self, name: str, shape: tuple[int, ...]) -> tuple[int, ...]:
        if self._conv(name) and len(shape) == 3 and shape[-1] == 1 and shape[1] != 1:
            return (shape[0], shape[2], shape[1])
        return tuple(shape)


@dataclass(frozen=True)
class ExpertLayout:
    """One architecture's experts: `block` the module holding them (`mlp`, Mixtral's `block_sparse_moe`),
    `projections` Hugging Face's per-expert projection name -> mlx-lm's switch layer name, `count_keys` the config
    keys of the number of routed experts, the first present wins (transformers 5 writes Qwen3-MoE's as
    `num_local_experts`, earlier versions and mlx-lm `num_experts`)."""

    block: str
    projections: dict[str, str]
    count_keys: tuple[str, ...]
    sanitized: Presanitized | None = None  # what else the writer stores in sanitize's form, with the experts
    # a routing tensor mlx-lm's sanitize drops (its router then ignores it): written all the same, warned about
    # when non-zero, since mlx-lm then picks other experts than transformers
    ignored_routing: str | None = None

    def __post_init__(self):
        names = "|".join(map(re.escape, self.projections))
        stacked = "|".join(map(re.escape, self.projections.values()))
        object.__setattr__(self, "_expert", re.compile(
            rf"^(?P<head>(?:[\w.]+\.)?layers\.\d+\.{re.escape(self.block)})\.experts\.(?P<e>\d+)\.(?P<proj>{names})"
            rf"(?P<part>\.\w+)$"))
        object.__setattr__(self, "_stacked", re.compile(
            rf"^(?P<head>(?:[\w.]+\.)?layers\.\d+\.{re.escape(self.block)})\.switch_mlp\.(?P<proj>{stacked})"
            rf"(?P<part>\.\w+)?$"))

    def stacked_slot(self, name: str) -> tuple[str, int] | None:
        """A per-expert tensor's stacked name and its index there (`...experts.3.w1.weight` ->
        (`...switch_mlp.gate_proj.weight`, 3)), or None for any other tensor."""
        m = self._expert.match(name)
        if m is None:
            return None
        return f"{m['head']}.switch_mlp.{self.projections[m['proj']]}{m['part']}", int(m["e"])

    def expert_name(self, stacked: str, expert: int) -> str | None:
        """The per-expert name of expert `expert` of a stacked tensor or module prefix, or None when `stacked` is
        not a switch layer of this layout."""
        m = self._stacked.match(stacked)
        if m is None:
            return None
        proj = next(k for k, v in self.projections.items() if v == m["proj"])
        return f"{m['head']}.experts.{expert}.{proj}{m['part'] or ''}"

    @property
    def count_key(self) -> str:
        return self.count_keys[0]

    def expert_count(self, config: dict) -> int | None:
        value = next((config[k] for k in self.count_keys if k in config), None)
        return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


_GLU = {"gate_proj": "gate_proj", "up_proj": "up_proj", "down_proj": "down_proj"}
# Mixtral's (and MiniMax-M2's) w1 / w2 / w3 are gate / down / up (mlx_lm/models/mixtral.py, minimax.py sanitize)
_W123 = {"w1": "gate_proj", "w2": "down_proj", "w3": "up_proj"}

# transformers' model_type -> its experts in mlx-lm (each checked against the sanitize of mlx_lm/models/<type>.py,
# or the file MODEL_REMAPPING names: minimax_m2 -> minimax.py; qwen3_5_moe_text runs as qwen3_5_moe's text model)
LAYOUTS: dict[str, ExpertLayout] = {
    "qwen3_moe": ExpertLayout("mlp", _GLU, ("num_experts", "num_local_experts")),
    # mlx_lm/models/qwen3_next.py sanitize: the norms it adds 1 to, the MTP block it drops
    "qwen3_next": ExpertLayout("mlp", _GLU, ("num_experts",), Presanitized(
        (".input_layernorm.weight", ".post_attention_layernorm.weight", "model.norm.weight", ".q_norm.weight",
         ".k_norm.weight"), "mtp.")),
    "qwen3_5_moe_text": ExpertLayout("mlp", _GLU, ("num_experts", "num_local_experts")),
    # mlx_lm/models/ernie4_5_moe.py drops `e_score_correction_bias` and routes by the gate's softmax alone, where
    # transformers picks the top k of softmax + bias
    "ernie4_5_moe": ExpertLayout("mlp", _GLU, ("moe_num_experts",), ignored_routing="e_score_correction_bias"),
    "glm4_moe": ExpertLayout("mlp", _GLU, ("n_routed_experts",)),
    "deepseek_v2": ExpertLayout("mlp", _GLU, ("n_routed_experts",)),
    "deepseek_v3": ExpertLayout("mlp", _GLU, ("n_routed_experts",)),
    "glm_moe_dsa": ExpertLayout("mlp", _GLU, ("n_routed_experts",)),
    "mixtral": ExpertLayout("block_sparse_moe", _W123, ("num_local_experts",)),
    "minimax_m2": ExpertLayout("block_sparse_moe", _W123, ("num_local_experts",)),
}


def layout_for(config: dict | None) -> ExpertLayout | None:
    """The expert layout of a transformers config (None: the architecture's experts, if any, are written as
    they come)."""
    return LAYOUTS.get((config or {}).get("model_type"))


class StackSpill:
    """One stacked tensor being filled: an anonymous temporary file (gone when closed, or when the process ends)
    with one slot per expert, written as the experts arrive in any order, read back whole when complete."""

    def __init__(self, folder: Path, count: int, first: torch.Tensor):
        self.file = tempfile.TemporaryFile(dir=folder, prefix=".qconvert-mlx-experts-")
        self.count, self.shape, self.dtype = count, tuple(first.shape), first.dtype
        self.slot_bytes = first.numel() * first.element_size()
        self.filled: set[int] = set()

    def put(self, index: int, tensor: torch.Tensor) -> None:
        if tuple(tensor.shape) != self.shape or tensor.dtype != self.dtype:  # the plan gave every expert one form
            raise AssertionError(f"expert {index} is {tensor.dtype} {list(tensor.shape)}, not {self.dtype} "
                                 f"{list(self.shape)}")
        data = tensor.contiguous().view(-1).view(torch.uint8).numpy()
        os.pwrite(self.file.fileno(), data.data, index * self.slot_bytes)
        self.filled.add(index)

    @property
    def complete(self) -> bool:
        return len(self.filled) == self.count

    def stacked(self) -> torch.Tensor:
        """The [experts, *shape] tensor, read back from the file (which is closed)."""
        self.file.seek(0)
        raw = bytearray(self.file.read())
        self.file.close()
        if len(raw) != self.count * self.slot_bytes:
            raise AssertionError(f"the expert spill holds {len(raw)} bytes, not {self.count * self.slot_bytes}")
        return torch.frombuffer(raw, dtype=torch.uint8).view(self.dtype).view(self.count, *self.shape)

    def close(self) -> None:
        self.file.close()
