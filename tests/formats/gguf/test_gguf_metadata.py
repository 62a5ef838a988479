"""GGUF metadata, tokenizer and tensor names (formats/gguf/{metadata,tokenizer,names}.py).

The end-to-end checks write an all-F32 GGUF of the tiny fixture models with these helpers and run it
with llama-cpp-python: tokenization must equal the HF tokenizer's and logits must equal transformers'
(float32) within 1e-3. Everything is offline; the tiny models come from tests/support/fixtures.py.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from qconvert.converters.errors import BadInput, QConvertError
from qconvert.formats.gguf import tokenizer as gtok
from qconvert.formats.gguf.metadata import add_model_metadata
from qconvert.formats.gguf.config import config_from_gguf
from qconvert.formats.gguf.hparams import rope_freqs_tensor, rope_parameters
from qconvert.formats.gguf.names import (gguf_arch, gguf_tensor_name, hf_tensor_name, inverse_permutation,
                                         qk_row_permutation)
from qconvert.formats.gguf.tokenizer import (PRE_TOKENIZERS, add_tokenizer, detect_pre_tokenizer,
                                             tokenizer_files_from_gguf)

_FIXTURES_PATH = Path(__file__).parents[2] / "support" / "fixtures.py"
_spec = importlib.util.spec_from_file_location("qconvert_test_fixtures", _FIXTURES_PATH)
fixtures = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(fixtures)

TEXT = ("Hello world! The quick brown fox jumps over the lazy dog.\nNumbers: 0 1 2 42 128 3.14159 and "
        "20480000.\n\n  Indented  code:\tdef main():\n    print('hello, world')  \nIt's, we'll, they're "
        "DON'T shout!!  Unicode: naïve café — 日本語 ✓ 😀 done.  ")
PROMPT = "The quick brown fox jumps over the lazy dog. Hello world! 42 quantized weights, 3.14159"
LOGIT_TOL = 1e-3


# --------------------------------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------------------------------
def write_f32_gguf(model_dir: Path, out: Path, *, tensors: bool = True) -> Path:
    """All-F32 GGUF of an HF model dir, written only with the helpers under test."""
    from safetensors.torch import load_file

    config = json.loads((model_dir / "config.json").read_text())
    arch = gguf_arch(config)
    n_layers = int(config["num_hidden_layers"])
    state = load_file(str(model_dir / "model.safetensors"))
    n_vocab = int(state["model.embed_tokens.weight"].shape[0])
    w = gguf.GGUFWriter(str(out), arch)
    add_model_metadata(w, config, arch, file_type=gguf.LlamaFileType.ALL_F32, name="tiny")
    add_tokenizer(w, model_dir, config, n_vocab)
    if tensors:
        for hf_name in sorted(state):
            g = gguf_tensor_name(hf_name, arch, n_layers)
            assert g is not None, hf_name
            t = state[hf_name].float()
            perm = qk_row_permutation(hf_name, config, arch)
            if perm is not None:
                t = t[perm]
            w.add_tensor(g, t.contiguous().numpy())
        rf = rope_freqs_tensor(config)
        if rf is not None:
            w.add_tensor("rope_freqs.weight", rf)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file(progress=False)
    w.close()
    return out


def hf_ids(model_dir: Path, text: str) -> list[int]:
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(model_dir / "tokenizer.json")).encode(text).ids


def hf_logits(model_dir: Path, ids: list[int]) -> np.ndarray:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    model.eval()
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float().numpy()


def llama_load(path: Path, **kw):
    pytest.importorskip("llama_cpp")
    from qconvert.converters.apps.runtimes import llama_cpp_model

    args = dict(n_ctx=128, n_batch=128, logits_all=True, n_threads=2, verbose=False, type_k=0, type_v=0)
    args.update(kw)
    return llama_cpp_model(path, **args)


def llama_logits(llm, ids: list[int]) -> np.ndarray:
    llm.reset()
    llm.eval(ids)
    return np.array(llm.scores[: len(ids)], dtype=np.float32)


def edit_config(model_dir: Path, **changes) -> dict:
    cfg = json.loads((model_dir / "config.json").read_text())
    cfg.update(changes)
    (model_dir / "config.json").write_text(json.dumps(cfg, indent=2))
    return cfg


_MODEL_CACHE: dict = {}


def tiny_model(tmp_path_factory, arch: str, tie: bool = False) -> Path:
    key = (arch, tie)
    if key not in _MODEL_CACHE:
        d = tmp_path_factory.mktemp(f"{arch}{'_tied' if tie else ''}")
        _MODEL_CACHE[key] = fixtures.build_tiny_llama(d / "model", seed=1234, arch=arch, tie=tie)
    return _MODEL_CACHE[key]


def copy_model(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def check_roundtrip(model_dir: Path, gguf_path: Path, *, label: str) -> float:
    """Tokenization and logits of llama.cpp vs HF; returns max |Δlogit|."""
    llm = llama_load(gguf_path)
    ids_text = hf_ids(model_dir, TEXT)
    assert llm.tokenize(TEXT.encode(), add_bos=False, special=False) == ids_text
    ids = hf_ids(model_dir, PROMPT)
    assert 10 <= len(ids) <= 64
    ref = hf_logits(model_dir, ids)
    got = llama_logits(llm, ids)
    assert got.shape == ref.shape
    delta = float(np.abs(got - ref).max())
    print(f"\n[{label}] max |dlogit| = {delta:.3g} (logit range {float(ref.max() - ref.min()):.3g})")
    assert delta < LOGIT_TOL, f"{label}: max |dlogit| {delta}"
    return delta


# --------------------------------------------------------------------------------------------------
# 1. end to end with llama.cpp
# --------------------------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("arch,tie", [("llama", False), ("qwen2", False), ("qwen3", False), ("qwen2", True)])
def test_f32_gguf_matches_transformers(tmp_path_factory, tmp_path, arch, tie):
    pytest.importorskip("llama_cpp")
    model_dir = tiny_model(tmp_path_factory, arch, tie)
    path = write_f32_gguf(model_dir, tmp_path / f"{arch}.gguf")
    check_roundtrip(model_dir, path, label=f"{arch}{' tied' if tie else ''}")

    reader = gguf.GGUFReader(str(path))
    names = {t.name for t in reader.tensors}
    assert ("output.weight" in names) == (not tie)
    kv = {k: f.contents() for k, f in reader.fields.items()}
    assert kv["general.architecture"] == arch
    assert kv["general.file_type"] == int(gguf.LlamaFileType.ALL_F32)
    assert kv["general.quantization_version"] == 2
    assert kv["tokenizer.ggml.model"] == "gpt2" and kv["tokenizer.ggml.pre"] == "gpt-2"
    assert kv["tokenizer.ggml.bos_token_id"] == 1 and kv["tokenizer.ggml.eos_token_id"] == 0
    assert kv["tokenizer.ggml.add_bos_token"] is False
    assert reader.fields["tokenizer.ggml.token_type"].types[-1] == gguf.GGUFValueType.INT32
    if arch == "qwen3":
        assert kv["qwen3.attention.key_length"] == 32

    cfg = config_from_gguf(reader)
    src = json.loads((model_dir / "config.json").read_text())
    for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "max_position_embeddings", "vocab_size", "tie_word_embeddings",
                "bos_token_id", "eos_token_id"):
        assert cfg[key] == src[key], key
    assert cfg["head_dim"] == 32
    assert cfg["rms_norm_eps"] == pytest.approx(src["rms_norm_eps"], rel=1e-6)
    assert cfg["rope_theta"] == pytest.approx(rope_parameters(src)["rope_theta"])
    assert cfg["architectures"] == src["architectures"] and cfg["model_type"] == src["model_type"]


@pytest.mark.slow
def test_config_from_gguf_builds_the_same_model(tmp_path_factory, tmp_path):
    """The rebuilt config.json + the GGUF's tensors (Q/K un-permuted) reproduce the HF logits."""
    from transformers import AutoConfig, AutoModelForCausalLM

    model_dir = tiny_model(tmp_path_factory, "llama")
    path = write_f32_gguf(model_dir, tmp_path / "llama.gguf")
    reader = gguf.GGUFReader(str(path))
    cfg = config_from_gguf(reader)
    out = tmp_path / "rebuilt"
    out.mkdir()
    (out / "config.json").write_text(json.dumps(cfg))
    hf_cfg = AutoConfig.from_pretrained(str(out))
    model = AutoModelForCausalLM.from_config(hf_cfg, dtype=torch.float32)
    state = {}
    for t in reader.tensors:
        hf = hf_tensor_name(t.name, "llama", cfg["num_hidden_layers"])
        assert hf is not None, t.name
        x = torch.from_numpy(np.array(t.data, dtype=np.float32))
        perm = qk_row_permutation(hf, cfg, "llama")
        if perm is not None:
            x = x[inverse_permutation(perm)]
        state[hf] = x
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and all("rotary" in m for m in missing), (missing, unexpected)
    ids = hf_ids(model_dir, PROMPT)
    with torch.no_grad():
        got = model(torch.tensor([ids])).logits[0].numpy()
    assert np.abs(got - hf_logits(model_dir, ids)).max() < 1e-5


@pytest.mark.slow
def test_padded_vocab_tied_qwen2(tmp_path_factory, tmp_path):
    """Tokenizer of 480 tokens, embedding of 512 rows: the list is padded with [PAD{i}] UNUSED."""
    pytest.importorskip("llama_cpp")
    model_dir = copy_model(tiny_model(tmp_path_factory, "qwen2", True), tmp_path / "m")
    fixtures.build_tokenizer(model_dir, vocab_size=480)
    path = write_f32_gguf(model_dir, tmp_path / "padded.gguf")
    reader = gguf.GGUFReader(str(path))
    tokens = reader.fields["tokenizer.ggml.tokens"].contents()
    types = reader.fields["tokenizer.ggml.token_type"].contents()
    assert len(tokens) == 512
    assert tokens[480:] == [f"[PAD{i}]" for i in range(480, 512)]
    assert set(types[480:]) == {int(gguf.TokenType.UNUSED)}
    assert types[:2] == [int(gguf.TokenType.CONTROL)] * 2
    check_roundtrip(model_dir, path, label="qwen2 tied, vocab 480->512")


@pytest.mark.slow
def test_llama3_rope_scaling(tmp_path_factory, tmp_path):
    """llama-3 rope (rope_freqs tensor) with an original context short enough that low, medium and
    high frequencies all occur in head_dim 32."""
    pytest.importorskip("llama_cpp")
    model_dir = copy_model(tiny_model(tmp_path_factory, "llama"), tmp_path / "m")
    cfg = edit_config(model_dir, rope_parameters={
        "rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 64})
    rf = rope_freqs_tensor(cfg)
    assert rf.shape == (16,) and rf.dtype == np.float32
    assert rf[0] == 1.0 and rf[-1] == 8.0 and ((rf > 1) & (rf < 8)).any()
    # same factors as transformers' own llama3 inv_freq
    from transformers import AutoConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    inv_llama, _ = ROPE_INIT_FUNCTIONS["llama3"](AutoConfig.from_pretrained(str(model_dir)), "cpu")
    inv = 1.0 / (10000.0 ** (torch.arange(0, 32, 2, dtype=torch.float32) / 32))
    np.testing.assert_allclose(rf, (inv / inv_llama).numpy(), rtol=1e-5)
    check_roundtrip(model_dir, write_f32_gguf(model_dir, tmp_path / "l3.gguf"), label="llama rope llama3")


@pytest.mark.slow
def test_linear_rope_scaling(tmp_path_factory, tmp_path):
    pytest.importorskip("llama_cpp")
    model_dir = copy_model(tiny_model(tmp_path_factory, "qwen3"), tmp_path / "m")
    edit_config(model_dir, rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0})
    path = write_f32_gguf(model_dir, tmp_path / "lin.gguf")
    kv = {k: f.contents() for k, f in gguf.GGUFReader(str(path)).fields.items()}
    assert kv["qwen3.rope.scaling.type"] == "linear" and kv["qwen3.rope.scaling.factor"] == 4.0
    check_roundtrip(model_dir, path, label="qwen3 rope linear x4")


@pytest.mark.slow
def test_yarn_rope_scaling(tmp_path_factory, tmp_path, caplog):
    """yarn with transformers' defaults (attention factor 0.1 ln f + 1, beta 32/1) matches; other
    attention factors / betas are not read from GGUF by llama.cpp for these arches -> a warning."""
    pytest.importorskip("llama_cpp")
    model_dir = copy_model(tiny_model(tmp_path_factory, "qwen2"), tmp_path / "m")
    edit_config(model_dir, rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                            "original_max_position_embeddings": 64})
    with caplog.at_level("WARNING"):
        path = write_f32_gguf(model_dir, tmp_path / "yarn.gguf")
    assert "yarn" not in caplog.text
    kv = {k: f.contents() for k, f in gguf.GGUFReader(str(path)).fields.items()}
    assert kv["qwen2.rope.scaling.type"] == "yarn" and kv["qwen2.rope.scaling.original_context_length"] == 64
    check_roundtrip(model_dir, path, label="qwen2 rope yarn x4")
    edit_config(model_dir, rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                            "original_max_position_embeddings": 64, "beta_fast": 16.0,
                                            "attention_factor": 1.0})
    with caplog.at_level("WARNING"):
        write_f32_gguf(model_dir, tmp_path / "yarn2.gguf", tensors=False)
    assert "--yarn-beta-fast 16" in caplog.text and "--yarn-attn-factor 0.878" in caplog.text


# --------------------------------------------------------------------------------------------------
# tokenizers
# --------------------------------------------------------------------------------------------------
def _with_pre_tokenizer(model_dir: Path, name: str) -> None:
    """Rewrite a tokenizer.json so that its pre_tokenizer is the one real models of that llama.cpp
    pre-tokenizer name ship (Split regex + ByteLevel without regex, ...)."""
    p = model_dir / "tokenizer.json"
    tj = json.loads(p.read_text())
    tj["pre_tokenizer"] = gtok.pre_tokenizer_json(name)
    tj["model"]["ignore_merges"] = name in gtok._IGNORE_MERGES
    p.write_text(json.dumps(tj))


# text on which the supported splitters all disagree: digit runs, contractions, CamelCase, combining
# marks, runs of spaces and newlines, symbols
SPLIT_TEXTS = [
    TEXT,
    "x" * 3 + " 1234567 " + "\n\n\n" + "   end",
    "A  B\r\nC's 'quoted' \u00c0\u00c9\u00ce \u01c5 12ab34",
    "CamelCaseWords and HTTPServer2024 don't WON'T I'm they've we'd 3.14159 x=10**-3;",
    "cafe\u0301 nai\u0308ve re\u0301sume\u0301 Cafe\u0301 \u00e9\u0301 12345678901 //path/to\n\n  \tend!!?",
]
_SPLIT_CORPUS_EXTRA = [t for t in SPLIT_TEXTS for _ in range(30)] + [
    "The year 2024 had 365 days and 8760 hours; 1234567 is a number.",
    "It's what we'll do, they're sure I'm right and you've seen it. DON'T WON'T CAN'T",
    "getValue setValue HTTPServer XMLHttpRequest parseInt toString CamelCase",
    "re\u0301sume\u0301 cafe\u0301 nai\u0308ve co\u0308operate",
    "path/to/file.py\n\n    return x  \n\t\tdone", "a  b   c    d     e",
] * 20


_COMBINING_TEXT = 4
# llama.cpp's adaptations of these two regexes drop \p{M} from the letter classes (upstream
# src/llama-vocab.cpp), so text with combining marks splits differently there than in HF; the
# same holds for GGUFs made by llama.cpp's own converter. Everything else must match.
_NO_COMBINING_MARKS = {"tekken", "gpt-4o"}


def build_split_sensitive_tokenizer(out: Path, name: str, vocab_size: int = 1500) -> Path:
    """Byte-level BPE trained on whole lines (no split while training), so that its merges cross
    every boundary some splitter draws; then given the pre_tokenizer of llama.cpp name ``name``.
    The split then decides the tokens, which makes a wrong pre-tokenizer name visible."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2, show_progress=False,
                                  special_tokens=[fixtures.EOS_TOKEN, fixtures.BOS_TOKEN],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(fixtures._corpus(1500) + _SPLIT_CORPUS_EXTRA, trainer=trainer)
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps(fixtures._tokenizer_config()))
    _with_pre_tokenizer(out, name)
    return out


def write_vocab_gguf(tok_dir: Path, out: Path, pre_override: str | None = None) -> Path:
    """Metadata + tokenizer only (for llama.cpp's vocab_only load)."""
    tj = json.loads((tok_dir / "tokenizer.json").read_text())
    n = max(list(tj["model"]["vocab"].values()) + [a["id"] for a in tj["added_tokens"]]) + 1
    cfg = {"architectures": ["Qwen2ForCausalLM"], "hidden_size": 64, "num_attention_heads": 2,
           "num_key_value_heads": 2, "intermediate_size": 128, "num_hidden_layers": 1,
           "max_position_embeddings": 128, "rms_norm_eps": 1e-6, "vocab_size": n}
    w = gguf.GGUFWriter(str(out), "qwen2")
    add_model_metadata(w, cfg, "qwen2", file_type=0)
    add_tokenizer(w, tok_dir, cfg, n)
    if pre_override is not None:
        w.kv_data[0]["tokenizer.ggml.pre"].value = pre_override
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file(progress=False)
    w.close()
    return out


@pytest.mark.slow
def test_pre_tokenizer_table_tokenizes_like_hf(tmp_path):
    """Each supported name is detected from its tokenizer.json, loads in llama.cpp, and llama.cpp's
    split gives HF's token ids; with any *other* name of the table llama.cpp tokenizes differently
    (so the test would catch a wrong entry)."""
    pytest.importorskip("llama_cpp")
    from tokenizers import Tokenizer

    names = list(PRE_TOKENIZERS)
    dirs = {n: build_split_sensitive_tokenizer(tmp_path / f"tok_{n}", n) for n in names}
    for name, d in dirs.items():
        assert detect_pre_tokenizer(json.loads((d / "tokenizer.json").read_text())) == name
        ref_tok = Tokenizer.from_file(str(d / "tokenizer.json"))
        ref = [ref_tok.encode(t).ids for t in SPLIT_TEXTS]
        for other in names:
            path = write_vocab_gguf(d, tmp_path / f"{name}__{other}.gguf",
                                    pre_override=None if other == name else other)
            kv_pre = gguf.GGUFReader(str(path)).fields["tokenizer.ggml.pre"].contents()
            assert kv_pre == other
            llm = llama_load(path, vocab_only=True)
            got = [llm.tokenize(t.encode(), add_bos=False, special=False) for t in SPLIT_TEXTS]
            if other == name:
                for i, (t, g, r) in enumerate(zip(SPLIT_TEXTS, got, ref)):
                    if i == _COMBINING_TEXT and name in _NO_COMBINING_MARKS:
                        continue
                    assert g == r, (name, t)
            else:
                assert got != ref, f"llama.cpp pre {other!r} tokenizes like {name!r}: the test cannot tell them apart"
            del llm


def test_pre_tokenizer_detection_variants():
    bl = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}
    assert detect_pre_tokenizer({"pre_tokenizer": bl}) == "gpt-2"
    # tokenizers' own spelling of the GPT-2 regex (with a trailing |\s+) as an explicit Split
    split = {"type": "Split", "pattern": {"Regex": gtok.RE_GPT2 + r"|\s+"}, "behavior": "Isolated",
             "invert": False}
    assert detect_pre_tokenizer({"pre_tokenizer": {"type": "Sequence", "pretokenizers": [
        split, dict(bl, use_regex=False)]}}) == "gpt-2"
    assert detect_pre_tokenizer({"pre_tokenizer": {"type": "Sequence", "pretokenizers": [
        {"type": "Digits", "individual_digits": True}, bl]}}) == "starcoder"
    for name in PRE_TOKENIZERS:
        assert detect_pre_tokenizer({"pre_tokenizer": gtok.pre_tokenizer_json(name)}) == name
    # refused: unknown regex, regex + GPT-2 regex again, prefix space, whitespace splitter
    odd = dict(split, pattern={"Regex": r"\w+|[^\w\s]+"})
    for pt in ({"type": "Sequence", "pretokenizers": [odd, dict(bl, use_regex=False)]},
               {"type": "Sequence", "pretokenizers": [dict(split, pattern={"Regex": gtok.RE_LLAMA3}), bl]},
               dict(bl, add_prefix_space=True),
               {"type": "Sequence", "pretokenizers": [{"type": "WhitespaceSplit"}, dict(bl, use_regex=False)]},
               dict(bl, use_regex=False)):
        with pytest.raises(BadInput, match="cannot be stored in GGUF"):
            detect_pre_tokenizer({"pre_tokenizer": pt}, path="x/tokenizer.json")


def _writer(tmp_path: Path) -> gguf.GGUFWriter:
    return gguf.GGUFWriter(str(tmp_path / "t.gguf"), "llama")


def test_wordlevel_tokenizer_is_refused(tmp_path):
    d = fixtures.build_wordlevel_tokenizer(tmp_path / "wl")
    with pytest.raises(BadInput) as ei:
        add_tokenizer(_writer(tmp_path), d, {}, 512)
    assert ei.value.path == str(d / "tokenizer.json")
    assert "tokenizer model WordLevel cannot be stored in GGUF" in str(ei.value)
    assert "\n" not in str(ei.value)


def test_other_unstorable_tokenizers_are_refused(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    uni = tmp_path / "uni"
    uni.mkdir()
    t = Tokenizer(models.Unigram([("<unk>", 0.0), ("a", -1.0), ("b", -2.0), ("ab", -1.5)], unk_id=0))
    t.save(str(uni / "tokenizer.json"))
    with pytest.raises(BadInput, match="tokenizer model Unigram cannot be stored in GGUF") as ei:
        add_tokenizer(_writer(tmp_path), uni, {}, 8)
    assert ei.value.path == str(uni / "tokenizer.json")

    wp = tmp_path / "wp"
    wp.mkdir()
    t = Tokenizer(models.WordPiece({"[UNK]": 0, "a": 1, "##b": 2}, unk_token="[UNK]"))
    t.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    t.save(str(wp / "tokenizer.json"))
    with pytest.raises(BadInput, match="tokenizer model WordPiece cannot be stored in GGUF"):
        add_tokenizer(_writer(tmp_path), wp, {}, 8)

    # byte-level BPE with a splitter llama.cpp does not have
    odd = tmp_path / "odd"
    fixtures.build_tokenizer(odd)
    tj = json.loads((odd / "tokenizer.json").read_text())
    tj["pre_tokenizer"] = {"type": "Sequence", "pretokenizers": [
        {"type": "Split", "pattern": {"Regex": r"\w+|[^\w\s]+"}, "behavior": "Isolated", "invert": False},
        {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False}]}
    (odd / "tokenizer.json").write_text(json.dumps(tj))
    with pytest.raises(BadInput, match="unrecognised pre-tokenizer") as ei:
        add_tokenizer(_writer(tmp_path), odd, {}, 512)
    assert ei.value.path == str(odd / "tokenizer.json")

    # more tokens than embedding rows
    with pytest.raises(BadInput, match="512 token ids but the model's embedding has only 500 rows"):
        add_tokenizer(_writer(tmp_path), fixtures.build_tokenizer(tmp_path / "big"), {}, 500)


def test_missing_tokenizer_files(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(BadInput, match="no tokenizer.json or tokenizer.model") as ei:
        add_tokenizer(_writer(tmp_path), empty, {}, 512)
    assert ei.value.path == str(empty)


def test_sentencepiece_missing_names_pip_install(tmp_path, monkeypatch):
    import sys

    d = tmp_path / "spm"
    d.mkdir()
    (d / "tokenizer.model").write_bytes(b"\x00")
    monkeypatch.setitem(sys.modules, "sentencepiece", None)  # import raises ImportError
    with pytest.raises(QConvertError, match="pip install sentencepiece"):
        add_tokenizer(_writer(tmp_path), d, {}, 512)


def random_words(n: int = 300, seed: int = 0) -> str:
    import random

    rng = random.Random(seed)
    return " ".join("".join(rng.choice("etaoinshrdlucmwfgypbvkjxqz") for _ in range(rng.randint(3, 9)))
                    for _ in range(n))


def build_byte_fallback_tokenizer(out: Path, vocab_size: int = 512) -> Path:
    """A llama-2 style tokenizer.json: <unk> <s> </s>, 256 <0xNN> byte tokens, then BPE pieces with
    U+2581 for spaces (Prepend + Replace normalizer, no pre-tokenizer), byte_fallback, BOS added."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

    specials = ["<unk>", "<s>", "</s>"]
    byte_toks = [f"<0x{b:02X}>" for b in range(256)]
    trainer_tok = Tokenizer(models.BPE())
    trainer_tok.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"),
                                                   normalizers.Replace(" ", "\u2581")])
    trainer_tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="never",
                                                         split=True)
    n_pieces = vocab_size - len(specials) - len(byte_toks)
    trainer_tok.train_from_iterator(fixtures._corpus(), trainer=trainers.BpeTrainer(
        vocab_size=n_pieces, min_frequency=1, show_progress=False))
    trained = json.loads(trainer_tok.to_str())["model"]
    pieces = sorted(trained["vocab"], key=trained["vocab"].get)
    vocab = {t: i for i, t in enumerate(specials + byte_toks)}
    for p in pieces:
        vocab.setdefault(p, len(vocab))
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in trained["merges"]]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True,
                               fuse_unk=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")])
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    tok.add_special_tokens(specials)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                                       special_tokens=[("<s>", 1)])
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "add_bos_token": True, "add_eos_token": False, "bos_token": "<s>", "eos_token": "</s>",
        "unk_token": "<unk>", "tokenizer_class": "PreTrainedTokenizerFast"}))
    for f in ("special_tokens_map.json",):
        (out / f).unlink(missing_ok=True)
    return out


@pytest.mark.slow
def test_llama2_style_byte_fallback_tokenizer(tmp_path_factory, tmp_path):
    pytest.importorskip("llama_cpp")
    from tokenizers import Tokenizer

    model_dir = copy_model(tiny_model(tmp_path_factory, "llama"), tmp_path / "m")
    build_byte_fallback_tokenizer(model_dir)
    edit_config(model_dir, bos_token_id=1, eos_token_id=2)
    path = write_f32_gguf(model_dir, tmp_path / "spm.gguf")
    kv = {k: f.contents() for k, f in gguf.GGUFReader(str(path)).fields.items()}
    assert kv["tokenizer.ggml.model"] == "llama"
    assert (kv["tokenizer.ggml.bos_token_id"], kv["tokenizer.ggml.eos_token_id"],
            kv["tokenizer.ggml.unknown_token_id"]) == (1, 2, 0)
    assert kv["tokenizer.ggml.add_bos_token"] is True and kv["tokenizer.ggml.add_space_prefix"] is True
    types = kv["tokenizer.ggml.token_type"]
    assert types[0] == int(gguf.TokenType.UNKNOWN) and types[1:3] == [int(gguf.TokenType.CONTROL)] * 2
    assert set(types[3:259]) == {int(gguf.TokenType.BYTE)}
    assert "tokenizer.ggml.merges" not in kv and len(kv["tokenizer.ggml.scores"]) == 512

    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    llm = llama_load(path)
    # the corpus lines and random letter strings make the merge order matter: with flat scores
    # (what gguf's LlamaHfVocab writes) about a third of these lines tokenize differently
    for text in [TEXT, PROMPT, "hello  world\n\nthe   model", random_words()] + fixtures._corpus(600, seed=99):
        assert llm.tokenize(text.encode(), add_bos=False, special=False) == \
            tok.encode(text, add_special_tokens=False).ids, text
    # with BOS, as both sides add it by default
    assert llm.tokenize(PROMPT.encode()) == tok.encode(PROMPT).ids
    ids = tok.encode(PROMPT).ids
    delta = float(np.abs(llama_logits(llm, ids) - hf_logits(model_dir, ids)).max())
    assert delta < LOGIT_TOL

    # and back: GGUF -> tokenizer.json (merges rebuilt from the scores) tokenizes the same
    _check_llama_tokenizer_back(path, tmp_path / "back",
                                lambda t: tok.encode(t, add_special_tokens=False).ids, bos=1)


def _check_llama_tokenizer_back(gguf_path: Path, out: Path, ref_encode, bos: int) -> None:
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer

    tokenizer_files_from_gguf(gguf.GGUFReader(str(gguf_path)), out)
    back = Tokenizer.from_file(str(out / "tokenizer.json"))
    auto = AutoTokenizer.from_pretrained(str(out))
    for text in [TEXT, PROMPT, "hello  world\n\nthe   model", random_words()] + fixtures._corpus(300, seed=99):
        ref = ref_encode(text)
        assert back.encode(text, add_special_tokens=False).ids == ref, text
        assert auto(text, add_special_tokens=False)["input_ids"] == ref, text
    assert auto(PROMPT)["input_ids"] == [bos] + ref_encode(PROMPT)
    assert auto.decode(auto(PROMPT, add_special_tokens=False)["input_ids"]) == PROMPT


@pytest.mark.slow
def test_sentencepiece_tokenizer_model(tmp_path_factory, tmp_path):
    """A SentencePiece BPE tokenizer.model (byte_fallback, identity normalization) and no
    tokenizer.json: model "llama" via gguf.SentencePieceVocab; llama.cpp tokenizes like sentencepiece.
    Runs only where the optional sentencepiece package is installed."""
    spm = pytest.importorskip("sentencepiece")
    pytest.importorskip("llama_cpp")
    import io

    model_dir = copy_model(tiny_model(tmp_path_factory, "llama"), tmp_path / "m")
    for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        (model_dir / f).unlink(missing_ok=True)
    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(sentence_iterator=iter(fixtures._corpus()), model_writer=buf, vocab_size=512,
                                   model_type="bpe", byte_fallback=True, character_coverage=1.0,
                                   normalization_rule_name="identity", remove_extra_whitespaces=False, unk_id=0, bos_id=1, eos_id=2,
                                   pad_id=-1, minloglevel=2, num_threads=1)
    (model_dir / "tokenizer.model").write_bytes(buf.getvalue())
    edit_config(model_dir, bos_token_id=None, eos_token_id=None)
    sp = spm.SentencePieceProcessor(model_proto=buf.getvalue())
    path = write_f32_gguf(model_dir, tmp_path / "sp.gguf")
    kv = {k: f.contents() for k, f in gguf.GGUFReader(str(path)).fields.items()}
    assert kv["tokenizer.ggml.model"] == "llama" and len(kv["tokenizer.ggml.tokens"]) == 512
    assert (kv["tokenizer.ggml.unknown_token_id"], kv["tokenizer.ggml.bos_token_id"],
            kv["tokenizer.ggml.eos_token_id"]) == (0, 1, 2)
    assert kv["tokenizer.ggml.add_bos_token"] is True and kv["tokenizer.ggml.add_space_prefix"] is True
    llm = llama_load(path)
    for text in [TEXT, PROMPT, "hello  world\n\nthe   model", random_words()] + fixtures._corpus(300, seed=99):
        assert llm.tokenize(text.encode(), add_bos=False, special=False) == sp.encode(text), text
    ids = [1] + sp.encode(PROMPT)
    assert llm.tokenize(PROMPT.encode()) == ids
    delta = float(np.abs(llama_logits(llm, ids) - hf_logits(model_dir, ids)).max())
    assert delta < LOGIT_TOL
    _check_llama_tokenizer_back(path, tmp_path / "back", sp.encode, bos=1)


@pytest.mark.slow
def test_tokenizer_files_from_gguf(tmp_path_factory, tmp_path):
    """GGUF -> tokenizer.json/tokenizer_config.json that tokenizers and AutoTokenizer load and that
    tokenize like the original, including the padded [PAD] tail and a pre-tokenizer other than gpt-2."""
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer

    for name in ("gpt-2", "qwen2", "llama-bpe"):
        model_dir = copy_model(tiny_model(tmp_path_factory, "qwen2", True), tmp_path / f"m_{name}")
        fixtures.build_tokenizer(model_dir, vocab_size=500)
        if name != "gpt-2":
            _with_pre_tokenizer(model_dir, name)
        path = write_f32_gguf(model_dir, tmp_path / f"{name}.gguf", tensors=False)
        out = tmp_path / f"back_{name}"
        written = tokenizer_files_from_gguf(gguf.GGUFReader(str(path)), out)
        assert [p.name for p in written] == ["tokenizer.json", "tokenizer_config.json"]
        ref = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
        back = Tokenizer.from_file(str(out / "tokenizer.json"))
        assert back.get_vocab_size() == 512
        auto = AutoTokenizer.from_pretrained(str(out))
        for text in (TEXT, PROMPT):
            assert back.encode(text).ids == ref.encode(text).ids
            assert auto(text)["input_ids"] == ref.encode(text).ids
            assert auto.decode(auto(text)["input_ids"]) == text
        assert auto.bos_token == "<|bos|>" and auto.eos_token == "<|endoftext|>"
        assert auto.convert_tokens_to_ids("[PAD511]") == 511


def test_tokenizer_files_from_gguf_add_bos(tmp_path):
    from tokenizers import Tokenizer

    d = fixtures.build_tokenizer(tmp_path / "tok")
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    cfg["add_bos_token"] = True
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    w = gguf.GGUFWriter(str(tmp_path / "t.gguf"), "qwen2")
    add_tokenizer(w, d, {}, 512)
    fields = {k: v.value if hasattr(v, "value") else v for k, v in w.kv_data[0].items()}
    tokenizer_files_from_gguf(fields, tmp_path / "back")
    back = Tokenizer.from_file(str(tmp_path / "back" / "tokenizer.json"))
    ids = Tokenizer.from_file(str(d / "tokenizer.json")).encode(PROMPT).ids
    assert back.encode(PROMPT).ids == [1] + ids


# --------------------------------------------------------------------------------------------------
# metadata
# --------------------------------------------------------------------------------------------------
def _kv(writer: gguf.GGUFWriter) -> dict:
    return {k: v.value for k, v in writer.kv_data[0].items()}


def test_metadata_keys(tmp_path):
    cfg = {"architectures": ["Qwen3ForCausalLM"], "hidden_size": 1024, "num_attention_heads": 16,
           "num_key_value_heads": 8, "head_dim": 128, "intermediate_size": 3072, "num_hidden_layers": 28,
           "max_position_embeddings": 40960, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
           "vocab_size": 151936, "_name_or_path": "Qwen/Qwen3-0.6B",
           "rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}}
    arch = gguf_arch(cfg)
    w = gguf.GGUFWriter(str(tmp_path / "m.gguf"), arch)
    add_model_metadata(w, cfg, arch, file_type=gguf.LlamaFileType.MOSTLY_Q4_0)
    kv = _kv(w)
    assert kv["general.name"] == "Qwen3-0.6B"
    assert kv["qwen3.context_length"] == 40960 and kv["qwen3.embedding_length"] == 1024
    assert kv["qwen3.block_count"] == 28 and kv["qwen3.feed_forward_length"] == 3072
    assert kv["qwen3.attention.head_count"] == 16 and kv["qwen3.attention.head_count_kv"] == 8
    assert kv["qwen3.attention.key_length"] == 128 and kv["qwen3.attention.value_length"] == 128
    assert kv["qwen3.rope.freq_base"] == 1000000.0
    assert kv["qwen3.attention.layer_norm_rms_epsilon"] == pytest.approx(1e-6)
    assert kv["qwen3.rope.scaling.type"] == "yarn" and kv["qwen3.rope.scaling.factor"] == 4.0
    assert kv["qwen3.rope.scaling.original_context_length"] == 32768
    assert kv["general.file_type"] == int(gguf.LlamaFileType.MOSTLY_Q4_0)
    assert kv["general.quantization_version"] == 2
    assert "qwen3.vocab_size" not in kv and "qwen3.rope.dimension_count" not in kv
    with pytest.raises(BadInput, match="neither tokenizer.ggml.tokens nor a vocab_size"):
        config_from_gguf(kv)
    back = config_from_gguf(dict(kv, **{"tokenizer.ggml.tokens": ["t"] * 151936}))
    assert back["rope_scaling"] == {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}
    assert back["head_dim"] == 128 and back["vocab_size"] == 151936 and back["tie_word_embeddings"] is False

    llama = {"architectures": ["MistralForCausalLM"], "hidden_size": 4096, "num_attention_heads": 32,
             "num_key_value_heads": 8, "intermediate_size": 14336, "num_hidden_layers": 32,
             "max_position_embeddings": 32768, "rms_norm_eps": 1e-5, "rope_theta": 1e6, "vocab_size": 32000}
    w = gguf.GGUFWriter(str(tmp_path / "l.gguf"), "llama")
    add_model_metadata(w, llama, gguf_arch(llama), file_type=1, name="m")
    kv = _kv(w)
    assert kv["llama.vocab_size"] == 32000 and kv["llama.rope.dimension_count"] == 128
    assert "llama.attention.key_length" not in kv and "llama.rope.scaling.type" not in kv
    assert rope_freqs_tensor(llama) is None

    with pytest.raises(BadInput, match="rope_scaling type 'longrope'"):
        add_model_metadata(gguf.GGUFWriter(str(tmp_path / "x.gguf"), "llama"),
                           dict(llama, rope_scaling={"rope_type": "longrope", "factor": 2.0}), "llama", file_type=1)
    with pytest.raises(BadInput, match="lacks intermediate_size"):
        add_model_metadata(gguf.GGUFWriter(str(tmp_path / "y.gguf"), "llama"),
                           {k: v for k, v in llama.items() if k != "intermediate_size"}, "llama", file_type=1)


def test_rope_parameters_both_layouts():
    v4 = {"rope_theta": 5e5, "rope_scaling": {"type": "linear", "factor": 2.0}}
    v5 = {"rope_parameters": {"rope_theta": 5e5, "rope_type": "linear", "factor": 2.0}}
    for cfg in (v4, v5):
        rp = rope_parameters(cfg)
        assert rp["rope_theta"] == 5e5 and rp["rope_type"] == "linear" and rp["factor"] == 2.0
    assert rope_parameters({})["rope_type"] == "default" and rope_parameters({})["rope_theta"] == 10000.0
    # DeepSeek-V4 as transformers 5.24 saves it (gptqmodel's checkpoints): "compress" (the compressed KV's base)
    # first, then "main", the model's rope.freq_base
    dsv4 = {"rope_theta": 1e4, "rope_parameters": {"compress": {"rope_theta": 160000.0, "rope_type": "default"},
                                                   "main": {"rope_theta": 1e4, "rope_type": "default"},
                                                   "rope_theta": 1e4, "rope_type": "default"}}
    assert rope_parameters(dsv4)["rope_theta"] == 1e4


# --------------------------------------------------------------------------------------------------
# 3. names and the Q/K permutation
# --------------------------------------------------------------------------------------------------
def test_arch_detection():
    assert gguf_arch({"architectures": ["LlamaForCausalLM"]}) == "llama"
    assert gguf_arch({"architectures": ["MistralForCausalLM"]}) == "llama"
    assert gguf_arch({"architectures": ["Qwen2ForCausalLM"]}) == "qwen2"
    assert gguf_arch({"model_type": "qwen3"}) == "qwen3"
    with pytest.raises(QConvertError) as ei:
        gguf_arch({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"})
    msg = str(ei.value)
    assert "GPT2LMHeadModel" in msg and "LlamaForCausalLM" in msg and "Qwen3ForCausalLM" in msg


@pytest.mark.parametrize("arch,tie", [("llama", False), ("qwen2", False), ("qwen3", False), ("qwen2", True)])
def test_every_tensor_maps(tmp_path_factory, arch, tie):
    from safetensors import safe_open

    model_dir = tiny_model(tmp_path_factory, arch, tie)
    with safe_open(str(model_dir / "model.safetensors"), "pt") as f:
        names = list(f.keys())
    seen = set()
    for n in names:
        g = gguf_tensor_name(n, arch, 2)
        assert g is not None, n
        assert g not in seen
        seen.add(g)
        assert hf_tensor_name(g, arch, 2) == n
    assert ("output.weight" in seen) == (not tie)
    if arch == "qwen3":
        assert {"blk.0.attn_q_norm.weight", "blk.1.attn_k_norm.weight"} <= seen
    if arch == "qwen2":
        assert {"blk.0.attn_q.bias", "blk.0.attn_k.bias", "blk.0.attn_v.bias"} <= seen
    assert gguf_tensor_name("model.layers.0.self_attn.rotary_emb.inv_freq", arch, 2) is None
    assert gguf_tensor_name("model.layers.0.self_attn.q_proj.qweight", arch, 2) is None
    assert hf_tensor_name("rope_freqs.weight", arch, 2) is None


def _spec_permute(w: torch.Tensor, n: int) -> torch.Tensor:
    # what llama.cpp's convert_hf_to_gguf.py does to q_proj / k_proj rows (LlamaModel.permute), written out here
    return w.reshape(n, 2, w.shape[0] // n // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _spec_unpermute(w: torch.Tensor, n: int) -> torch.Tensor:
    return w.reshape(n, w.shape[0] // n // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


@pytest.mark.parametrize("n_head,n_kv,head_dim,hidden", [(4, 2, 32, 128), (32, 8, 128, 4096), (8, 8, 64, 256),
                                                         (32, 8, 128, 5120)])
def test_qk_permutation_matches_spec(n_head, n_kv, head_dim, hidden):
    cfg = {"num_attention_heads": n_head, "num_key_value_heads": n_kv, "hidden_size": hidden,
           "head_dim": head_dim}
    g = torch.Generator().manual_seed(0)
    for proj, n in (("q_proj", n_head), ("k_proj", n_kv)):
        rows = n * head_dim
        for suffix in ("weight", "bias", "qweight", "scales"):
            perm = qk_row_permutation(f"model.layers.1.self_attn.{proj}.{suffix}", cfg, "llama")
            assert perm.dtype == torch.long and sorted(perm.tolist()) == list(range(rows))
        w = torch.randn(rows, 48, generator=g)
        b = torch.randn(rows, generator=g)
        perm = qk_row_permutation(f"model.layers.1.self_attn.{proj}.weight", cfg, "llama")
        assert torch.equal(w[perm], _spec_permute(w, n))
        assert torch.equal(b[perm], _spec_permute(b, n))
        inv = inverse_permutation(perm)
        assert torch.equal(w[perm][inv], w)
        assert torch.equal(w[perm][inv], _spec_unpermute(_spec_permute(w, n), n))
        assert torch.equal(perm[inv], torch.arange(rows))
    for other in ("model.layers.0.self_attn.v_proj.weight", "model.layers.0.self_attn.o_proj.weight",
                  "model.layers.0.mlp.up_proj.weight", "model.embed_tokens.weight"):
        assert qk_row_permutation(other, cfg, "llama") is None
    for arch in ("qwen2", "qwen3"):
        assert qk_row_permutation("model.layers.0.self_attn.q_proj.weight", cfg, arch) is None

