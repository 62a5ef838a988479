"""converters/validate.py: bounded JSON parsing and the typed, range-checked config getters. Every refusal
is a one-line BadInput naming the file and the key, so each test checks the whole line."""

from __future__ import annotations

import pytest

from qconvert.converters.errors import BadInput
from qconvert.converters.validate import (MAX_JSON_BYTES, MAX_JSON_DEPTH, MAX_SIDE_FILE_BYTES, ConfigView,
                                          check_side_files, parse_json, read_json)

PATH = "/models/m/config.json"


def refusal(fn) -> str:
    with pytest.raises(BadInput) as info:
        fn()
    return str(info.value)


# ---- parse_json / read_json -------------------------------------------------------------------------

@pytest.mark.parametrize("text, why", [
    ("[1,", "Expecting value at line 1 column 4"),
    ("NaN", "NaN is not a JSON number"),
    ('{"a": Infinity}', "Infinity is not a JSON number"),
    ("1" * 65, "a number of 65 characters"),  # quadratic-time int parsing stops at 64 characters
    ("1." + "1" * 63, "a number of 65 characters"),
    ("[" * (MAX_JSON_DEPTH + 1) + "]" * (MAX_JSON_DEPTH + 1), f"nested deeper than {MAX_JSON_DEPTH} levels"),
    ("[" * 5000 + "]" * 5000, f"nested deeper than {MAX_JSON_DEPTH} levels"),  # past the recursion limit
])
def test_parse_json_refuses_bad_or_unbounded_text(text, why):
    assert refusal(lambda: parse_json(text, PATH)) == f"{PATH}: not valid JSON ({why})"


def test_parse_json_accepts_the_bounds_themselves():
    nested = parse_json("[" * MAX_JSON_DEPTH + "]" * MAX_JSON_DEPTH, PATH)
    depth = 0
    while isinstance(nested, list):
        depth += 1
        nested = nested[0] if nested else None
    assert depth == MAX_JSON_DEPTH
    assert parse_json("9" * 64, PATH) == int("9" * 64)


def test_read_json_names_what_is_wrong_with_the_file(tmp_path):
    missing = tmp_path / "config.json"
    assert refusal(lambda: read_json(missing)) == f"{missing}: file not found"
    assert refusal(lambda: read_json(tmp_path)) == f"{tmp_path}: is a directory, expected a JSON file"

    not_utf8 = tmp_path / "latin1.json"
    not_utf8.write_bytes(b'{"name": "caf\xe9"}')
    assert refusal(lambda: read_json(not_utf8)) == f"{not_utf8}: not valid JSON (not UTF-8 at byte 13)"

    array = tmp_path / "array.json"
    array.write_text("[1, 2]")
    assert refusal(lambda: read_json(array)) == f"{array}: expected a JSON object, found an array"
    assert read_json(array, expect=list) == [1, 2]
    assert read_json(array, expect=None) == [1, 2]

    big = tmp_path / "big.json"
    big.write_text('{"a": "' + "x" * 100 + '"}')
    size = big.stat().st_size
    assert refusal(lambda: read_json(big, max_bytes=64)) == (
        f"{big}: JSON file of {size} bytes is larger than the 64 this reader accepts")
    assert read_json(big, max_bytes=size) == {"a": "x" * 100}


# ---- ConfigView ---------------------------------------------------------------------------------------

CONFIG = {"flag": True, "text": "5", "zero": 0, "inf": float("inf"), "long": "x" * 100, "null": None,
          "layers": 4, "eps": 1e-5, "whole": 1, "act": "silu", "tied": False, "ids": [1, 2],
          "quantization_config": {"bits": "4", "inner": {"sym": "yes"}}}


@pytest.fixture
def cfg():
    return ConfigView(CONFIG, PATH)


def test_typed_getters_return_the_value_when_it_fits(cfg):
    assert cfg.int("layers", lo=1, hi=8) == 4
    assert cfg.float("eps", lo=0.0, hi=1.0) == 1e-5
    whole = cfg.float("whole")
    assert whole == 1.0 and isinstance(whole, float)  # a JSON integer is a number too, returned as float
    assert cfg.str("act", choices=("silu", "gelu")) == "silu"
    assert cfg.bool("tied") is False
    assert cfg.list("ids") == [1, 2]
    assert cfg.view("quantization_config").data == CONFIG["quantization_config"]
    assert "layers" in cfg and "absent" not in cfg


def test_a_default_stands_for_a_missing_or_null_key(cfg):
    assert cfg.int("absent", default=7) == 7
    assert cfg.int("null", default=7) == 7  # null with a default reads as not given
    assert cfg.float("absent", default=None) is None
    assert cfg.view("absent", default=None) is None
    nested = cfg.view("absent", default={"bits": 8})
    assert isinstance(nested, ConfigView) and nested.int("bits") == 8


@pytest.mark.parametrize("read, line", [
    (lambda c: c.int("absent"), "absent is missing"),
    (lambda c: c.int("null"), "null is None: expected an integer"),  # present but null, without a default
    (lambda c: c.int("flag"), "flag is True: expected an integer"),  # a JSON boolean is no integer
    (lambda c: c.int("text", lo=1, hi=8), "text is '5': expected an integer in [1, 8]"),
    (lambda c: c.int("zero", lo=1), "zero is 0: expected an integer >= 1"),
    (lambda c: c.int("zero", hi=-1), "zero is 0: expected an integer <= -1"),
    (lambda c: c.int("layers", lo=1, hi=2), "layers is 4: expected an integer in [1, 2]"),
    (lambda c: c.float("flag"), "flag is True: expected a number"),
    (lambda c: c.float("inf", lo=0.0, hi=1.0), "inf is inf: expected a finite number in [0.0, 1.0]"),
    (lambda c: c.float("eps", lo=0.5), "eps is 1e-05: expected a finite number >= 0.5"),
    (lambda c: c.str("zero"), "zero is 0: expected a string"),
    (lambda c: c.str("text", choices=("a", "b")), "text is '5': expected one of 'a', 'b'"),
    (lambda c: c.bool("zero"), "zero is 0: expected true or false"),
    (lambda c: c.list("text"), "text is '5': expected a list"),
    (lambda c: c.view("text"), "text is '5': expected a JSON object"),
    (lambda c: c.view("quantization_config").int("bits"), "quantization_config.bits is '4': expected an integer"),
    (lambda c: c.view("quantization_config").int("group_size"), "quantization_config.group_size is missing"),
    (lambda c: c.view("quantization_config").view("inner").bool("sym"),
     "quantization_config.inner.sym is 'yes': expected true or false"),
])
def test_each_refusal_names_the_file_and_the_key(cfg, read, line):
    assert refusal(lambda: read(cfg)) == f"{PATH}: {line}"


def test_a_long_value_is_shown_shortened(cfg):
    shown = repr("x" * 100)[:57] + "..."
    assert refusal(lambda: cfg.int("long")) == f"{PATH}: long is {shown}: expected an integer"


@pytest.mark.parametrize("data, prefix, line", [
    ([1], "", "the file is an array, expected a JSON object"),
    ("x", "quantization_config.", "quantization_config is a string, expected a JSON object"),
    (None, "", "the file is null, expected a JSON object"),
])
def test_a_view_of_something_other_than_an_object_is_refused(data, prefix, line):
    assert refusal(lambda: ConfigView(data, PATH, prefix)) == f"{PATH}: {line}"


# ---- check_side_files --------------------------------------------------------------------------------

def test_side_files_that_parse_into_objects_pass(tmp_path):
    files = {"tokenizer.json": '{"model": {"type": "BPE"}}', "tokenizer_config.json": '{"chat_template": null}',
             "chat_template.json": '{"chat_template": "{{ x }}"}', "generation_config.json": "{}",
             "merges.txt": "#version: 0.2\n"}
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    check_side_files({name: tmp_path / name for name in files})


@pytest.mark.parametrize("name, text, why", [
    ("tokenizer.json", '{"model": {"type": "B', "not valid JSON (Unterminated string starting at line 1 column 20)"),
    ("tokenizer.json", "", "not valid JSON (Expecting value at line 1 column 1)"),
    ("tokenizer.json", '{"model": null}', "model is None: expected a JSON object"),
    ("tokenizer_config.json", "null", "expected a JSON object, found null"),
    ("tokenizer_config.json", '{"chat_template": {"a": 1}}',
     "chat_template is {'a': 1}: expected a string or a list of named templates"),
    ("special_tokens_map.json", '"<s>"', "expected a JSON object, found a string"),
])
def test_a_side_file_that_a_runtime_could_not_load_is_refused(tmp_path, name, text, why):
    (tmp_path / name).write_text(text)
    assert refusal(lambda: check_side_files({name: tmp_path / name})) == f"{tmp_path / name}: {why}"


@pytest.mark.parametrize("name, limit", [("tokenizer.json", MAX_JSON_BYTES), ("tokenizer.model", MAX_SIDE_FILE_BYTES)])
def test_an_absurdly_large_side_file_is_refused_without_reading_it(tmp_path, name, limit):
    path = tmp_path / name
    with open(path, "wb") as f:
        f.truncate(limit + 1)  # sparse: nothing is allocated, and the check only stats it
    line = refusal(lambda: check_side_files({name: path}))
    assert line.startswith(f"{path}: ") and f"{limit + 1} bytes is larger than the {limit}" in line


def test_a_side_file_that_is_a_folder_is_refused(tmp_path):
    (tmp_path / "tokenizer.model").mkdir()
    assert refusal(lambda: check_side_files({"tokenizer.model": tmp_path / "tokenizer.model"})) == (
        f"{tmp_path / 'tokenizer.model'}: is not a regular file, expected a tokenizer or template file")
