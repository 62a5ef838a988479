"""The seeds each reader draws from: fixture folders under common.FIXTURES (gptqmodel GPTQ/QQQ, hqq,
mistral.rs UQFF, the dense base models) and the GGUF files under --work (built by Fuzzer.build_gguf_seeds
from gguf_builds() and LLAMA_BUILDS) or written by tests/formats/gguf/test_gguf_reader.py.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from . import common


@dataclass
class Seed:
    name: str
    path: Path  # a folder, or a file (gguf)
    kind: str = "dir"  # "dir" | "file"


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


def seeds_for(reader: str, work: Path) -> list[Seed]:
    seeds = _gguf_seeds(work) if reader == "gguf" else _fixture_seeds(reader)
    return sorted(seeds, key=lambda s: s.name)
