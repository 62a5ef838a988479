"""Offline test fixtures: a tiny random Llama (or Qwen2/Qwen3) model, real GPTQ checkpoints made by
gptqmodel 7.6.0 on CPU, and reference data taken from gptqmodel itself.

Nothing here downloads anything: the tokenizer is trained on text generated in code, the model weights
are drawn from a seeded generator, and the calibration data is seeded random token ids.

Layout produced by :func:`ensure_fixtures` under ``root`` (default ``tests/_fixtures``)::

    root/
      prompt.json                 {"prompt_ids": [...16 ids...]}
      base/                       fp16 LlamaForCausalLM + tokenizer   (seed 1234)
      base_zp0/                   same, inputs 0..31 of every layer linear >= 0 (asym zero point 0)
      <variant>/
        ckpt/                     the gptqmodel checkpoint (config.json, quantize_config.json,
                                  model.safetensors, tokenizer files)
        reference.safetensors     gptqmodel's own dequantized weights (fp16 [out, in],
                                  key "<module>.weight") and "__logits__" (float32 [1, T, vocab])
        .done                     marker: the variant is complete

Usage: ``python tests/support/fixtures.py [--root DIR] [--only NAME ...] [--bundled DIR] [--list]`` or
``python scripts/make_fixtures.py ...`` (a thin wrapper). The full set builds in ~45 s on 2 CPU
cores and is byte-for-byte reproducible. Tests should load this module by path, because pytest
runs with ``--import-mode=importlib``::

    import importlib.util, pathlib
    p = pathlib.Path(__file__).with_name("fixtures.py")
    spec = importlib.util.spec_from_file_location("qconvert_test_fixtures", p)
    fixtures = importlib.util.module_from_spec(spec); spec.loader.exec_module(fixtures)

Pitfalls of gptqmodel 7.6.0 on a CPU handled here:
* ``GPTQMODEL_CPU_WORKERS`` must be >= 2 on a 2-core machine (set by default here).
* group_size -1 needs ``act_group_aware=False``.
* the CPU default load dtype is bfloat16 -> always pass ``dtype=torch.float16``.
* ``quant_log.csv`` holds wall-clock timings (not reproducible, not needed to load) -> removed.
* default ``offload_to_disk=True`` writes a random temp dir into ``meta.offload_to_disk_path`` of
  config.json -> ``offload_to_disk=False`` (meta only, the tensors are the same).
* ``desc_act=True`` needs ``act_group_aware=False`` (set explicitly to silence the warning).
* gptqmodel re-saves tokenizer_config.json (adds pad_token, "is_local", "local_files_only",
  "fix_mistral_regex"); kept as is in fixtures, replaced by the originals in the bundled example.
* references are read through ``BACKEND.GPTQ_TORCH`` (TorchLinear, which converts v1 zeros to v2
  at load); ``dequantize_weight()`` returns ``[in, out]`` -> transposed to ``[out, in]``.
* no monkeypatching of gptqmodel is needed for GPTQ on CPU.

``.done`` holds the variant's kwargs as JSON; delete a variant folder (or the marker) to rebuild it.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Dict, Iterable, List, Optional

os.environ.setdefault("GPTQMODEL_CPU_WORKERS", "2")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_ROOT = REPO_ROOT / "tests" / "_fixtures"

VOCAB_SIZE = 512
BOS_TOKEN = "<|bos|>"
EOS_TOKEN = "<|endoftext|>"
PROMPT_LEN = 16
PROMPT_SEED = 4321
CALIB_SEED = 2024
CALIB_N = 32
CALIB_LEN = 64
QUANT_SEED = 0

# --------------------------------------------------------------------------------------------------
# Variants
# --------------------------------------------------------------------------------------------------
# name -> kwargs for quantize_gptq (plus "base": which base model to start from).
VARIANTS: Dict[str, dict] = {
    "v1_b4_g32_sym": dict(base="base", fmt="gptq", bits=4, group_size=32, sym=True, desc_act=False),
    "v1_b4_g128_sym": dict(base="base", fmt="gptq", bits=4, group_size=128, sym=True, desc_act=False),
    "v1_b4_g32_sym_act": dict(base="base", fmt="gptq", bits=4, group_size=32, sym=True, desc_act=True),
    "v1_b4_g128_sym_act": dict(base="base", fmt="gptq", bits=4, group_size=128, sym=True, desc_act=True),
    "v2_b4_g32_sym": dict(base="base", fmt="gptq_v2", bits=4, group_size=32, sym=True, desc_act=False),
    "v2_b4_g128_sym_act": dict(base="base", fmt="gptq_v2", bits=4, group_size=128, sym=True, desc_act=True),
    "v1_b4_g32_asym_zp0": dict(base="base_zp0", fmt="gptq", bits=4, group_size=32, sym=False, desc_act=False),
    "v2_b4_g32_asym_zp0": dict(base="base_zp0", fmt="gptq_v2", bits=4, group_size=32, sym=False, desc_act=False),
    "v1_b8_g128_sym": dict(base="base", fmt="gptq", bits=8, group_size=128, sym=True, desc_act=False),
    "v1_b3_g32_sym": dict(base="base", fmt="gptq", bits=3, group_size=32, sym=True, desc_act=False),
    # asym 2-bit: written as gptq_v2 (a v1 asym file cannot hold zero point 0 without the word borrow)
    "v2_b2_g32_asym": dict(base="base", fmt="gptq_v2", bits=2, group_size=32, sym=False, desc_act=False),
    "v1_b4_gm1_sym": dict(base="base", fmt="gptq", bits=4, group_size=-1, sym=True, desc_act=False),
}

# base model name -> kwargs for build_tiny_llama
BASES: Dict[str, dict] = {
    "base": dict(seed=1234, arch="llama", zero_point_zero=False, tie=False),
    "base_zp0": dict(seed=1234, arch="llama", zero_point_zero=True, tie=False),
}


# --------------------------------------------------------------------------------------------------
# Tokenizers
# --------------------------------------------------------------------------------------------------
_WORDS = (
    "the a an of to and in is it that for on with as was he she they we you at by this from or be "
    "are not have has had but what all were when there can more if no out so said up one about into "
    "than them time only new some could these two may then do first any my now such like our over man "
    "me even most made after also did many before must through back years where much your way well "
    "down should because each just those people how too little state good very make world still own "
    "see men work long get here between both life being under never day same another know while last "
    "might us great old year off come since against go came right used take three quantized model "
    "weights tensor group scale zero point bits convert checkpoint llama layer token hello world"
).split()


def _corpus(n_lines: int = 4000, seed: int = 7) -> List[str]:
    """Deterministic English-ish text with digits and punctuation."""
    import random

    rng = random.Random(seed)
    fixed = [
        "The quick brown fox jumps over the lazy dog.",
        "Hello world! This is a tiny test model.",
        "Numbers: 0 1 2 3 4 5 6 7 8 9 10 42 128 256 512 1024 2048 3.14159",
        "GPTQ, QQQ, HQQ and GGUF are quantization formats.",
        "def main():\n    print('hello, world')\n",
    ]
    lines = []
    for i in range(n_lines):
        if i % 10 == 0:
            lines.append(fixed[(i // 10) % len(fixed)])
            continue
        n = rng.randint(4, 14)
        words = [rng.choice(_WORDS) for _ in range(n)]
        words[0] = words[0].capitalize()
        if rng.random() < 0.3:
            words.insert(rng.randint(0, n), str(rng.randint(0, 9999)))
        lines.append(" ".join(words) + rng.choice([".", ".", ".", "!", "?", ","]))
    return lines


def _tokenizer_config() -> dict:
    return {
        "add_bos_token": False,
        "add_eos_token": False,
        "bos_token": BOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "unk_token": None,
        "pad_token": None,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 256,
        "tokenizer_class": "PreTrainedTokenizerFast",
        "added_tokens_decoder": {
            "0": {"content": EOS_TOKEN, "lstrip": False, "normalized": False, "rstrip": False,
                  "single_word": False, "special": True},
            "1": {"content": BOS_TOKEN, "lstrip": False, "normalized": False, "rstrip": False,
                  "single_word": False, "special": True},
        },
    }


def build_tokenizer(out_dir, vocab_size: int = VOCAB_SIZE) -> Path:
    """Train a byte-level BPE tokenizer (vocab ``vocab_size``) offline; write tokenizer.json,
    tokenizer_config.json and special_tokens_map.json into ``out_dir``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers, processors

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=1,
        special_tokens=[EOS_TOKEN, BOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    assert tok.token_to_id(EOS_TOKEN) == 0 and tok.token_to_id(BOS_TOKEN) == 1
    assert tok.get_vocab_size() == vocab_size, tok.get_vocab_size()
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps(_tokenizer_config(), indent=2) + "\n")
    (out / "special_tokens_map.json").write_text(
        json.dumps({"bos_token": BOS_TOKEN, "eos_token": EOS_TOKEN}, indent=2) + "\n")
    return out


def build_wordlevel_tokenizer(out_dir, vocab_size: int = VOCAB_SIZE) -> Path:
    """A WordLevel tokenizer.json (whitespace split) of ``vocab_size`` entries, for refusal tests
    (GGUF/llama.cpp have no word-level tokenizer model)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    vocab = {EOS_TOKEN: 0, BOS_TOKEN: 1, "<unk>": 2}
    words = sorted(set(_WORDS))
    i = 0
    while len(vocab) < vocab_size:
        w = words[i] if i < len(words) else f"w{i}"
        vocab.setdefault(w, len(vocab))
        i += 1
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens([EOS_TOKEN, BOS_TOKEN])
    tok.save(str(out / "tokenizer.json"))
    cfg = _tokenizer_config()
    cfg["unk_token"] = "<unk>"
    (out / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    return out


# --------------------------------------------------------------------------------------------------
# Tiny model
# --------------------------------------------------------------------------------------------------
def _model_config(arch: str, tie: bool):
    import torch
    common = dict(
        vocab_size=VOCAB_SIZE, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        rms_norm_eps=1e-5, tie_word_embeddings=tie, bos_token_id=1, eos_token_id=0,
        pad_token_id=None, dtype=torch.float16,
    )
    if arch == "llama":
        from transformers import LlamaConfig, LlamaForCausalLM
        return LlamaConfig(head_dim=32, attention_bias=False, mlp_bias=False, **common), LlamaForCausalLM
    if arch == "qwen2":
        from transformers import Qwen2Config, Qwen2ForCausalLM
        return Qwen2Config(use_sliding_window=False, **common), Qwen2ForCausalLM
    if arch == "qwen3":
        from transformers import Qwen3Config, Qwen3ForCausalLM
        return Qwen3Config(head_dim=32, attention_bias=False, use_sliding_window=False, **common), Qwen3ForCausalLM
    raise ValueError(f"unknown arch {arch!r}")


def build_tiny_llama(out_dir, seed: int = 1234, arch: str = "llama", zero_point_zero: bool = False,
                     tie: bool = False, tokenizer: str = "bpe") -> Path:
    """Random tiny causal LM (vocab 512, hidden 128, ffn 256, 2 layers, 4 heads, 2 kv heads,
    head_dim 32), saved in fp16 safetensors with the tokenizer files into ``out_dir``.

    Linear weights ~ N(0, 1/in), embeddings ~ N(0, 1) (N(0, 1/hidden) when tied), RMSNorm weights 1 +- 0.1 (uniform), biases
    (qwen2 q/k/v) ~ N(0, 0.02). ``zero_point_zero``: input columns 0..31 of every decoder-layer
    linear are made >= 0 (abs), so asym GPTQ gets zero point 0 in group 0.
    """
    import torch

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    config, cls = _model_config(arch, tie)
    torch.manual_seed(seed)
    model = cls(config)
    gen = torch.Generator().manual_seed(seed)
    layer_linears = set()
    for mname, mod in model.named_modules():
        if isinstance(mod, torch.nn.Linear) and ".layers." in f".{mname}":
            layer_linears.add(mname + ".weight")
    with torch.no_grad():
        for name, p in sorted(model.named_parameters(), key=lambda kv: kv[0]):
            shape = tuple(p.shape)
            if name.endswith("norm.weight"):
                v = 1.0 + 0.2 * (torch.rand(shape, generator=gen, dtype=torch.float32) - 0.5)
            elif name.endswith(".bias"):
                v = 0.02 * torch.randn(shape, generator=gen, dtype=torch.float32)
            elif "embed_tokens" in name:
                # tied: the embedding is also the output matrix -> scale like a linear (logits ~ O(1))
                std = shape[1] ** -0.5 if tie else 1.0
                v = std * torch.randn(shape, generator=gen, dtype=torch.float32)
            elif len(shape) == 2:
                v = torch.randn(shape, generator=gen, dtype=torch.float32) / (shape[1] ** 0.5)
                if zero_point_zero and name in layer_linears:
                    v[:, :32] = v[:, :32].abs()
            else:
                raise RuntimeError(f"unexpected parameter {name} {shape}")
            p.copy_(v.to(p.dtype))
    model = model.to(torch.float16)
    model.config.dtype = torch.float16
    if model.generation_config is not None:
        model.generation_config.bos_token_id = 1
        model.generation_config.eos_token_id = 0
    model.save_pretrained(str(out), safe_serialization=True)
    if tokenizer == "bpe":
        build_tokenizer(out)
    elif tokenizer == "wordlevel":
        build_wordlevel_tokenizer(out)
    else:
        raise ValueError(tokenizer)
    return out


# --------------------------------------------------------------------------------------------------
# gptqmodel helpers
# --------------------------------------------------------------------------------------------------
def calibration_data(n: int = CALIB_N, length: int = CALIB_LEN, seed: int = CALIB_SEED,
                     vocab: int = VOCAB_SIZE) -> List[dict]:
    import torch
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, vocab, (n, length), generator=g)
    return [{"input_ids": row.tolist(), "attention_mask": [1] * length} for row in ids]


def _seed_all(seed: int = QUANT_SEED) -> None:
    import random
    import numpy as np
    import torch
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


_JUNK_FILES = ("quant_log.csv",)
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def _clean_checkpoint(out: Path) -> None:
    for name in _JUNK_FILES:
        p = out / name
        if p.exists():
            p.unlink()


def quantize_gptq(base_dir, out_dir, bits: int = 4, group_size: int = 32, sym: bool = True,
                  desc_act: bool = False, fmt: str = "gptq", calib: Optional[List[dict]] = None,
                  dtype: str = "float16") -> Path:
    """Quantize ``base_dir`` with gptqmodel 7.6.0 on CPU and save a GPTQ checkpoint (``fmt`` "gptq"
    = v1 or "gptq_v2") into ``out_dir``. Deterministic: fixed calibration data and seeds. ``dtype``: the torch
    dtype gptqmodel loads and calibrates the model in (its scales are float16 either way)."""
    import torch
    from gptqmodel import GPTQModel, QuantizeConfig

    if fmt not in ("gptq", "gptq_v2"):
        raise ValueError(f"fmt must be 'gptq' or 'gptq_v2', not {fmt!r}")
    out = Path(out_dir)
    if out.exists():
        shutil.rmtree(out)
    # offload_to_disk=False: the default puts a random temp dir name into meta.offload_to_disk_path,
    # which would make config.json differ between otherwise identical builds.
    qcfg_kwargs = dict(bits=bits, group_size=group_size, sym=sym, desc_act=desc_act, format=fmt,
                       offload_to_disk=False)
    if desc_act or group_size == -1:
        # GAR (act_group_aware) is incompatible with desc_act and with group_size -1.
        qcfg_kwargs["act_group_aware"] = False
    qcfg = QuantizeConfig(**qcfg_kwargs)
    _seed_all()
    model = GPTQModel.load(str(base_dir), qcfg, device="cpu", dtype=getattr(torch, dtype))
    model.quantize(calib if calib is not None else calibration_data(), batch_size=1)
    model.save(str(out))
    del model
    _clean_checkpoint(out)
    return out


def _load_quantized(ckpt_dir, dtype: str = "float16"):
    import torch
    from gptqmodel import BACKEND, GPTQModel
    return GPTQModel.load(str(ckpt_dir), backend=BACKEND.GPTQ_TORCH, device="cpu", dtype=getattr(torch, dtype))


def gptq_reference(ckpt_dir, ref_path, prompt_ids: Iterable[int]) -> Path:
    """Load ``ckpt_dir`` with gptqmodel (CPU torch kernel, fp16) and save to ``ref_path``:
    ``<module>.weight`` = gptqmodel's own dequantized weight, fp16 ``[out, in]``, for every quantized
    linear, and ``__logits__`` = float32 logits ``[1, T, vocab]`` for ``prompt_ids``."""
    import torch
    from safetensors.torch import save_file
    from gptqmodel.nn_modules.qlinear import BaseQuantLinear

    m = _load_quantized(ckpt_dir)
    hf = m.model
    hf.eval()
    tensors = {}
    with torch.inference_mode():
        for name, mod in hf.named_modules():
            if isinstance(mod, BaseQuantLinear):
                w = mod.dequantize_weight()  # [in, out] (forward does x @ w)
                if tuple(w.shape) != (mod.in_features, mod.out_features):
                    raise RuntimeError(f"{name}: unexpected dequantized shape {tuple(w.shape)}")
                tensors[f"{name}.weight"] = w.t().contiguous().to(torch.float16).cpu()
        if not tensors:
            raise RuntimeError(f"no quantized linears found in {ckpt_dir}")
        ids = torch.tensor([list(prompt_ids)], dtype=torch.long)
        logits = hf(input_ids=ids).logits
        tensors["__logits__"] = logits.float().contiguous().cpu()
    ref = Path(ref_path)
    ref.parent.mkdir(parents=True, exist_ok=True)
    from gptqmodel.version import __version__ as gptqmodel_version
    # a single metadata key: safetensors writes the metadata map in hash order (not reproducible
    # byte-for-byte with more than one key)
    save_file(tensors, str(ref), metadata={"source": f"gptqmodel {gptqmodel_version}"})
    del m, hf
    return ref


# --------------------------------------------------------------------------------------------------
# Orchestration
# --------------------------------------------------------------------------------------------------
def prompt_ids(n: int = PROMPT_LEN, seed: int = PROMPT_SEED) -> List[int]:
    import random
    rng = random.Random(seed)
    return [rng.randint(2, VOCAB_SIZE - 1) for _ in range(n)]


def _done(d: Path) -> bool:
    return (d / ".done").exists()


def _mark_done(d: Path, info: dict) -> None:
    (d / ".done").write_text(json.dumps(info, indent=2, sort_keys=True) + "\n")


def ensure_base(root, name: str) -> Path:
    root = Path(root)
    d = root / name
    if not _done(d):
        if d.exists():
            shutil.rmtree(d)
        build_tiny_llama(d, **BASES[name])
        _mark_done(d, {"kind": "base", **BASES[name]})
    return d


def ensure_fixtures(root=DEFAULT_ROOT, names: Optional[Iterable[str]] = None,
                    verbose: bool = False) -> Dict[str, object]:
    """Build (once; variants with a ``.done`` marker are skipped) the base models, the GPTQ variants
    and their references under ``root``. Returns ``{"root", "prompt_ids", "prompt", "bases": {name:
    dir}, "variants": {name: {"ckpt", "reference", **kwargs}}}``."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    names = list(VARIANTS) if names is None else list(names)
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        raise KeyError(f"unknown fixture variants {unknown}; known: {sorted(VARIANTS)}")
    # one builder at a time per root (e.g. pytest-xdist workers or two shells)
    with _RootLock(root):
        return _ensure_fixtures_locked(root, names, verbose)


class _RootLock:
    def __init__(self, root: Path):
        self.path = Path(root) / ".lock"
        self.fh = None

    def __enter__(self):
        self.fh = open(self.path, "a+")
        try:
            import fcntl
            fcntl.flock(self.fh.fileno(), fcntl.LOCK_EX)
        except ImportError:  # non-POSIX: no locking
            pass
        return self

    def __exit__(self, *exc):
        try:
            import fcntl
            fcntl.flock(self.fh.fileno(), fcntl.LOCK_UN)
        except ImportError:
            pass
        self.fh.close()
        return False


def gptqmodel_available() -> bool:
    """True when gptqmodel (and transformers/tokenizers) can be imported, i.e. fixtures can be built.
    Does not import gptqmodel (slow); tests can use it for a skip condition."""
    import importlib.util as iu
    return all(iu.find_spec(m) is not None for m in ("gptqmodel", "transformers", "tokenizers", "torch"))


def _ensure_fixtures_locked(root: Path, names: List[str], verbose: bool) -> Dict[str, object]:
    pids = prompt_ids()
    prompt_path = root / "prompt.json"
    if not prompt_path.exists() or json.loads(prompt_path.read_text()).get("prompt_ids") != pids:
        prompt_path.write_text(json.dumps({"prompt_ids": pids}) + "\n")

    result: Dict[str, object] = {"root": root, "prompt": prompt_path, "prompt_ids": pids,
                                 "bases": {}, "variants": {}}
    for name in names:
        spec = dict(VARIANTS[name])
        base_name = spec.pop("base")
        if base_name not in result["bases"]:
            result["bases"][base_name] = ensure_base(root, base_name)
        vdir = root / name
        ckpt = vdir / "ckpt"
        ref = vdir / "reference.safetensors"
        if not _done(vdir):
            t0 = time.perf_counter()
            if vdir.exists():
                shutil.rmtree(vdir)
            vdir.mkdir(parents=True)
            quantize_gptq(result["bases"][base_name], ckpt, **spec)
            gptq_reference(ckpt, ref, pids)
            _mark_done(vdir, {"kind": "gptq", "base": base_name, **spec})
            if verbose:
                print(f"built {name} in {time.perf_counter() - t0:.1f}s", flush=True)
        elif verbose:
            print(f"cached {name}", flush=True)
        result["variants"][name] = {"dir": vdir, "ckpt": ckpt, "reference": ref, "base": base_name, **spec}
    return result


def make_bundled_default(out_dir) -> Path:
    """The README's bundled example: GPTQ v1 4-bit sym g32 of the tiny Llama (same base model and
    calibration as the ``v1_b4_g32_sym`` fixture, so its model.safetensors is byte-identical to that
    fixture's), with config.json, generation_config.json, quantize_config.json, model.safetensors and
    the original tokenizer files; no quant_log.csv. About 0.5 MB."""
    import tempfile

    out = Path(out_dir)
    with tempfile.TemporaryDirectory(prefix="qconvert_bundled_") as tmp:
        base = build_tiny_llama(Path(tmp) / "base", **BASES["base"])
        ckpt = quantize_gptq(base, Path(tmp) / "ckpt", bits=4, group_size=32, sym=True,
                             desc_act=False, fmt="gptq")
        if out.exists():
            shutil.rmtree(out)
        out.parent.mkdir(parents=True, exist_ok=True)
        shutil.copytree(ckpt, out)
        # gptqmodel re-saves the tokenizer config with machine-local keys ("is_local",
        # "local_files_only", "fix_mistral_regex", pad_token); ship the clean originals instead.
        for name in _TOKENIZER_FILES:
            if (base / name).exists():
                shutil.copy2(base / name, out / name)
    _clean_checkpoint(out)
    return out


def sha256_tree(d) -> Dict[str, str]:
    """sha256 of every file under ``d`` (relative path -> hex), for reproducibility checks."""
    d = Path(d)
    return {str(p.relative_to(d)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(d.rglob("*")) if p.is_file()}


def load_reference(ref_path):
    """Read a reference file: returns ``(weights, logits)`` with ``weights`` = {module name:
    fp16 numpy ``[out, in]``} and ``logits`` = float32 numpy ``[1, T, vocab]``."""
    from safetensors.numpy import load_file
    t = load_file(str(ref_path))
    logits = t.pop("__logits__")
    return {k[: -len(".weight")]: v for k, v in t.items()}, logits


# --------------------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------------------
def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description="Build qconvert test fixtures (tiny model + gptqmodel checkpoints).")
    ap.add_argument("--root", default=str(DEFAULT_ROOT), help="fixture root (default tests/_fixtures)")
    ap.add_argument("--only", nargs="+", metavar="NAME", help=f"variants to build (default all): {', '.join(VARIANTS)}")
    ap.add_argument("--bundled", metavar="DIR", help="write the bundled default example checkpoint to DIR and exit")
    ap.add_argument("--list", action="store_true", help="list variant names and exit")
    args = ap.parse_args(argv)

    if args.list:
        for n, kw in VARIANTS.items():
            print(n, kw)
        return 0
    t0 = time.perf_counter()
    if args.bundled:
        out = make_bundled_default(args.bundled)
        files = sorted(p for p in out.rglob("*") if p.is_file())
        for p in files:
            print(f"  {p.relative_to(out)}  {p.stat().st_size} bytes")
        print(f"bundled example written to {out} in {time.perf_counter() - t0:.1f}s")
        return 0
    res = ensure_fixtures(args.root, args.only, verbose=True)
    for name, v in res["variants"].items():
        print(f"{name}: {v['ckpt']}  ref={v['reference']}")
    print(f"fixtures ready under {res['root']} in {time.perf_counter() - t0:.1f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
