"""The scaffolding the producer scripts beside this file share: paths, the import path, offline environments,
the producers' own venvs, tests/support/fixtures.py and its tiny base model, and the JSON and safetensors files they write.

Each script keeps what is its own: its producer's calls, its variants and its oracle. Everything here imports
only the standard library at module level (torch and safetensors inside the functions that need them), so that a
script can be imported, or run with --help, in any python.

The scripts import it as `_common`, a name that shadows no package, with this folder on sys.path for that one
import, and then call leave_import_path(); see the top of any of them. (Loading it by path instead would need the
same few importlib lines in every script, and two loads would make two modules.)
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
PRODUCER_FIXTURES = REPO / "tests" / "producer_fixtures"
# the base's files a producer's save may leave out or rewrite with machine-local keys: copied as they are
SIDE_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json")
# what every producer runs under: nothing downloads, no tokenizer thread pool
OFFLINE = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}


# -- the import path and the environment --------------------------------------------------------------------

def leave_import_path() -> None:
    """Take this folder off sys.path. Python puts a script's own folder first on it, and the scripts here are
    named after the packages they drive (awq.py, bitsandbytes.py, mlx.py, ...): gptqmodel importing bitsandbytes,
    or AutoAWQ's `awq`, would get a sibling script. Every entry that resolves here goes, "" too when the working
    directory is this folder."""
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != HERE]


def offline_defaults(**extra: str) -> None:
    """OFFLINE (and `extra`) in this process's environment, where the caller has not set them already."""
    for key, value in {**OFFLINE, **extra}.items():
        os.environ.setdefault(key, value)


def offline_env(**extra: str) -> dict:
    """This process's environment with OFFLINE and `extra` forced: for a child process."""
    return dict(os.environ, **OFFLINE, **extra)


def in_venv(venv: Path) -> bool:
    return Path(sys.prefix).resolve() == venv.resolve()


def ensure_venv(venv: Path, torch_pin: str, *installs: list[str], constrain_torch: bool = False) -> Path:
    """venv's python, the venv made first if it is missing: torch alone first (the CPU build), then one
    `pip install -q` per entry of `installs`; with constrain_torch, under a constraints file (venv/torch-pin.txt)
    that holds torch_pin, so that no later install swaps that build."""
    py = venv / "bin" / "python"
    if not py.exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        subprocess.run([str(py), "-m", "pip", "install", "-q", torch_pin], check=True)  # the CPU build first
        constraint = []
        if constrain_torch:
            pin = venv / "torch-pin.txt"
            pin.write_text(torch_pin + "\n")
            constraint = ["-c", str(pin)]
        for args in installs:
            subprocess.run([str(py), "-m", "pip", "install", "-q", *constraint, *args], check=True)
    return py


def rerun(py: Path, script: str, argv: list[str], **extra_env: str) -> int:
    """Run `script argv` again under the python `py` (a producer's own venv), offline: its exit code."""
    return subprocess.run([str(py), script, *argv], env=offline_env(**extra_env)).returncode


def parser(doc: str) -> argparse.ArgumentParser:
    """A script's command line, described by its docstring's first line."""
    return argparse.ArgumentParser(description=doc.splitlines()[0])


def variant_parser(doc: str, variants, reference_help: str | None = None) -> argparse.ArgumentParser:
    """The options the variant producers share (awq.py, bitsandbytes.py): --only NAME (repeatable) makes those of
    the committed `variants` only, --reference CKPT OUT only recomputes the producer's oracle of CKPT into OUT."""
    ap = parser(doc)
    ap.add_argument("--only", action="append", choices=sorted(variants))
    ap.add_argument("--reference", nargs=2, metavar=("CKPT", "OUT"), help=reference_help)
    return ap


# -- tests/support/fixtures.py and the tiny base model --------------------------------------------------------------

def load_by_path(name: str, path: Path):
    """The module in the file `path`, executed anew under `name` (not registered in sys.modules)."""
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def fixtures():
    """tests/support/fixtures.py (the tiny models, prompt and calibration ids), loaded by path as the tests load it: tests/
    is no package. The one place that names the file. Loading it sets its offline defaults in os.environ."""
    return load_by_path("qconvert_test_fixtures", REPO / "tests" / "support" / "fixtures.py")


def tiny_llama_with_layers(fx, out: Path, n_layers: int, **build_kwargs) -> Path:
    """fx.build_tiny_llama(out, **build_kwargs) built with n_layers decoder layers from the start (fx's config
    builder with one field changed), so its random weights differ from tiny_llama_first_layer's cut."""
    original = fx._model_config

    def fewer_layers(arch, tie):
        config, cls = original(arch, tie)
        config.num_hidden_layers = n_layers
        return config, cls

    fx._model_config = fewer_layers
    try:
        return fx.build_tiny_llama(out, **build_kwargs)
    finally:
        fx._model_config = original


def tiny_llama_first_layer(out: Path, per_layer_keys: tuple[str, ...] = (), **build_kwargs) -> Path:
    """tests/support/fixtures.py's tiny llama (2 decoder layers) built into `out` with build_kwargs, then cut to its
    first decoder layer: layer 1's tensors removed, config.json's num_hidden_layers 1 and each list named in
    per_layer_keys (one entry a layer, such as layer_types) cut to its first entry."""
    from safetensors.torch import load_file, save_file

    fixtures().build_tiny_llama(out, **build_kwargs)
    tensors = {k: v for k, v in load_file(str(out / "model.safetensors")).items() if ".layers.1." not in k}
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((out / "config.json").read_text())
    cfg["num_hidden_layers"] = 1
    for key in per_layer_keys:
        if isinstance(cfg.get(key), list):
            cfg[key] = cfg[key][:1]
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    return out


def copy_side_files(base: Path, out: Path, names=SIDE_FILES) -> None:
    """The base's own files among `names` into the checkpoint `out`, over what the producer saved."""
    for name in names:
        if (base / name).exists():
            shutil.copy2(base / name, out / name)


# -- what the producers write --------------------------------------------------------------------------------

def write_json(path: Path, obj, indent: int = 1, sort_keys: bool = True) -> None:
    """`obj` as JSON with a final newline (the committed files' form: indent 1, sorted keys, unless told)."""
    Path(path).write_text(json.dumps(obj, indent=indent, sort_keys=sort_keys) + "\n")


def package_versions(*packages: str) -> dict:
    """{package: installed version} in this python, in the order given."""
    from importlib.metadata import version

    return {p: version(p) for p in packages}


def write_versions(folder: Path, producer: str, packages, **fields) -> None:
    """folder/versions.json: the producer, the versions of `packages`, and `fields`."""
    write_json(Path(folder) / "versions.json", {"producer": producer, **package_versions(*packages), **fields})


def save_reference(weights: dict, model, prompt, ref_path: Path, source: str) -> Path:
    """A producer's oracle file: `weights` (its own dequantized weights, "<module>.weight") and `__logits__`, float32
    [1, T, vocab], of `prompt` through the loaded `model`, saved to ref_path (its folder made) with metadata source."""
    import torch
    from safetensors.torch import save_file

    with torch.inference_mode():
        ids = torch.tensor([list(prompt)], dtype=torch.long)
        logits = model(input_ids=ids).logits.float().contiguous()
    ref_path = Path(ref_path)
    ref_path.parent.mkdir(parents=True, exist_ok=True)
    save_file({**weights, "__logits__": logits}, str(ref_path), metadata={"source": source})
    return ref_path


def tensor_digest(w) -> dict:
    """A tensor as oracle.json records it: dtype, shape and the sha256 of its bytes (a bit-for-bit oracle that
    keeps the folder small)."""
    import torch

    w = w.detach().contiguous().cpu()
    raw = w.view(torch.uint8) if w.element_size() > 1 else w
    return {"dtype": str(w.dtype)[6:], "shape": list(w.shape),
            "sha256": hashlib.sha256(raw.numpy().tobytes()).hexdigest()}


def make_cases(out: Path, names, tmp_prefix: str, build_base, produce, oracle, packages) -> None:
    """The oracle.json producers' run (compressed_tensors.py, modelopt.py): the base built once into a temporary
    folder; per case, produce(name, base, out/name) and oracle.json of oracle(out/name) beside it, its size printed;
    out/versions.json (the versions of `packages`) last."""
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=tmp_prefix) as tmp:
        base = build_base(Path(tmp) / "base")
        for name in names:
            case = out / name
            produce(name, base, case)
            write_json(case / "oracle.json", oracle(case))
            print(f"{name}: {sum(p.stat().st_size for p in case.iterdir())} bytes", flush=True)
    write_json(out / "versions.json", package_versions(*packages))
