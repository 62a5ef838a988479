"""The architecture entry (`GgufArch`) and its registry, with what every entry shares: the routed experts'
names and counts, and the MoE fields of a config rebuilt from GGUF metadata.

An entry holds everything qconvert knows of one llama.cpp architecture (see archs/__init__.py); the entries
themselves live one module per family beside this one and register with `register_arch`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import gguf

from ..hparams import MAX_WIDTH, head_dim
from .mtp import MtpBlock

__all__ = ["GgufArch", "register_arch", "registered", "arch_by_name", "arch_for_config", "supported_classes",
           "expert_name", "EXPERT_COUNT_KEYS", "expert_count_key", "expert_count", "expert_keys", "moe_config",
           "HF_DENSE_BLOCK", "llama_converter_keys", "StoredValues", "TextOfMultimodal",
           "text_model_config", "SHARED_EXPERT"]

MetadataHook = Callable[[gguf.GGUFWriter, Mapping], None]


@dataclass(frozen=True)
class TextOfMultimodal:
    """Multimodal classes llama.cpp's converter writes as their text model alone (Llama4ForConditionalGeneration,
    the class of the released Llama 4 checkpoints): its text run merges config.json's `config_key` over the top
    level, reads the tensors under `prefix` as the text model's and leaves the towers (`towers`: names starting so)
    to the mmproj file its --mmproj run writes. The converter deletes `language_model.` wherever it stands, so the
    prefix becomes `renamed` (Gemma 4's model.language_model.layers.0 is its causal LM's model.layers.0)."""
    classes: tuple[str, ...]
    config_key: str = "text_config"
    prefix: str = "language_model."
    towers: tuple[str, ...] = ("vision_model.", "multi_modal_projector.")
    renamed: str = ""

    def applies(self, config: Mapping) -> bool:
        archs = config.get("architectures") or []
        return bool(archs) and archs[0] in self.classes and isinstance(config.get(self.config_key), Mapping)

    def text_config(self, config: Mapping) -> dict:
        """The text model's config as the converter sees it: the text fields over the top-level ones."""
        return {**config, **config[self.config_key], "architectures": list(config["architectures"])}


# (the config being rebuilt, get(key, default, required, kind, **bounds) of the arch's typed metadata, the
# file's tensor names or None, the typed metadata view) -> None: fills the architecture's own fields
ConfigHook = Callable[[dict, Callable[..., Any], "set[str] | None", Any], None]


def _no_config(cfg: dict, get, names, cv) -> None:
    return None


# HF module names per block, in the order the inverse map prefers them (transformers naming). Several HF
# names map to one GGUF name across families (Mixtral's block_sparse_moe.experts.w1 and Qwen's
# mlp.experts.gate_proj are both ffn_gate_exps): each architecture lists the ones its HF class uses.
HF_DENSE_BLOCK = (
    "input_layernorm",
    "post_attention_layernorm",
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "self_attn.o_proj",
    "self_attn.q_norm",
    "self_attn.k_norm",
    "mlp.gate_proj",
    "mlp.up_proj",
    "mlp.down_proj",
)


MetadataHook = Callable[[gguf.GGUFWriter, Mapping], None]

# a shared expert's FFN as GGUF names it (GgufArch.routed_extra)
SHARED_EXPERT = ("ffn_gate_shexp", "ffn_up_shexp", "ffn_down_shexp")

# an elementwise map llama.cpp's converter applies to a tensor's values (Qwen3.5's A = -exp(A_log)): the
# values as stored, the inverse (the writer measures the error after it, against the source's values), and
# why the tensor is near-exact
StoredValues = tuple[Callable[[Any], Any], Callable[[Any], Any], str]


def _as_is(gguf_name: str) -> StoredValues | None:
    return None


def _no_extra(writer: gguf.GGUFWriter, config: Mapping) -> None:
    return None


@dataclass(frozen=True)
class GgufArch:
    name: str  # general.architecture
    hf_classes: tuple[str, ...]  # config.json `architectures` entries that map here
    model_types: tuple[str, ...]  # config.json `model_type` values that map here (no `architectures`)
    hf_class: str  # the class gguf->hf writes
    model_type: str
    permute_qk: bool = False
    norm_shift: float = 0.0
    moe: bool = False  # has routed experts (ffn_*_exps)
    # the architecture's own keys, after the ones every family shares (metadata.add_model_metadata)
    extra_metadata: MetadataHook = _no_extra
    # per layer, the tensors llama.cpp's loader requires besides the attention / FFN ones below
    block_extra: tuple[str, ...] = ()
    attention: tuple[str, ...] = ("attn_q", "attn_k", "attn_v", "attn_output")
    norms: tuple[str, ...] = ("attn_norm", "ffn_norm")
    dense_ffn: tuple[str, ...] = ("ffn_gate", "ffn_up", "ffn_down")
    tied_output_dropped: bool = False  # llama.cpp's converter drops lm_head (Gemma: the embedding serves)
    # multi-head latent attention (DeepSeek): llama.cpp runs it as MQA over the compressed KV, so the shared
    # keys write one KV head and no per-head key/value length (the architecture's own keys do)
    mla: bool = False
    # the multi-token-prediction block the checkpoints ship beside the trunk, and what llama.cpp's converter does
    # with it (archs/mtp.py: one description for the three places checkpoints keep it; kept by default where
    # the converter keeps it, dropped with --no-mtp); None: the family has none
    mtp: MtpBlock | None = None
    # what the config asks that llama.cpp's graph for this architecture does not do (it hard-codes it):
    # a list of warnings for the user, the conversion goes on
    caveats: Callable[[Mapping], list[str]] = field(default=lambda config: [], repr=False)
    # the HF module names of one block that map to GGUF names (names.hf_tensor_name's inverse map; an entry
    # with a name_table reads its table's inverse instead)
    hf_block: tuple[str, ...] = HF_DENSE_BLOCK
    # config_from_gguf's hook for the architecture's own config.json fields (ConfigHook)
    config_from_gguf: ConfigHook = field(default=_no_config, repr=False)
    # rope types this architecture carries beyond linear / yarn / llama3 (Phi-3's longrope factor tables)
    extra_rope_types: tuple[str, ...] = ()
    # q/k RMSNorm over the whole projection (OLMo 2 / 3: attn_q_norm is heads * head_dim wide, attn_k_norm
    # kv_heads * head_dim) rather than over one head (Qwen3, Gemma 3): the shape checks follow it
    qk_norm_whole: bool = False
    # routed experts fused and transposed in HF ([experts, in, out]: gate_up_proj with the gate columns first,
    # down_proj), Llama 4: split into llama.cpp's [experts, out, in] stacks and merged back (archs/llama4.py)
    experts_in_out: bool = False
    # the config.json key of the dense FFN's width (feed_forward_length): Llama 4 calls it intermediate_size_mlp,
    # its intermediate_size being the experts' width (expert_feed_forward_length)
    dense_ffn_key: str = "intermediate_size"
    # special tokens llama.cpp's converter looks up by their text, (tokenizer.ggml.<typ>_token_id, token), each
    # taken where the tokenizer files name no id for it (GLM's [gMASK], <|user|>, <|observation|>: without
    # eot llama.cpp's chat never stops at the end of a turn)
    named_special_tokens: tuple[tuple[str, str], ...] = ()
    # hybrid models (Qwen3.5, Qwen3-Next): the tensors a linear-attention layer has in place of `attention`;
    # a layer holding any of them is checked for these instead (llama.cpp's loader reads the layer's kind
    # from its recurrent_layers key)
    linear_attention: tuple[str, ...] = ()
    # a routed layer's tensors (within blk.N.) llama.cpp's loader requires beside the router and the expert stacks:
    # the shared expert (and its gate, Qwen3.5-MoE / Qwen3-Next), the router's score bias (GLM-4.5:
    # `exp_probs_b.bias`); checked before a GGUF is written (checks.py), with or without transformers
    routed_extra: tuple[str, ...] = ()
    # the config.json key counting the shared experts, where the loader requires the `_shexp` tensors of
    # routed_extra only when it is above 0 (GLM-4.5's n_shared_experts); None: whenever a layer is routed
    shared_experts_key: str | None = None
    # GGUF norms `norm_shift` leaves alone: Qwen3.5's gated RMSNorm of the linear attention (ssm_norm)
    # multiplies by w where every other norm of the model multiplies by 1 + w
    unshifted_norms: tuple[str, ...] = ()
    # the model has a dense FFN width (config intermediate_size, GGUF feed_forward_length); Qwen3.5-MoE
    # routes every layer and has neither (llama.cpp's converter then writes no feed_forward_length)
    dense_ffn_width: bool = True
    # full-attention q_proj rows hold each head's query and its output gate (Qwen3-Next / 3.5): 2x rows
    gated_query: bool = False
    # the elementwise maps that round (gguf name -> StoredValues or None), applied by the writer's session so
    # that the error is measured against the source's own values
    stored_values: Callable[[str], StoredValues | None] = field(default=_as_is, repr=False)
    # the exact tensor transforms llama.cpp's converter applies beyond names, q/k row permutations and norm
    # shifts (shape changes, head reorders, a fused projection split): writer (record, config.json, the file
    # to name) -> the records as the GGUF stores them; reader (an HF-named record holding the GGUF's values,
    # config, file, a dict the hook keeps records in until their partner arrives) -> the HF records, the
    # elementwise maps of `stored_values` undone too. None: none
    to_gguf_record: Callable[..., Any] | None = field(default=None, repr=False)
    from_gguf_record: Callable[..., Any] | None = field(default=None, repr=False)
    # (HF name within a layer, GGUF name within a block) pairs gguf-py's name map lacks or names otherwise,
    # looked up before it both ways (Gemma 4's router.scale is ffn_gate_inp.scale, a `.scale` no map names)
    tensor_names: tuple[tuple[str, str], ...] = ()
    # routed experts fused as transformers 5 holds them ([experts, 2 * ffn, hidden], gate rows first) kept
    # fused as llama.cpp's ffn_gate_up_exps (Gemma 4's converter writes them so) instead of split in two stacks
    fused_gate_up_experts: bool = False
    # the architecture's own rope tensors (config -> [(GGUF name, float32 array)]), written in place of
    # llama-3's rope_freqs: Gemma 4's proportional rope as rope_freqs factors
    arch_rope_tensors: Callable[[Mapping], list] | None = field(default=None, repr=False)
    # a routed layer keeps its dense FFN and adds these (Gemma 4: the router and the fused expert stacks),
    # instead of the routed stacks replacing the dense FFN
    routed_beside_dense: tuple[str, ...] = ()
    # GGUF tensors (within a block) whose shape varies from layer to layer with per-layer metadata arrays
    # (Gemma 4: the full layers' own head size, the KV-shared layers' double-wide MLP): the uniform shape
    # check from config.json / metadata skips them (llama.cpp's loader checks each layer's)
    varying_shapes: tuple[str, ...] = ()
    # metadata keys (after `{arch}.`) llama.cpp reads as a scalar or one value per layer (Gemma 4's
    # feed_forward_length, attention.head_count_kv): config_from_gguf's shared fields take layer 0's value
    # and the architecture's hook reads the array
    per_layer_keys: tuple[str, ...] = ()
    # an architecture the installed gguf-py (0.19) does not name (DeepSeek-V4, Kimi-K3: only the gguf-py vendored
    # in llama.cpp's sources has them, which the package never imports): its own table, HF name of block 0 (a
    # module, or a whole tensor name for a bare parameter) -> GGUF name, mirroring that gguf-py and checked
    # against it by the entry's test; names.py's ArchNameTable maps by it both ways in place of gguf-py's
    # TensorNameMap. None: gguf-py's map of `enum`
    name_table: Mapping[str, str] | None = field(default=None, repr=False)
    # llama.cpp's converter keeps each tensor's stored type whatever --outtype says (DeepSeek-V4: its
    # tensor_force_quant): the FP4 grids (the MXFP4 experts) as MXFP4, float32 tensors as F32, 2-D bfloat16
    # ones as BF16, the router included; a float --type (f32 / f16 / bf16) does the same, so that the file is
    # the converter's (a quantized --type, or --tensor-type, still decides)
    float_type_keeps_source_types: bool = False
    # (HF name, config.json) -> why llama.cpp's converter leaves the tensor out, or None (DeepSeek-V4's router
    # bias of its hash-routed layers, which route by their token table instead)
    dropped_tensor: Callable[[str, Mapping], str | None] = field(default=lambda name, config: None, repr=False)
    # GGUF names of integer tables stored as I32 as they are (DeepSeek-V4's hash-routing tid2eid: token id ->
    # experts), not weights: no --type applies to them
    integer_tensors: re.Pattern | None = None
    # a multimodal class of the family written as its text model, its towers left out as llama.cpp's converter
    # leaves them (Llama 4: TextOfMultimodal); its class is one of hf_classes
    multimodal: TextOfMultimodal | None = None
    # the per-layer KV head counts llama.cpp reads as head_count_kv (an int or one per layer), where they are not
    # the config's one count: Kimi-K3 writes 0 on its linear-attention layers, how its loader tells them apart
    head_count_kv: Callable[[Mapping], Any] | None = field(default=None, repr=False)
    # a transform of the whole record stream (records, config.json, the file to name) -> records, run before
    # every other, for what one record alone cannot do: Kimi-K3 fuses pairs of vectors into one tensor and
    # strips its text model's `language_model.` prefix
    adapt_stream: Callable[..., Any] | None = field(default=None, repr=False)
    # the tokenizer model llama.cpp's converter writes a byte-fallback BPE tokenizer.json as: `llama` (SentencePiece
    # style, scores from the merge ranks) but for Gemma 4, whose converter writes `gemma4` (llama.cpp's BPE over
    # U+2581-escaped text with the file's merges; tokenizer.py _write_gemma4)
    byte_fallback_tokenizer: str = "llama"
    # why a GGUF of this architecture is written but not read back (a refusal naming it instead of a misread
    # key); "": read back. Kimi-K3 stores res_norm * res_proj as one tensor and has no transformers class
    not_read: str = ""

    def shifts_norm(self, gguf_name: str) -> bool:
        """Whether the GGUF tensor is a norm stored as `norm_shift + w`."""
        return bool(self.norm_shift) and gguf_name.endswith("norm.weight") and not any(
            gguf_name.endswith(f".{n}.weight") for n in self.unshifted_norms)

    @property
    def enum(self) -> gguf.MODEL_ARCH | None:
        """gguf-py's enum of the architecture; None for one it does not name (the entry's name_table)."""
        return _ENUM_BY_NAME.get(self.name)


_ENUM_BY_NAME = {name: enum for enum, name in gguf.MODEL_ARCH_NAMES.items()}


# the registered entries by general.architecture, in registration order (the order of every "supported" list)
_ARCHS: dict[str, GgufArch] = {}


def register_arch(arch: GgufArch) -> GgufArch:
    """Add an architecture (its name is the llama.cpp general.architecture; a name or an HF class registered
    twice with another entry is an error)."""
    if _ARCHS.get(arch.name, arch) is not arch:
        raise ValueError(f"GGUF architecture {arch.name!r} is already registered")
    taken = {c: a.name for a in _ARCHS.values() if a is not arch for c in a.hf_classes}
    clash = [c for c in arch.hf_classes if c in taken]
    if clash:
        raise ValueError(f"{clash[0]} already maps to GGUF architecture {taken[clash[0]]!r}")
    _ARCHS[arch.name] = arch
    return arch


def registered() -> tuple[str, ...]:
    """Every registered architecture's name, in registration order."""
    return tuple(_ARCHS)


def arch_by_name(name: str) -> GgufArch | None:
    return _ARCHS.get(name)


def supported_classes() -> list[str]:
    return sorted(c for a in _ARCHS.values() for c in a.hf_classes)


def text_model_config(config: Mapping) -> Mapping:
    """config.json as the GGUF writer reads it: a multimodal class written as its text model (GgufArch.multimodal)
    gives its text model's config, every other config is itself."""
    arch, _ = arch_for_config(config)
    if arch is not None and arch.multimodal is not None and arch.multimodal.applies(config):
        return arch.multimodal.text_config(config)
    return config


def arch_for_config(config: Mapping) -> tuple[GgufArch | None, str]:
    """(the architecture of an HF config.json dict, or None; what the config names, for a refusal).
    `architectures[0]` decides; `model_type` is the fallback when there is no `architectures`."""
    archs = config.get("architectures") or []
    if isinstance(archs, str):
        archs = [archs]
    if not isinstance(archs, list):  # an object or a number: named in the refusal
        archs = [archs]
    for a in _ARCHS.values():
        if any(isinstance(c, str) and c in a.hf_classes for c in archs):
            return a, ""
    if not archs:
        mt = config.get("model_type")
        for a in _ARCHS.values():
            if isinstance(mt, str) and mt in a.model_types:
                return a, ""
        return None, f"model_type {mt!r}" if mt else "no architectures/model_type in config.json"
    named = ", ".join(map(str, archs))
    return None, f"architecture {named}"


# `...experts.<e>.<rest>`: one expert's tensor of a MoE layer (Mixtral's block_sparse_moe.experts.3.w1,
# Qwen-MoE's mlp.experts.3.gate_proj); shared experts (`shared_expert.`, `shared_experts.`) do not match
_EXPERT = re.compile(r"^(?P<head>.*\.experts)\.(?P<index>0|[1-9][0-9]*)\.(?P<tail>.+)$")


def expert_name(hf_name: str) -> tuple[str, int] | None:
    """(the name of the stacked tensor the expert belongs to, the expert's index), or None:
    `model.layers.0.mlp.experts.3.up_proj.weight` -> (`model.layers.0.mlp.experts.up_proj.weight`, 3)."""
    m = _EXPERT.match(hf_name)
    if m is None:
        return None
    return f"{m['head']}.{m['tail']}", int(m["index"])


# config.json's key for the routed experts per MoE layer: Mixtral (and transformers 5's Qwen-MoE), older
# Qwen-MoE configs, DeepSeek
EXPERT_COUNT_KEYS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")  # ..., ERNIE 4.5


def expert_count_key(config: Mapping) -> str | None:
    """The first of EXPERT_COUNT_KEYS the config sets, or None (a dense model)."""
    return next((key for key in EXPERT_COUNT_KEYS if config.get(key) is not None), None)


def expert_count(config: Mapping) -> int | None:
    """The routed experts per MoE layer config.json declares (Mixtral, Qwen-MoE, DeepSeek name it differently)."""
    key = expert_count_key(config)
    return None if key is None else config[key]


# --------------------------------------------------------------------------------------------------
# per-architecture metadata (the keys the shared writer does not know)
# --------------------------------------------------------------------------------------------------
def expert_keys(writer: gguf.GGUFWriter, config: Mapping) -> None:
    # transformers 5 calls Qwen-MoE's count num_local_experts as Mixtral's; older configs num_experts
    if expert_count(config) is not None:
        writer.add_expert_count(int(expert_count(config)))
    if config.get("num_experts_per_tok") is not None:
        writer.add_expert_used_count(int(config["num_experts_per_tok"]))


def moe_config(cfg: dict, get, names, cv) -> None:
    """The routed-expert fields every MoE family shares (transformers 5 names the count num_local_experts,
    as Mixtral always did, and still reads num_experts from older Qwen-MoE configs)."""
    n_expert = get("expert_count", lo=1, hi=1 << 16)
    if n_expert is None:
        return
    cfg["num_local_experts"] = n_expert
    cfg["num_experts_per_tok"] = get("expert_used_count", required=True, lo=1, hi=n_expert)
    ff_exp = get("expert_feed_forward_length", lo=1, hi=MAX_WIDTH)
    if ff_exp is not None:
        cfg["moe_intermediate_size"] = ff_exp


def llama_converter_keys(writer: gguf.GGUFWriter, config: Mapping) -> None:
    """The two keys llama.cpp's converter writes for every LlamaModel subclass (its set_gguf_parameters):
    the vocabulary size and the rotated dimensions (the whole head: these families rotate every pair)."""
    if config.get("vocab_size") is not None:
        writer.add_vocab_size(int(config["vocab_size"]))
    writer.add_rope_dimension_count(head_dim(config))
