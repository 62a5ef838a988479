"""The readers the fuzzer knows and the seeds each draws from: READER_SEEDS, one entry per reader (its CLI
format name, where its seeds are, and the conversion the oracle compares). Seeds are fixture folders under
common.FIXTURES (gptqmodel GPTQ/QQQ, hqq, mistral.rs UQFF, the dense base models, the FP8 / MXFP4 checkpoints
of tests/support/fixtures_float.py and fixtures_archs.py), the committed producer fixtures under
tests/producer_fixtures (AWQ, auto-round, bitsandbytes, compressed-tensors, MLX, ModelOpt) and the GGUF files
under --work (built by Fuzzer.build_gguf_seeds from gguf_builds() and LLAMA_BUILDS) or written by
tests/formats/gguf/test_gguf_reader.py.

A new reader's seeds are one entry in READER_SEEDS, e.g.

    "quark": ReaderSeeds("quark", producer("quark/*")),

(`producer` globs folders under tests/producer_fixtures, `fixture` under tests/_fixtures; target="gguf" when
the reader's checkpoints convert only to GGUF; see docs/fuzzing.md).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from . import common


# what a producer fixture folder holds beside the checkpoint (the producer's own dequantization, logits, the
# versions it was made with): not part of the input a user converts, so not copied into a case
PRODUCER_EXTRAS = ("reference.safetensors", "logits.safetensors", "loader.json", "oracle.json", "versions.json")


@dataclass
class Seed:
    name: str
    path: Path  # a folder, or a file (gguf)
    kind: str = "dir"  # "dir" | "file"
    ignore: tuple = ()  # names in the folder not copied into a case (PRODUCER_EXTRAS)


def is_done(d: Path) -> bool:
    return (d / ".done").exists()


def _fixture_seeds(reader: str) -> list[Seed]:
    out = []
    if reader in ("gptq", "gptq-v2"):
        want = "gptq_v2" if reader == "gptq-v2" else "gptq"
        for d in sorted(common.FIXTURES.glob("v[12]_*")):
            if is_done(d) and (d / "ckpt").is_dir():
                fmt = json.loads((d / ".done").read_text()).get("fmt")
                if fmt == want:
                    out.append(Seed(d.name, d / "ckpt"))
        rot = common.FIXTURES / "qqq" / "rot_b4_g128"
        if reader == "gptq" and is_done(rot):
            out.append(Seed("rot_b4_g128", rot / "ckpt"))
    elif reader == "qqq":
        for d in sorted((common.FIXTURES / "qqq").glob("qqq_*")):
            if is_done(d):
                out.append(Seed(d.name, d / "ckpt"))
    elif reader in ("hqq", "hqq-pt"):
        sub = "tf" if reader == "hqq" else "lib"
        for d in sorted((common.FIXTURES / "hqq").iterdir() if (common.FIXTURES / "hqq").is_dir() else []):
            if is_done(d) and (d / sub).is_dir() and not d.name.startswith("base_"):
                out.append(Seed(f"{d.name}/{sub}", d / sub))
    elif reader == "uqff":
        for d in sorted((common.FIXTURES / "uqff").iterdir() if (common.FIXTURES / "uqff").is_dir() else []):
            if is_done(d) and list(d.glob("*.uqff")):
                out.append(Seed(d.name, d))
    elif reader == "hf":
        for name, d in (("base", common.FIXTURES / "base"), ("hqq/base_qwen2", common.FIXTURES / "hqq" / "base_qwen2"),
                        ("uqff/wide", common.FIXTURES / "uqff" / "wide")):
            if is_done(d):
                out.append(Seed(name, d))
    return out


# GGUF seeds written by qconvert (from the fixtures) and llama.cpp: name -> (source reader, fixture, argv tail)
def gguf_builds() -> dict:
    return {"qconvert-q4_0": ("gptq", common.FIXTURES / "v1_b4_g32_sym" / "ckpt", []),
            "qconvert-q4_1": ("gptq", common.FIXTURES / "v1_b4_g32_asym_zp0" / "ckpt", []),
            "qconvert-q8_0": ("gptq", common.FIXTURES / "v1_b8_g128_sym" / "ckpt", []),
            "qconvert-f16": ("hf", common.FIXTURES / "base", ["--type", "f16"])}


LLAMA_BUILDS = {"llama-q4_k_m": 15, "llama-q6_k": 18, "llama-q2_k": 10}  # LlamaFileType, from uqff/wide as F32


def gguf_seed_dir(work: Path) -> Path:
    return work / "seeds" / "gguf"


def _gguf_seeds(work: Path) -> list[Seed]:
    d = gguf_seed_dir(work)
    out = [Seed(p.stem, p, "file") for p in sorted(d.glob("*.gguf")) if not p.stem.endswith(("-f32", ".part"))]
    made = common.FIXTURES / "gguf_reader"  # llama.cpp-made files of tests/formats/gguf/test_gguf_reader.py, when it has run
    for arch, names in (("llama", ("q4_k_m", "q6_k", "q3_k_m", "q5_1", "iq4_nl")), ("qwen3", ("q4_0",))):
        if is_done(made / arch):
            out += [Seed(f"gguf_reader/{arch}/{n}", made / arch / f"{n}.gguf", "file") for n in names
                    if (made / arch / f"{n}.gguf").exists()]
    return out


def _globbed(root_of, patterns: tuple, ignore: tuple):
    """Seeds: the folders matching the patterns under root_of() (read at call time: --fixtures may move it),
    named by their path under that root; a folder with a `.building` or `.tmp` suffix is not one."""
    def find(work: Path) -> list[Seed]:
        root = root_of()
        out = []
        for pattern in patterns:
            for d in sorted(root.glob(pattern)):
                if d.is_dir() and (d / "config.json").exists() and not d.name.endswith((".tmp", ".building")):
                    out.append(Seed(d.relative_to(root).as_posix(), d, "dir", ignore))
        return out
    return find


def producer(*patterns: str):
    """Folders under tests/producer_fixtures (committed checkpoints made by the real producer)."""
    return _globbed(lambda: common.REPO / "tests" / "producer_fixtures", patterns, PRODUCER_EXTRAS)


def fixture(*patterns: str):
    """Folders under the test fixtures (tests/_fixtures, or --fixtures)."""
    return _globbed(lambda: common.FIXTURES, patterns, ())


@dataclass(frozen=True)
class ReaderSeeds:
    fmt: str  # the format name the CLI is given (`FMT->hf`)
    find: Callable[[Path], list[Seed]]  # (the --work folder) -> the seeds
    # the conversion run on every case, whose output the oracle compares with the seed's: "hf" (--type f32), or
    # "gguf" (its default type) for a reader whose checkpoints convert only to GGUF
    target: str = "hf"


READER_SEEDS: dict[str, ReaderSeeds] = {
    # gptqmodel's GPTQ checkpoints of the test models, and of the 2026 families (scripts/producers/gptqmodel_archs.py)
    "gptq": ReaderSeeds("gptq", lambda work: _fixture_seeds("gptq") + producer("gptq_*/model")(work)),
    "gptq-v2": ReaderSeeds("gptq-v2", lambda work: _fixture_seeds("gptq-v2")),
    "qqq": ReaderSeeds("qqq", lambda work: _fixture_seeds("qqq")),
    "hqq": ReaderSeeds("hqq", lambda work: _fixture_seeds("hqq")),
    "hqq-pt": ReaderSeeds("hqq", lambda work: _fixture_seeds("hqq-pt")),
    "gguf": ReaderSeeds("gguf", _gguf_seeds),
    "uqff": ReaderSeeds("uqff", lambda work: _fixture_seeds("uqff")),
    "hf": ReaderSeeds("hf", lambda work: _fixture_seeds("hf")),
    # (awq/autoawq_gemm holds no tokenizer: its own conversion is refused, so it cannot be a seed)
    "awq": ReaderSeeds("awq", producer("awq/gemm_*", "awq/autoawq_gemv")),
    "auto-round": ReaderSeeds("auto-round", producer("auto_round/*")),
    # (nf4_cpu_forward_transposed_absmax is a file the reader refuses by design: not a seed)
    "bitsandbytes": ReaderSeeds("bitsandbytes", producer("bitsandbytes/fp4*", "bitsandbytes/int8",
                                                         "bitsandbytes/nf4_dq*")),
    # llm-compressor's checkpoints (and its ERNIE 4.5-MoE, scripts/producers/llmcompressor_archs.py)
    "compressed-tensors": ReaderSeeds("compressed-tensors", producer("compressed_tensors/*", "ct_*/model")),
    # mlx-lm's affine checkpoint (mlx/model) and its mxfp4 / mxfp8 ones (mlx/<mode>/model)
    "mlx": ReaderSeeds("mlx", producer("mlx/*", "mlx/*/model")),
    "modelopt": ReaderSeeds("modelopt", producer("modelopt/*")),
    # DeepSeek-V3-style FP8 in both block layouts (fixtures_float; the 117 MB `_big` one is too slow to copy)
    "fp8": ReaderSeeds("fp8", fixture("float/deepseek_fp8_deepseek", "float/deepseek_fp8_transformers*")),
    # gpt-oss's fused MXFP4 experts convert to GGUF only (->hf is refused naming that route)
    "mxfp4": ReaderSeeds("mxfp4", fixture("float/gpt_oss_mxfp4"), target="gguf"),
    "quark": ReaderSeeds("quark", producer("quark/*")),
    "torchao": ReaderSeeds("torchao", producer("torchao/*")),
}
READERS = {reader: entry.fmt for reader, entry in READER_SEEDS.items()}  # reader -> the CLI's format name


def seeds_for(reader: str, work: Path) -> list[Seed]:
    return sorted(READER_SEEDS[reader].find(work), key=lambda s: s.name)
