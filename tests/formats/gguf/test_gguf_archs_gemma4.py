"""GGUF for Gemma 4 (llama.cpp's gemma4, issue 26) in both of its layouts, judged by llama.cpp itself on tiny
random Gemma4ForCausalLM models of six layers (sliding x3, full, sliding, full; head_dim 32 on the sliding
layers, global_head_dim 64 and the proportional rope on the full ones; soft-capped logits):

- gemma4_moe (26B-A4B style): the dense MLP and 4 routed experts (top 2) in every layer, the router's input
  scale and per-expert output scales, the full layers reusing their keys as values with one KV head;
- gemma4_ple (E2B/E4B style): per-layer embeddings, the last two layers reading the KV of layers 2 and 3 (no
  k/v projections of their own) with a double-wide MLP.

For each:
- `hf->gguf --type f32` writes every tensor (name, type, bytes) and every `gemma4.*` key that llama.cpp's own
  converter writes (rope_freqs, the per-layer arrays), and llama.cpp's logits on the two files are identical;
  they follow transformers within 0.02 (ggml's GELU: the gap gemma2/gemma3 show too);
- `--type q8_0` and `--type q4_k_m` (256 wide: K types) equal llama-quantize's bytes of our F32 file;
- `gguf->hf` loads in transformers as Gemma4ForCausalLM with the source's config fields and logits (0 apart).

Gemma4ForConditionalGeneration (the released checkpoints' class; gemma4_vl: the MoE text model beside vision and
audio towers) is written as its text model, as llama.cpp's converter writes it: the same checks on that file, its
towers dropped with a note, and `gguf->hf` gives Gemma4ForCausalLM with the multimodal model's text logits.
gemma4_vl_ple is that class with E2B's layout (gemma4_ple's text model) and a tokenizer of Gemma 4's own kind
(byte-fallback BPE, written as the converter's `gemma4` tokenizer model): the same checks, every tokenizer key
byte for byte, llama.cpp tokenizing as transformers does, and q8_0 / q4_k_m equal to llama-quantize's bytes.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

import fixtures_archs
from gguf_arch_files import cached as _cached
from helpers import gguf_tensors, llama_logits, run_cli
from llama_quantize import llama_quantize

llama_cpp = pytest.importorskip("llama_cpp")
gguf = pytest.importorskip("gguf")

ROOT = Path(__file__).parents[2] / "_fixtures" / "archs"
KINDS = fixtures_archs.GEMMA4_KINDS
PROMPT = fixtures_archs.arch_prompt()
LAYERS = 6


def model_dir(kind: str, wide: bool = False) -> Path:
    name = f"gemma4-{kind}" + ("-wide" if wide else "")
    return _cached(ROOT / name, lambda d: fixtures_archs.build_arch_model(d, kind, layers=LAYERS, wide=wide))


def ours_f32(kind: str, wide: bool = False) -> Path:
    """Our F32 file, with its per-tensor report beside it (<file>.report.json)."""
    src = model_dir(kind, wide)

    def build(out: Path) -> None:
        run_cli("hf->gguf", src, out, "--type", "f32", "--report", out.with_name(out.name + ".report.json"))

    return _cached(src.with_name(src.name + "-f32.gguf"), build)


def reference_f32(kind: str) -> Path:
    import llama_cpp_reference as ref

    try:
        ref.llama_cpp_src()
    except FileNotFoundError as e:
        pytest.skip(f"llama.cpp's converter is not extracted: {e}")  # a failure under QCONVERT_REQUIRE_ORACLES
    refs = {k: ROOT / f"gemma4-{k}-ref.gguf" for k in KINDS}
    if not all(p.with_name(p.name + ".done").exists() for p in refs.values()):
        # both layouts in one converter process (torch and the converter imported once)
        ref.convert_references([(model_dir(k), p, f"tiny {k}") for k, p in refs.items()])
        for p in refs.values():
            p.with_name(p.name + ".done").write_text("ok")
    return refs[kind]


def _model_keys(path: Path) -> dict:
    r = gguf.GGUFReader(str(path))
    return {k: f.contents() for k, f in r.fields.items() if not k.startswith(("GGUF.", "general.", "tokenizer."))}


def _dims(shape) -> list[int]:
    """ggml's dimensions as llama-quantize writes them (ggml_n_dims: trailing 1s dropped)."""
    dims = [int(d) for d in shape]
    while len(dims) > 1 and dims[-1] == 1:
        dims.pop()
    return dims


def _same_tensors(ours: Path, theirs: Path, exact_dims: bool = True) -> set[str]:
    """Both files hold the same tensors, each of the same ggml type, shape and bytes; -> the types present."""
    a, b = gguf_tensors(ours), gguf_tensors(theirs)
    assert sorted(a) == sorted(b)
    dims = (lambda s: [int(d) for d in s]) if exact_dims else _dims
    for name in a:
        assert (a[name].tensor_type, dims(a[name].shape)) == (b[name].tensor_type, dims(b[name].shape)), name
        assert bytes(a[name].data) == bytes(b[name].data), name
    return {t.tensor_type.name for t in a.values()}


@pytest.mark.parametrize("kind", KINDS)
def test_f32_is_what_llama_cpp_converter_writes_and_runs(kind):
    ours, theirs = ours_f32(kind), reference_f32(kind)
    assert _same_tensors(ours, theirs) == {"F32"}
    keys = _model_keys(ours)
    assert keys == _model_keys(theirs)
    assert gguf.GGUFReader(str(ours)).fields["general.architecture"].contents() == "gemma4"
    names = set(gguf_tensors(ours))
    # the layout's own tensors and keys are there (and the other layout's are not)
    assert "rope_freqs.weight" in names and "output.weight" not in names
    assert keys["gemma4.attention.sliding_window_pattern"] == [True, True, True, False, True, False]
    assert (keys["gemma4.attention.key_length"], keys["gemma4.attention.key_length_swa"]) == (64, 32)
    if kind == "gemma4_moe":
        assert {"blk.3.ffn_gate_up_exps.weight", "blk.3.ffn_down_exps.weight", "blk.3.ffn_down_exps.scale",
                "blk.3.ffn_gate_inp.weight", "blk.3.ffn_gate_inp.scale", "blk.3.ffn_gate.weight",
                "blk.3.pre_ffw_norm_2.weight", "blk.3.layer_output_scale.weight"} <= names
        assert "blk.3.attn_v.weight" not in names and "blk.2.attn_v.weight" in names  # keys as values
        assert keys["gemma4.attention.head_count_kv"] == [2, 2, 2, 1, 2, 1]
        assert not any(n.startswith("per_layer") for n in names)
    else:
        assert {"per_layer_token_embd.weight", "per_layer_model_proj.weight", "per_layer_proj_norm.weight",
                "blk.5.inp_gate.weight", "blk.5.proj.weight", "blk.5.post_norm.weight"} <= names
        assert "blk.4.attn_k.weight" not in names and "blk.5.attn_v.weight" not in names  # KV-shared layers
        assert keys["gemma4.feed_forward_length"] == [256] * 4 + [512] * 2
        assert keys["gemma4.attention.shared_kv_layers"] == 2
        assert not any("_exps" in n for n in names)
    results = json.loads(ours.with_name(ours.name + ".report.json").read_text())["tensors"]
    assert all(t["verdict"] == "exact" and t["max_abs_err"] == 0 for t in results)

    got = llama_logits(ours, PROMPT)
    assert np.array_equal(got, llama_logits(theirs, PROMPT))  # the same file to llama.cpp
    want = fixtures_archs.transformers_logits(model_dir(kind), PROMPT)
    # ggml's GELU (a float16 table on CPU) against torch's: measured 0.009 (MoE) and 0.006 (PLE)
    assert np.abs(got - want).max() < 0.02, float(np.abs(got - want).max())
    assert (got.argmax(-1) == want.argmax(-1)).mean() >= 0.9
    assert want.std(axis=-1).min() > 0.3  # far from uniform: a wrong weight would show


@pytest.mark.parametrize("kind", KINDS + ("gemma4_vl_ple",))
@pytest.mark.parametrize("preset, ftype, wide", [("q8_0", 7, False), ("q4_k_m", 15, True)])
def test_quantized_equals_llama_quantize(kind, preset, ftype, wide, tmp_path):
    """llama-quantize's per-tensor types and bytes (the fused expert stacks, the per-layer embeddings, the
    Q4_K_M mix's Q6_K choices), from our F32 file; 256 wide for the K types. gemma4_vl_ple: the multimodal class
    with E2B's layout, its towers dropped before either quantizes."""
    f32 = ours_f32(kind, wide)
    ours = tmp_path / f"ours-{preset}.gguf"
    run_cli("hf->gguf", model_dir(kind, wide), ours, "--type", preset, "--allow-requant")
    theirs = llama_quantize(f32, tmp_path / f"llama-{preset}.gguf", ftype)
    types = _same_tensors(ours, theirs, exact_dims=False)
    assert ({"Q8_0"} if preset == "q8_0" else {"Q4_K", "Q6_K"}) <= types
    a = gguf_tensors(ours)
    assert all(a[n].tensor_type.name == "F32" for n in a if n.endswith((".scale", "layer_output_scale.weight",
                                                                        "rope_freqs.weight")))
    if preset == "q8_0":
        assert np.array_equal(llama_logits(ours, PROMPT), llama_logits(theirs, PROMPT))
    if preset == "q8_0" and kind == "gemma4_moe":
        # read back: the fused Q8_0 expert stacks (3-D, which no 2-D grid record holds) come back whole as
        # gguf-py's float32 decoding, the 2-D weights too
        from safetensors.torch import load_file

        run_cli("gguf->hf", ours, tmp_path / "hf", "--type", "f32")
        back = load_file(str(tmp_path / "hf" / "model.safetensors"))
        for g, h in (("blk.3.ffn_gate_up_exps.weight", "model.layers.3.experts.gate_up_proj"),
                     ("blk.3.ffn_down_exps.weight", "model.layers.3.experts.down_proj"),
                     ("blk.3.attn_q.weight", "model.layers.3.self_attn.q_proj.weight")):
            assert a[g].tensor_type.name == "Q8_0", g
            want = gguf.quants.dequantize(np.asarray(a[g].data), a[g].tensor_type).reshape(tuple(back[h].shape))
            assert np.array_equal(want, back[h].numpy()), h


@pytest.mark.parametrize("kind", KINDS)
def test_gguf_to_hf_gives_back_the_source_class(kind, tmp_path):
    out = tmp_path / "hf"
    run_cli("gguf->hf", ours_f32(kind), out, "--type", "f32")
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["Gemma4ForCausalLM"]
    from transformers import AutoConfig

    # as transformers reads them (defaults filled in; per_layer_config: each full layer's head size and KV heads)
    back, source = (AutoConfig.from_pretrained(str(d)).to_dict() for d in (out, model_dir(kind)))
    for key in ("layer_types", "head_dim", "num_key_value_heads", "sliding_window", "final_logit_softcapping",
                "num_kv_shared_layers", "hidden_size_per_layer_input", "use_double_wide_mlp", "attention_k_eq_v",
                "enable_moe_block", "num_experts", "top_k_experts", "moe_intermediate_size", "rope_parameters",
                "per_layer_config", "intermediate_size", "vocab_size_per_layer_input"):
        assert back[key] == source[key], key
    got = fixtures_archs.transformers_logits(out, PROMPT)
    want = fixtures_archs.transformers_logits(model_dir(kind), PROMPT)
    assert np.abs(got - want).max() == 0, float(np.abs(got - want).max())  # the same float32 weights


def test_kv_sharing_llama_cpp_cannot_follow_is_a_caveat(tmp_path):
    """llama.cpp gives a shared sliding layer the KV of the layer two before the first shared one and a shared
    full layer that of the one just before; layer kinds that put them elsewhere get one warning naming the key,
    and the file is still written."""
    src = tmp_path / "src"
    shutil.copytree(model_dir("gemma4_ple"), src)
    config = json.loads((src / "config.json").read_text())
    config["layer_types"] = ["sliding_attention", "sliding_attention", "full_attention"] * 2
    config["per_layer_config"] = {"2": {"head_dim": 64}, "5": {"head_dim": 64}}
    (src / "config.json").write_text(json.dumps(config))
    # layer 2 (full) must hold the full layers' weights: the source's layer 3 and 2 swap kinds
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(src / "model.safetensors"))
    swapped = {}
    for name, t in tensors.items():
        for a, b in ((".layers.2.", ".layers.3."), (".layers.3.", ".layers.2.")):
            if a in name:
                name = name.replace(a, b)
                break
        swapped[name] = t
    save_file(swapped, str(src / "model.safetensors"), metadata={"format": "pt"})
    out = tmp_path / "out.gguf"
    proc = run_cli("hf->gguf", src, out, "--type", "f32")
    warned = [line for line in proc.stderr.splitlines() if "num_kv_shared_layers" in line]
    assert len(warned) == 1 and "layer 4" in warned[0] and "llama.cpp" in warned[0], proc.stderr
    assert out.is_file()


def test_multimodal_class_is_written_as_its_text_model(tmp_path):
    """Gemma4ForConditionalGeneration (the released checkpoints' class: gemma4_moe's text model under
    model.language_model., vision and audio towers beside it): llama.cpp's converter writes its text model as gemma4 and
    leaves the tower to its --mmproj run; so does qconvert, byte for byte, each tower tensor dropped with a note;
    llama.cpp's logits on the two files are the same, and `gguf->hf` gives the text model's class
    (Gemma4ForCausalLM) with the multimodal model's text logits."""
    import llama_cpp_reference as ref

    kind = "gemma4_vl"
    src = model_dir(kind)
    theirs = _cached(ROOT / f"gemma4-{kind}-ref.gguf",
                     lambda out: ref.convert_reference(src, out, model_name=f"tiny {kind}"))
    ours, report = tmp_path / "ours.gguf", tmp_path / "report.json"
    run_cli("hf->gguf", src, ours, "--type", "f32", "--report", report)
    assert _same_tensors(ours, theirs) == {"F32"}
    assert _model_keys(ours) == _model_keys(theirs)
    assert gguf.GGUFReader(str(ours)).fields["general.architecture"].contents() == "gemma4"
    planned = json.loads(report.read_text())["tensors"]
    dropped = {t["name"] for t in planned if t["target"] == "dropped"}
    towers = {t["name"] for t in planned if t["name"].startswith(("model.vision_tower.", "model.embed_vision.",
                                                                  "model.audio_tower.", "model.embed_audio."))}
    assert dropped == towers and {"model.embed_vision.embedding_projection.weight",
                                  "model.embed_audio.embedding_projection.weight"} <= towers
    # the audio tower's unclipped linears hold inf bounds: a dropped tensor's values reach nothing, so no refusal
    assert "model.audio_tower.layers.0.feed_forward1.ffw_layer_1.input_max" in towers
    assert all("mmproj" in t["reason"] for t in planned if t["target"] == "dropped")
    assert {"blk.3.ffn_gate_up_exps.weight", "blk.3.ffn_down_exps.scale", "rope_freqs.weight"} <= set(
        gguf_tensors(ours))

    from transformers import Gemma4ForConditionalGeneration
    import torch

    model = Gemma4ForConditionalGeneration.from_pretrained(str(src), dtype=torch.float32, attn_implementation="eager")
    with torch.no_grad():  # text only: the text model's logits
        want = model(input_ids=torch.tensor([PROMPT])).logits[0].float().numpy()
    got = llama_logits(ours, PROMPT)
    assert np.array_equal(got, llama_logits(theirs, PROMPT))
    # ggml's GELU against torch's, as the causal LMs' (measured max 0.0068, mean 0.0008); that the text path is
    # the causal LM's own is shown exactly below (gguf->hf's Gemma4ForCausalLM: 0 apart)
    assert np.abs(got - want).max() < 0.02, float(np.abs(got - want).max())
    assert (got.argmax(-1) == want.argmax(-1)).mean() >= 0.9
    assert want.std(axis=-1).min() > 0.3
    out = tmp_path / "hf"
    run_cli("gguf->hf", ours, out, "--type", "f32")
    assert json.loads((out / "config.json").read_text())["architectures"] == ["Gemma4ForCausalLM"]
    back = fixtures_archs.transformers_logits(out, PROMPT)
    assert np.abs(back - want).max() == 0, float(np.abs(back - want).max())


# strings with runs of spaces, tabs, newlines, bytes no merge covers, CJK and an emoji (byte fallback), and the
# chat markers (added special tokens)
TOKENIZER_TEXTS = ["The quick brown fox jumps over the lazy dog.", "Hello  world!\n\n  indented\tand tabs",
                   "naïve ünïcode — 你好 🙂", "<|turn>user\nWhat is 3.14159?<turn|>\n<|turn>model\n",
                   " leading space", "def main():\n    print('hello, world')\n"]


# Gemma4ForConditionalGeneration as E2B / E4B are released (fixtures_archs: gemma4_ple's text model beside vision and
# audio towers, with a tokenizer of Gemma 4's own kind)
VL_PLE = "gemma4_vl_ple"


def vl_ple_reference() -> Path:
    import llama_cpp_reference as ref

    return _cached(ROOT / f"gemma4-{VL_PLE}-ref.gguf",
                   lambda out: ref.convert_reference(model_dir(VL_PLE), out, model_name=f"tiny {VL_PLE}"))

def _tokenizer_fields(path: Path) -> dict:
    """Every tokenizer.* key of a GGUF as its bytes in the file (name, value type, values)."""
    r = gguf.GGUFReader(str(path))
    return {k: b"".join(bytes(p) for p in f.parts) for k, f in r.fields.items() if k.startswith("tokenizer.")}


def test_gemma4_tokenizer_is_the_converters(tmp_path):
    """A tokenizer of Gemma 4's kind (the E2B fixture's) is written as llama.cpp's converter writes it (model
    `gemma4`: the merges, scores -1000, its token types, no space prefix, <bos> added), every tokenizer key byte
    for byte; llama.cpp tokenizes with it as transformers does, and so does the tokenizer read back from it."""
    from transformers import AutoTokenizer

    ours, theirs = ours_f32(VL_PLE), vl_ple_reference()
    a, b = _tokenizer_fields(ours), _tokenizer_fields(theirs)
    assert sorted(a) == sorted(b)
    for key in b:
        assert a[key] == b[key], key
    fields = gguf.GGUFReader(str(ours)).fields
    assert fields["tokenizer.ggml.model"].contents() == "gemma4" and "tokenizer.ggml.pre" not in fields
    assert set(fields["tokenizer.ggml.scores"].contents()) == {-1000.0}
    want = [AutoTokenizer.from_pretrained(str(model_dir(VL_PLE))).encode(t) for t in TOKENIZER_TEXTS]
    assert all(w[0] == 2 for w in want) and any(len(w) > 12 for w in want)  # <bos> added, merges at work
    llm = llama_cpp.Llama(str(ours), vocab_only=True, verbose=False)
    try:
        assert [llm.tokenize(t.encode(), add_bos=True, special=True) for t in TOKENIZER_TEXTS] == want
    finally:
        llm.close()
    # read back (what `gguf->hf` writes beside the weights), in process: the round trip of the weights is the
    # causal and MoE multimodal tests' above
    from qconvert.formats.gguf.tokenizer import tokenizer_files_from_gguf

    tokenizer_files_from_gguf(gguf.GGUFReader(str(ours)), tmp_path)
    back = AutoTokenizer.from_pretrained(str(tmp_path))
    assert [back.encode(t) for t in TOKENIZER_TEXTS] == want


def test_e2b_multimodal_class_is_written_as_its_text_model():
    """Gemma4ForConditionalGeneration with E2B's text layout (per-layer embeddings, KV-shared layers with the
    double-wide MLP) beside vision and audio towers: written as llama.cpp's converter writes its text model, byte
    for byte (tensors, gemma4.* keys), the towers dropped; llama.cpp's logits on the two files identical and
    within ggml's GELU of transformers' multimodal model (`gguf->hf` of this layout: gemma4_ple's round trip)."""
    from transformers import Gemma4ForConditionalGeneration
    import torch

    src, ours, theirs = model_dir(VL_PLE), ours_f32(VL_PLE), vl_ple_reference()
    assert _same_tensors(ours, theirs) == {"F32"}
    keys = _model_keys(ours)
    assert keys == _model_keys(theirs)
    names = set(gguf_tensors(ours))
    assert {"per_layer_token_embd.weight", "per_layer_model_proj.weight", "blk.5.inp_gate.weight"} <= names
    assert "blk.4.attn_k.weight" not in names and "blk.5.attn_v.weight" not in names  # KV-shared layers
    assert keys["gemma4.attention.shared_kv_layers"] == 2
    assert keys["gemma4.feed_forward_length"] == [256] * 4 + [512] * 2  # the shared layers' double-wide MLP
    planned = json.loads(ours.with_name(ours.name + ".report.json").read_text())["tensors"]
    dropped = {t["name"] for t in planned if t["target"] == "dropped"}
    assert dropped and all(n.startswith(("model.vision_tower.", "model.embed_vision.", "model.audio_tower.",
                                         "model.embed_audio.")) for n in dropped)
    assert all(t["verdict"] == "exact" and t["max_abs_err"] == 0 for t in planned if t["target"] != "dropped")

    model = Gemma4ForConditionalGeneration.from_pretrained(str(src), dtype=torch.float32, attn_implementation="eager")
    with torch.no_grad():
        want = model(input_ids=torch.tensor([PROMPT])).logits[0].float().numpy()
    got = llama_logits(ours, PROMPT)
    assert np.array_equal(got, llama_logits(theirs, PROMPT))
    assert np.abs(got - want).max() < 0.02, float(np.abs(got - want).max())  # ggml's GELU, as the causal LMs'
    assert (got.argmax(-1) == want.argmax(-1)).mean() >= 0.9
    assert want.std(axis=-1).min() > 0.3
