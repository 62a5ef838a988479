"""The tensors a transformers model class holds for a config.json: names and shapes read from the class itself,
built on the meta device (no weights, nothing allocated).

Why: for the architectures without per-layer rules (model_shapes.KNOWN_LAYOUTS covers llama, mistral, qwen2 and
qwen3 only), a checkpoint missing one layer's norm or router, or holding a router bias of another shape, used to
convert with exit 0 (found by scripts/fuzz on DeepSeek-V3 FP8 checkpoints). transformers' `from_pretrained` is
the loader every Hugging Face checkpoint is written for, and it starts a missing tensor from random values: the
class's own state dict is the one authority on what must be there, for every architecture it has, with no table
of ours to keep in step with it.

What is compared is deliberately narrow, so that no checkpoint transformers loads is refused:
- only `*ForCausalLM` classes that transformers itself has (no remote code is run); the checkpoint's names that
  are not already the class's own go through the class's own load-time renames first (transformers 5's
  conversion mapping: Mixtral's block_sparse_moe -> mlp, ...), and a tensor a load-time converter rebuilds
  (fused, split) is checked for presence only, not shape;
- routed experts stored one tensor per expert (`experts.E.*`) are left out (transformers 5 fuses them into 3-D
  parameters on load; run.py checks their completeness itself); a checkpoint that stores them fused as the class
  holds them (Gemma 4's `experts.gate_up_proj`, which gptqmodel leaves in float) is compared like the rest, since
  a fused stack removed or reshaped converted with exit 0 (found by scripts/fuzz, seed 2029, gptq cases 6674 and
  7092);
- tied weights and the class's `_keys_to_ignore_on_load_missing` are not required, and what its
  `_keys_to_ignore_on_load_unexpected` names is not compared with the class; Qwen3.5's and Qwen3-Next's `mtp.*`
  block, which it names, is compared with one of the class's own full-attention layers (_compare_mtp_block);
- when fewer than 90% of the checkpoint's other names are the class's, the checkpoint follows another naming
  (an older producer's, a converter's), and the comparison is skipped rather than guessed.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import warnings
from functools import lru_cache

import torch

# a config transformers would need minutes to build on the meta device is not a checkpoint anyone converts
_MAX_LAYERS = 1024
_MIN_SHARED = 0.9


@contextlib.contextmanager
def _quiet_fds():
    """transformers' import reports what its optional integrations fail to load (torchao's CUDA libraries, as
    log records and warnings) and torch's deprecation notes (on the process's own fds): none of it is qconvert's
    to show, and a refusal must stay one line."""
    saved = [os.dup(1), os.dup(2)]
    null = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(null, 1)
        os.dup2(null, 2)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            logging.disable(logging.CRITICAL)
            try:
                yield
            finally:
                logging.disable(logging.NOTSET)
    finally:
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        for fd in (*saved, null):
            os.close(fd)


@lru_cache(maxsize=1)
def _transformers():
    """transformers with its model-building machinery imported (about 2-4 s, once per process), or None."""
    try:
        with _quiet_fds():
            import transformers
            import transformers.modeling_utils  # noqa: F401
            from transformers.models.auto.configuration_auto import CONFIG_MAPPING
            transformers.logging.set_verbosity_error()
    except Exception:  # noqa: BLE001 - without transformers there is no class to compare with
        return None
    return transformers, CONFIG_MAPPING


def preload() -> None:
    """Import transformers' model machinery now (the tests' fork server and the fuzzer's pool import once and
    fork)."""
    _transformers()


def _is_expert(name: str) -> bool:
    return ".experts." in name


_INTEGER_DTYPE = re.compile(r"^(u?int\d+|bool)$")  # a dense record's torch dtype name
_PER_EXPERT = re.compile(r"\.experts\.(0|[1-9][0-9]*)\.")


def _is_per_expert(name: str) -> bool:
    """One routed expert's own tensor (`...experts.3.w1.weight`), not a fused stack (`...experts.gate_up_proj`)."""
    return _PER_EXPERT.search(name) is not None


def class_tensors(config: dict):
    """(class name, {tensor name: shape}, rename) for the class this config.json names: the tensors it loads
    (routed experts, tied and ignorable tensors left out) and `rename(checkpoint name) -> (model name, rebuilt)`,
    transformers' own load-time renaming; None where there is no such class to ask (see the module's
    docstring)."""
    classes = config.get("architectures")
    model_type = config.get("model_type")
    if not (isinstance(classes, list) and len(classes) == 1 and isinstance(classes[0], str)
            and classes[0].endswith("ForCausalLM") and isinstance(model_type, str)):
        return None
    layers = config.get("num_hidden_layers")
    if not isinstance(layers, int) or isinstance(layers, bool) or not 0 < layers <= _MAX_LAYERS:
        return None
    found = _transformers()
    if found is None:
        # said, not silent: without transformers the checkpoint's tensors are not checked against the class
        # GGUF output still refuses a missing tensor (its writer's completeness check, formats/gguf/checks.py
        # needs no transformers), so the warning says which check is gone rather than "nothing is caught"
        warnings.warn(f"transformers is not installed, so the checkpoint's tensors were not checked against "
                      f"{classes[0]}'s: a misshapen tensor is not caught, nor a missing one except by the GGUF "
                      f"writer's own completeness check: pip install transformers")
        return None
    transformers, config_mapping = found
    cls = getattr(transformers, classes[0], None)
    if cls is None or model_type not in config_mapping:
        return None
    kwargs = {k: v for k, v in config.items() if k not in ("model_type", "architectures", "quantization_config",
                                                          "transformers_version", "auto_map")}
    try:
        with _quiet_fds():
            hf_config = config_mapping[model_type](**kwargs)
            with torch.device("meta"):
                model = cls(hf_config)
    except Exception:  # noqa: BLE001 - a config the class cannot build is judged by the other checks
        return None
    meta = model.state_dict()  # every name the class loads (meta tensors: names and shapes only)
    shapes = {name: tuple(t.shape) for name, t in meta.items() if not _is_per_expert(name)}
    tied = getattr(model, "_tied_weights_keys", None) or ()
    if getattr(hf_config, "tie_word_embeddings", False):
        for name in (tied.keys() if isinstance(tied, dict) else tied):
            shapes.pop(name, None)
    for pattern in getattr(cls, "_keys_to_ignore_on_load_missing", None) or ():
        shapes = {n: s for n, s in shapes.items() if not re.search(pattern, n)}
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightConverter, rename_source_key
        transforms = get_model_conversion_mapping(model)
    except Exception:  # noqa: BLE001 - a transformers without the 5.x loading API: names compared as they are
        transforms, rename_source_key = [], None
    renamings = [t for t in transforms if not isinstance(t, WeightConverter)]
    converters = [t for t in transforms if isinstance(t, WeightConverter)]

    def rename(name: str) -> tuple[str, bool]:
        # a name that is already the class's own is taken as it is: the load-time renames are written for the
        # names a release uses (DeepSeek-V4's `norm.` -> `kv_norm.` would move the final norm our reader
        # already names model.norm.weight)
        if rename_source_key is None or name in meta:
            return name, False
        try:
            new, pattern = rename_source_key(name, renamings, converters, model.base_model_prefix, meta)
        except Exception:  # noqa: BLE001 - a name the mapping cannot take stays as it is
            return name, False
        return new, pattern is not None

    ignored = [re.compile(p) for p in getattr(cls, "_keys_to_ignore_on_load_unexpected", None) or ()]

    def rename_loaded(name: str) -> tuple[str, bool] | None:
        """None for a name transformers ignores on load (Qwen3.5's `mtp.*`, DeepSeek-V3's layer 61)."""
        if any(p.search(name) for p in ignored):
            return None
        return rename(name)

    floats = frozenset(name for name, t in meta.items() if t.is_floating_point())
    return cls.__name__, shapes, rename_loaded, floats


def compare(config: dict, shapes: dict[str, tuple[int, ...]], dtypes: dict[str, str] | None = None):
    """The first tensor the checkpoint (its records' names and shapes) lacks or holds in another shape than the
    class loads: (name, message), or None. Experts are not compared (run.py checks them)."""
    wanted = class_tensors(config)
    if wanted is None:
        return None
    class_name, expected, rename, floats = wanted
    loaded: dict[str, tuple[str, tuple[int, ...], bool]] = {}  # model name -> (checkpoint name, shape, rebuilt)
    for name, shape in shapes.items():
        if not _is_per_expert(name):
            renamed = rename(name)
            if renamed is None:
                continue
            model_name, rebuilt = renamed
            loaded.setdefault(model_name, (name, tuple(shape), rebuilt))
    # the class's fused expert stacks are required only as the checkpoint stores them: a stack it holds under the
    # class's name in one layer (Gemma 4's experts.gate_up_proj) is required in every layer; a checkpoint that
    # stores experts per expert, or in another form (gpt-oss's MXFP4 gate_up_proj_blocks / _scales beside the
    # class's gate_up_proj_bias), is not asked for the class's fused names it never uses
    held = {n.rpartition(".")[2] for n in loaded if _is_expert(n) and n in expected}
    expected = {n: s for n, s in expected.items() if not _is_expert(n) or n.rpartition(".")[2] in held}
    if not loaded or sum(n in expected for n in loaded) < _MIN_SHARED * len(loaded):
        return None
    for model_name in expected:
        if model_name not in loaded:
            return model_name, (f"missing: {class_name} has it for this config.json (transformers would start it "
                                "from random values)")
    for model_name, (name, shape, rebuilt) in loaded.items():
        want = expected.get(model_name)
        if want is not None and not rebuilt and shape != want:
            return name, f"shape {shape} is not the {want} {class_name} has for this config.json"
        # a float parameter of the class read as integers (a dense tensor's dtype relabelled F32 -> I32: GLM-4.5's
        # router converted as integers near 1e9 with exit 0, scripts/fuzz seed 2029 gptq case 9961)
        dtype = (dtypes or {}).get(name, "")
        if want is not None and not rebuilt and model_name in floats and _INTEGER_DTYPE.match(dtype):
            return name, (f"dtype {dtype} is an integer type, but {class_name} holds this as a float parameter "
                          "(F16, BF16 or F32 in a dense checkpoint)")
    # a tensor under one of the class's modules with a parameter name no module of the class has (`g_idxx`,
    # `weightx`: a damaged or foreign partner) is refused; other names the class does not have (extra modules,
    # a release's own buffers) are carried, as transformers loads such checkpoints and ignores them
    modules = {n.rpartition(".")[0] for n in expected}
    parameters = {n.rpartition(".")[2] for n in expected}
    for model_name, (name, _, rebuilt) in loaded.items():
        module, _, parameter = model_name.rpartition(".")
        if model_name not in expected and not rebuilt and module in modules and parameter not in parameters:
            return name, (f"not a tensor of {class_name}: its {module} has no {parameter!r} (nor has any module "
                          "of it)")
    ignored_mtp = {n: tuple(s) for n, s in shapes.items()
                   if n.startswith("mtp.") and not _is_expert(n) and rename(n) is None}
    return _compare_mtp_block(config, expected, ignored_mtp) if ignored_mtp else None


# Qwen3.5 / Qwen3-Next keep a multi-token-prediction block beside the model (`mtp.*`) that transformers ignores on
# load, but llama.cpp's converter keeps (blk.N.nextn.*) and vLLM's MTP drafter loads: a block missing a tensor or
# holding a renamed one is as wrong as such a trunk (found by scripts/fuzz on gptqmodel's Qwen3.5). Its own modules
# (fc over [embedding, hidden], two input norms, a final norm) and, per block layer, the tensors of one of the
# trunk's full-attention layers, in their shapes.
_MTP_OWN = {"mtp.fc.weight": lambda h: (h, 2 * h), "mtp.pre_fc_norm_embedding.weight": lambda h: (h,),
            "mtp.pre_fc_norm_hidden.weight": lambda h: (h,), "mtp.norm.weight": lambda h: (h,)}
_MTP_LAYER = re.compile(r"^mtp\.layers\.(0|[1-9][0-9]{0,5})\.")


def _compare_mtp_block(config: dict, expected: dict[str, tuple[int, ...]], found: dict[str, tuple[int, ...]]):
    hidden = config.get("hidden_size")
    kinds = config.get("layer_types")
    full = [i for i, kind in enumerate(kinds) if kind == "full_attention"] if isinstance(kinds, list) else []
    if not isinstance(hidden, int) or not full:
        return None  # not the layout this check knows: the block is carried as it is
    prefix = f"model.layers.{full[0]}."
    layer = {n[len(prefix):]: s for n, s in expected.items() if n.startswith(prefix)}
    declared = config.get("mtp_num_hidden_layers")  # Qwen3.5 states it; Qwen3-Next's block is counted
    held = 1 + max((int(m[1]) for m in map(_MTP_LAYER.match, found) if m), default=-1)
    if isinstance(declared, int) and not isinstance(declared, bool) and declared > 0:
        # listed up to one layer past those the tensors hold: a config that declares more (even 2**31) is refused
        # by that first missing layer, without building names for every declared one
        n_layers = min(declared, held + 1)
    else:
        n_layers = held
    own = {name: shape(hidden) for name, shape in _MTP_OWN.items()}

    def wanted(name: str):
        """The shape the block holds `name` in, or None where it holds no such tensor."""
        if name in own:
            return own[name]
        m = _MTP_LAYER.match(name)
        return layer.get(name[m.end():]) if m and int(m[1]) < n_layers else None

    # names are generated layer by layer and the first missing one returns, so the work is bounded by the tensors
    # the file holds, not by a layer count (a tensor renamed to mtp.layers.999999.* makes layer 1 the missing one)
    for name in (*own, *(f"mtp.layers.{i}.{tail}" for i in range(n_layers) for tail in layer)):
        if name not in found:
            if n_layers > held and name.startswith(f"mtp.layers.{held}."):
                return name, (f"missing: config.json's mtp_num_hidden_layers declares {declared} "
                              f"multi-token-prediction layers, the checkpoint holds {held}")
            return name, ("missing: the multi-token-prediction block beside the model has it (its layers are "
                          f"full-attention layers such as model.layers.{full[0]})")
    for name, shape in found.items():
        want = wanted(name)
        if want is None:
            return name, "not a tensor of the multi-token-prediction block (mtp.*) this config.json describes"
        if shape != want:
            return name, f"shape {shape} is not the {want} of the multi-token-prediction block"
    return None
