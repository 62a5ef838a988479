"""The IQ conversions' fixtures, shared by tests/kernels/test_iq_vs_ggml.py and the type-specific test_iq4_xs.py and
test_iq3_s.py: per type, the tiny llama converted to it and to F32 (support/iq_cases.py build_tiny), and
llama-quantize's file of that type made from the F32 GGUF, each built once a session, when first asked for."""

from __future__ import annotations

import pytest

from iq_cases import FTYPE, build_tiny


@pytest.fixture(scope="session")
def iq_tiny(tmp_path_factory):
    """type -> build_tiny's dict (src, ours, f32, report, dir) for that type."""
    made: dict[str, dict] = {}

    def tiny(t: str) -> dict:
        if t not in made:
            made[t] = build_tiny(tmp_path_factory, t)
        return made[t]

    return tiny


@pytest.fixture(scope="session")
def iq_llama(iq_tiny):
    """type -> llama-quantize's GGUF of that type (LLAMA_FTYPE_MOSTLY_*) made from the tiny llama's F32 GGUF."""
    made = {}

    def llama(t: str):
        if t not in made:
            from llama_quantize import llama_quantize  # needs llama_cpp: the modules that ask for this skip without it

            tiny = iq_tiny(t)
            made[t] = llama_quantize(tiny["f32"], tiny["dir"] / f"llama-{t.lower()}.gguf", FTYPE[t])
        return made[t]

    return llama
