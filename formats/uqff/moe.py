"""Mixture-of-experts layers in UQFF, as mistral.rs 0.9.5 writes and loads them (Mixtral, Qwen3-MoE).

Facts (mistral.rs' own `write_uqff` output for tiny MixtralForCausalLM / Qwen3MoeForCausalLM models, read
back here; and its source, mistralrs-core/src/moe/experts/ and mistralrs-quant/src/uqff/):

* The experts of one sparse block are three UQFF layers, one per projection, each holding all experts
  stacked: `<block>.experts.gate_proj`, `.up_proj`, `.down_proj` (mistralrs-quant QuantizedExpertKeys),
  weight shape `[E, out, in]` (gate/up `[E, moe_intermediate, hidden]`, down `[E, hidden,
  moe_intermediate]`). Expert e's slab is its own 2-D layer as a 2-D UQFF layer would store it: for GGUF
  blocks the per-expert block bytes concatenated in expert order (the stacked bytes equal each expert
  quantized alone, then joined); for AFQ the u32 words, scales and biases stacked on a new first dim.
* The per-expert checkpoint names mistral.rs knows are `experts.E.{gate,up,down}_proj` and Mixtral's
  `experts.E.{w1,w3,w2}`, i.e. w1 = gate, w3 = up, w2 = down (ExpertProjNames::KNOWN; the UQFF of a
  Mixtral stores w1's bytes under `gate_proj`, checked byte for byte).
* Mixtral's sparse block is `block_sparse_moe` (mistral.rs reads `model.layers.L.block_sparse_moe`, also for
  a checkpoint that transformers or gptqmodel saved under `mlp`), and its router `block_sparse_moe.gate` is
  a mistralrs-quant linear: mistral.rs quantizes it and stores it in the UQFF like any linear. Qwen3-MoE's
  router `mlp.gate` is a plain candle Linear: it stays dense in residual.safetensors (a UQFF entry for it
  would be ignored and the router missing).
* Which families a stack may use: mistral.rs refuses stacked HQQ, FP8 and F8Q8 layers at load ("does not
  support stacked expert gather"); GGUF blocks, AFQ and Unquant stacks load. (On a CPU, 0.9.5 runs GGUF
  stacks; its AFQ gather matmul fails there with "non-contiguous lhs", so AFQ stacks run on Metal/CUDA only.)
* mistral.rs' Qwen3-MoE config needs `num_experts` and `max_window_layers`, which transformers 5 no longer
  writes (it writes `num_local_experts`, and applies a sliding window to every layer when
  `use_sliding_window` is set).

The record stream yields one 2-D record per expert; the writer encodes each as a 2-D layer, returns its own
decoded values, and holds its encoded tensors here until every expert of the stack has arrived, so that at
most one block's experts are held at a time.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

__all__ = ["MoeModel", "ExpertSlot", "StackedTensor", "ExpertStacks", "moe_model", "expert_slot", "layer_weights",
           "expected_shape", "canonical_expert_name", "STACKABLE_FAMILIES", "mistralrs_moe_config"]

_EXPERT = re.compile(r"^(?P<block>.+)\.experts\.(?P<expert>\d+)\.(?P<proj>[A-Za-z0-9_]+)\.(?P<part>weight|bias)$")
_ROUTER = re.compile(r"^(?P<layer>model\.layers\.\d+)\.(?P<block>mlp|block_sparse_moe)\.gate\.weight$")
_SPARSE_BLOCK = re.compile(r"^(?P<layer>model\.layers\.\d+)\.(?P<block>mlp|block_sparse_moe)\.(?P<rest>(?:experts|gate)\..+)$")
# mistral.rs' per-expert projection names -> the stacked key's projection (ExpertProjNames::KNOWN)
_CANONICAL = {"gate_proj": "gate_proj", "up_proj": "up_proj", "down_proj": "down_proj",
              "w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
_MIXTRAL_NAMES = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}
_DEFAULT_NAMES = {p: p for p in ("gate_proj", "up_proj", "down_proj")}
# the families whose stacked layers mistral.rs loads (its UQFF reader refuses rank-3 HQQ / FP8 / F8Q8)
STACKABLE_FAMILIES = ("gguf", "afq", "unquant")


@dataclass(frozen=True)
class MoeModel:
    """What mistral.rs expects of one MoE architecture."""

    model_type: str
    block: str | None  # the sparse block's module name mistral.rs reads; None: as the checkpoint names it
    router_is_layer: bool  # the router is a quantizable linear stored in the UQFF (else dense, residual)
    hf_names: dict  # stacked projection -> the per-expert name transformers' save_pretrained writes
    num_experts: int | None

    def out_name(self, name: str) -> str:
        """`name` as mistral.rs' model looks it up: Mixtral's sparse block is `block_sparse_moe`."""
        if self.block is None:
            return name
        m = _SPARSE_BLOCK.match(name)
        return f"{m['layer']}.{self.block}.{m['rest']}" if m else name

    def is_router(self, name: str) -> bool:
        return bool(_ROUTER.match(name))


_MODELS = {
    "mixtral": dict(block="block_sparse_moe", router_is_layer=True, hf_names=_MIXTRAL_NAMES),
    "qwen3_moe": dict(block=None, router_is_layer=False, hf_names=_DEFAULT_NAMES),
}


def moe_model(config: dict) -> MoeModel | None:
    """The MoE facts of the model config.json describes, or None for a dense model. An MoE type other than
    Mixtral and Qwen3-MoE gets the generic rules of mistral.rs' shared experts loader: stacked experts
    under the checkpoint's own block name, the router left dense in the residual tensors (mistral.rs falls
    back to them for any layer the UQFF lacks)."""
    model_type = config.get("model_type")
    n = next((config[k] for k in ("num_local_experts", "num_experts", "n_routed_experts")
              if isinstance(config.get(k), int) and not isinstance(config.get(k), bool) and config[k] > 0), None)
    if model_type in _MODELS:
        return MoeModel(model_type, num_experts=n, **_MODELS[model_type])
    if n is None:
        return None
    return MoeModel(str(model_type), block=None, router_is_layer=False, hf_names=_DEFAULT_NAMES, num_experts=n)


@dataclass(frozen=True)
class ExpertSlot:
    """Where one per-expert record goes: expert `expert` of the stacked layer `stack`."""

    stack: str  # the stacked UQFF layer key, e.g. model.layers.0.block_sparse_moe.experts.gate_proj
    expert: int
    part: str  # "weight" or "bias"


def expert_slot(name: str, model: MoeModel | None) -> ExpertSlot | None:
    """The slot of a per-expert tensor (`...experts.E.gate_proj.weight`, Mixtral's `...experts.E.w1.weight`)."""
    if model is None:
        return None
    m = _EXPERT.match(model.out_name(name))
    if not m or m["proj"] not in _CANONICAL:
        return None
    return ExpertSlot(f"{m['block']}.experts.{_CANONICAL[m['proj']]}", int(m["expert"]), m["part"])


def layer_weights(config: dict, model: MoeModel, layer: int) -> list[str] | None:
    """The `.weight` tensors (without the suffix) layer `layer` of a Mixtral / Qwen3-MoE has, named as
    transformers saves them; None for other MoE types or when config.json does not give the expert count.
    A Qwen3-MoE layer is sparse unless listed in `mlp_only_layers` or off the `decoder_sparse_step` (the rule
    transformers and mistral.rs' qwen3_moe.rs share); a Mixtral layer always is."""
    if model.model_type not in _MODELS or not model.num_experts:
        return None
    attn = [f"self_attn.{p}" for p in ("q_proj", "k_proj", "v_proj", "o_proj")]
    names = ["input_layernorm", "post_attention_layernorm", *attn]
    if model.model_type == "mixtral":
        block, sparse = "block_sparse_moe", True
    else:
        names += ["self_attn.q_norm", "self_attn.k_norm"]
        step = config.get("decoder_sparse_step") or 1
        block = "mlp"
        sparse = layer not in (config.get("mlp_only_layers") or []) and (layer + 1) % step == 0
    if not sparse:
        return names + [f"mlp.{p}" for p in ("gate_proj", "up_proj", "down_proj")]
    names.append(f"{block}.gate")
    return names + [f"{block}.experts.{e}.{model.hf_names[p]}" for e in range(model.num_experts)
                    for p in ("gate_proj", "up_proj", "down_proj")]


def expected_shape(config: dict, model: MoeModel, name: str) -> tuple[tuple[int, ...], str] | None:
    """(shape, the config keys it comes from) of a router or per-expert weight, as config.json sizes them:
    router [E, hidden], gate/up [ffn, hidden], down [hidden, ffn] (ffn: `moe_intermediate_size` where the
    model has one (Qwen3-MoE), else `intermediate_size` (Mixtral)); None for other tensors or missing sizes."""
    def size(key):
        v = config.get(key)
        return v if isinstance(v, int) and not isinstance(v, bool) and v > 0 else None

    hidden = size("hidden_size")
    ffn_key = "moe_intermediate_size" if size("moe_intermediate_size") else "intermediate_size"
    ffn = size(ffn_key)
    if model.is_router(model.out_name(name)):
        return ((model.num_experts, hidden), "num_experts, hidden_size") if model.num_experts and hidden else None
    m = _EXPERT.match(model.out_name(name))
    if not m or m["proj"] not in _CANONICAL or m["part"] != "weight" or not (hidden and ffn):
        return None
    if _CANONICAL[m["proj"]] == "down_proj":
        return (hidden, ffn), f"hidden_size, {ffn_key}"
    return (ffn, hidden), f"{ffn_key}, hidden_size"


def canonical_expert_name(name: str) -> str:
    """A per-expert name with mistral.rs' canonical projection (Mixtral's w1/w3/w2 -> gate/up/down_proj):
    mistral.rs reads either spelling, so completeness is judged on this form."""
    m = _EXPERT.match(name)
    if not m or m["proj"] not in _CANONICAL:
        return name
    return f"{m['block']}.experts.{m['expert']}.{_CANONICAL[m['proj']]}.{m['part']}"


def mistralrs_moe_config(config: dict) -> dict:
    """config.json with the keys mistral.rs' Qwen3-MoE config requires and transformers 5 no longer writes:
    `num_experts` (transformers' `num_local_experts`) and `max_window_layers` (0 when a sliding window is
    used, as transformers 5 then windows every layer; else the layer count, so no layer is windowed)."""
    if config.get("model_type") != "qwen3_moe":
        return config
    out = dict(config)
    if "num_experts" not in out and "num_local_experts" in out:
        out["num_experts"] = out["num_local_experts"]
    if "max_window_layers" not in out and isinstance(out.get("num_hidden_layers"), int):
        out["max_window_layers"] = 0 if out.get("use_sliding_window") else out["num_hidden_layers"]
    return out


# -- stacking -------------------------------------------------------------------------------------------
class StackedTensor:
    """Equal-shaped tensors of one dtype written back to back as one tensor of `shape`: stacking contiguous
    tensors on a new first dim (or joining 1-D block bytes) is concatenating their bytes, so the parts are
    written one after another and never copied into one buffer."""

    def __init__(self, parts: list[torch.Tensor], shape: tuple[int, ...]):
        self.parts = [p.detach().contiguous().cpu() for p in parts]
        self.shape = tuple(shape)
        self.dtype = self.parts[0].dtype
        self.nbytes = sum(p.numel() * p.element_size() for p in self.parts)

    def raw_parts(self):
        for p in self.parts:
            yield p.reshape(-1).view(torch.uint8).numpy().tobytes() if p.numel() else b""


def stack_layer(family: str, stack: str, experts: list[dict]) -> dict:
    """The stacked layer's tensors from each expert's 2-D layer tensors ({suffix: tensor}, suffix "" for
    the weight): scalars must agree, `weight.shape` gains the expert dim, GGUF block bytes are joined,
    everything else is stacked on a new first dim."""
    first = experts[0]
    if any(set(e) != set(first) for e in experts):
        raise ValueError(f"{stack}: the experts' layers have different tensors")
    out: dict = {}
    for suffix, t0 in first.items():
        values = [e[suffix] for e in experts]
        if any(v.dtype != t0.dtype for v in values):
            raise ValueError(f"{stack}: experts store {suffix or 'weight'} in different dtypes")
        if suffix == "weight.shape":
            if any(not torch.equal(v, t0) for v in values):
                raise ValueError(f"{stack}: experts have different shapes")
            out[suffix] = torch.tensor([len(experts), *t0.tolist()], dtype=t0.dtype)
        elif t0.dim() == 0:
            if any(not torch.equal(v, t0) for v in values):
                raise ValueError(f"{stack}: experts disagree on {suffix}")
            out[suffix] = t0
        else:
            if any(tuple(v.shape) != tuple(t0.shape) for v in values):
                raise ValueError(f"{stack}: experts' {suffix or 'weight'} shapes differ")
            joined = family == "gguf" and suffix == ""
            shape = (len(experts) * t0.numel(),) if joined else (len(experts), *t0.shape)
            out[suffix] = StackedTensor(values, shape)
    return out


class ExpertStacks:
    """The encoded experts of the stacks still being filled; a stack is handed out (and forgotten) as soon
    as its last expert arrives."""

    def __init__(self, sizes: dict[str, tuple[int, str]]):
        self.sizes = dict(sizes)  # stack key -> (number of experts, family)
        self.pending: dict[str, dict[int, dict]] = {}

    def add(self, stack: str, expert: int, tensors: dict) -> dict | None:
        n, family = self.sizes[stack]
        slots = self.pending.setdefault(stack, {})
        if expert in slots or not 0 <= expert < n:
            raise ValueError(f"{stack}: expert {expert} given twice or beyond {n}")
        slots[expert] = tensors
        if len(slots) < n:
            return None
        del self.pending[stack]
        return stack_layer(family, stack, [slots[e] for e in range(n)])

    def unfinished(self) -> list[str]:
        return sorted(self.pending)
