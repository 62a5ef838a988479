"""Tokenizer <-> GGUF ``tokenizer.ggml.*`` metadata, without transformers.

Writing (:func:`add_tokenizer`) supports what llama.cpp can run:

* byte-level BPE ``tokenizer.json`` (GPT-2 / llama-3 / qwen2 style) -> model ``gpt2``: tokens,
  INT32 token types, merges and ``tokenizer.ggml.pre``. The pre-tokenizer name is inferred from
  tokenizer.json's ``pre_tokenizer`` (its split regexes, see :data:`PRE_TOKENIZERS`), not from the
  reference converter's hash table; an unknown splitter is refused instead of written.
* llama-2 style HF ``tokenizer.json`` (BPE with ``byte_fallback``) -> model ``llama``: tokens, scores
  (from the merge ranks) and types derived from the json itself.
* Gemma 4's byte-fallback BPE ``tokenizer.json`` -> model ``gemma4`` (the architecture's
  ``byte_fallback_tokenizer``): tokens, merges, scores -1000 and types as its converter writes them.
* SentencePiece ``tokenizer.model`` -> model ``llama`` through ``gguf.SentencePieceVocab`` (needs the
  optional ``sentencepiece`` package, imported lazily).

Special token ids, ``add_bos``/``add_eos`` and the chat template go through ``gguf.SpecialVocab``.
The token list is padded to the embedding rows with ``[PAD{i}]`` tokens of type UNUSED.

Reading back (:func:`tokenizer_files_from_gguf`) writes a ``tokenizer.json`` + ``tokenizer_config.json``
that ``tokenizers`` / ``transformers.AutoTokenizer`` load, for ``gpt2``, ``llama`` and ``gemma4`` models.
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path
from typing import Any, Mapping, Sequence

import gguf

from ...converters.errors import BadInput, QConvertError
from ...converters.validate import json_kind, read_json
from .config import field_values

__all__ = [
    "PRE_TOKENIZERS",
    "add_tokenizer",
    "detect_pre_tokenizer",
    "pre_tokenizer_json",
    "tokenizer_files_from_gguf",
]

logger = logging.getLogger(__name__)

TT = gguf.TokenType

# --------------------------------------------------------------------------------------------------
# Pre-tokenizer table
# --------------------------------------------------------------------------------------------------
# Split regexes exactly as they appear in tokenizer.json (after JSON decoding). llama.cpp applies
# each pre-tokenizer name's regexes one after the other, like a tokenizers ``Sequence`` of splits;
# the names and the regexes they stand for are those of llama.cpp's src/llama-vocab.cpp.

#: GPT-2's split (what ``ByteLevel(use_regex=True)`` applies); tokenizers' built-in copy ends in
#: ``|\s+``, which llama.cpp's lacks but which matches nothing the rest leaves over.
RE_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
RE_LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
             r"|\s*[\r\n]+|\s+(?!\S)|\s+")
RE_QWEN2 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
            r"|\s*[\r\n]+|\s+(?!\S)|\s+")
RE_QWEN35 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+"
             r"[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
RE_TEKKEN = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
             r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
             r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
RE_GPT4O = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
            r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
            r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
            r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
            r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
RE_DIGIT = r"\p{N}"

#: llama.cpp ``tokenizer.ggml.pre`` name -> the sequence of split regexes it applies.
PRE_TOKENIZERS: dict[str, tuple[str, ...]] = {
    "gpt-2": (RE_GPT2,),
    "llama-bpe": (RE_LLAMA3,),
    "qwen2": (RE_QWEN2,),
    "qwen35": (RE_QWEN35,),
    "tekken": (RE_TEKKEN,),
    "gpt-4o": (RE_GPT4O,),
    "starcoder": (RE_DIGIT, RE_GPT2),
}
#: names whose llama.cpp tokenizer looks a whole pre-token up in the vocabulary before merging
_IGNORE_MERGES = {"llama-bpe", "tekken"}

# equivalent spellings of a split step, mapped to the canonical regex above
_REGEX_ALIASES = {
    RE_GPT2 + r"|\s+": RE_GPT2,
    r"\p{N}{1}": RE_DIGIT,
}
_ALLOWED_BPE_NORMALIZERS = {"NFC"}


class _Unsupported(Exception):
    pass


def _split_steps(pt: Mapping | None) -> list[str]:
    """tokenizer.json ``pre_tokenizer`` -> the list of split regexes it applies, in order."""
    if pt is None:
        return []
    typ = pt.get("type")
    if typ == "Sequence":
        steps: list[str] = []
        for sub in pt.get("pretokenizers") or []:
            steps += _split_steps(sub)
        return steps
    if typ == "ByteLevel":
        if pt.get("add_prefix_space"):
            raise _Unsupported("ByteLevel(add_prefix_space=True) (llama.cpp never adds a prefix space "
                               "to byte-level BPE input)")
        return [RE_GPT2] if pt.get("use_regex", True) else []
    if typ == "Split":
        pattern = pt.get("pattern") or {}
        if "Regex" not in pattern:
            raise _Unsupported(f"Split on a plain string {pattern.get('String')!r}")
        if pt.get("behavior", "Isolated") != "Isolated" or pt.get("invert", False):
            raise _Unsupported(f"Split with behavior {pt.get('behavior')!r}, invert {pt.get('invert')!r}")
        rx = pattern["Regex"]
        return [_REGEX_ALIASES.get(rx, rx)]
    if typ == "Digits":
        return [RE_DIGIT] if pt.get("individual_digits") else [r"\p{N}+"]
    raise _Unsupported(f"pre-tokenizer {typ}")


def detect_pre_tokenizer(tokenizer_json: Mapping, path: object | None = None) -> str:
    """llama.cpp ``tokenizer.ggml.pre`` name for a byte-level BPE tokenizer.json, inferred from its
    ``pre_tokenizer`` (the split regexes and their order, see :data:`PRE_TOKENIZERS`).

    Raises :class:`BadInput` when the splitter is not one llama.cpp implements (it would load, or
    fail to load, with a different split and tokenize differently from the source model).
    """
    pt = tokenizer_json.get("pre_tokenizer")
    try:
        steps = tuple(_split_steps(pt))
    except _Unsupported as e:
        raise BadInput(f"byte-level BPE tokenizer with {e} cannot be stored in GGUF: llama.cpp has no "
                       "matching pre-tokenizer", path=path) from None
    for name, known in PRE_TOKENIZERS.items():
        if steps == known:
            return name
    shown = " then ".join(steps) if steps else "no split at all"
    raise BadInput(f"unrecognised pre-tokenizer split ({shown}) cannot be stored in GGUF: no llama.cpp "
                   f"pre-tokenizer matches it (known: {', '.join(PRE_TOKENIZERS)})", path=path)


# --------------------------------------------------------------------------------------------------
# tokenizer.json -> token lists
# --------------------------------------------------------------------------------------------------
def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _check_tokenizer_json(tj: Mapping, path: Path) -> None:
    """The parts of tokenizer.json that this module and gguf's SpecialVocab read, checked for shape
    before either walks them: a wrong type stops here with one line naming the file and the key."""
    def bad(where: str, value: Any, expected: str) -> BadInput:
        return BadInput(f"{where} is {json_kind(value)} {_show(value)}: expected {expected}", path=path)

    def obj(value: Any, where: str, nullable: bool = True) -> Mapping | None:
        if value is None and nullable:
            return None
        if not isinstance(value, dict):
            raise bad(where, value, "an object" + (" or null" if nullable else ""))
        return value

    def objects(value: Any, where: str) -> list:
        if value is None:
            return []
        if not isinstance(value, list):
            raise bad(where, value, "a list of objects")
        for i, item in enumerate(value):
            obj(item, f"{where}[{i}]", nullable=False)
        return value

    def string(parent: Mapping, key: str, where: str) -> None:
        if key in parent and parent[key] is not None and not isinstance(parent[key], str):
            raise bad(f"{where}.{key}", parent[key], "a string")

    model = obj(tj.get("model"), "model", nullable=False)
    string(model, "type", "model")
    string(model, "unk_token", "model")
    vocab = model.get("vocab")
    if _model_type(model) == "BPE" and vocab is not None and not isinstance(vocab, dict):
        raise bad("model.vocab", vocab, "an object of token ids (a BPE vocabulary)")
    if isinstance(vocab, dict):
        for tok, tid in vocab.items():
            if isinstance(tid, bool) or not isinstance(tid, int) or tid < 0:
                raise bad(f"model.vocab[{_show(tok)}]", tid, "a token id (an integer >= 0)")
    elif vocab is not None and not isinstance(vocab, list):
        raise bad("model.vocab", vocab, "an object of token ids")
    merges = model.get("merges")
    if merges is not None:
        if not isinstance(merges, list):
            raise bad("model.merges", merges, "a list")
        for i, m in enumerate(merges):
            ok = (isinstance(m, str) and " " in m) or (
                isinstance(m, list) and len(m) == 2 and all(isinstance(s, str) for s in m))
            if not ok:
                raise bad(f"model.merges[{i}]", m, 'a merge "a b" or ["a", "b"]')
    added = tj.get("added_tokens")
    for i, at in enumerate(objects(added, "added_tokens")):
        tid, content = at.get("id"), at.get("content")
        if isinstance(tid, bool) or not isinstance(tid, int) or tid < 0:
            raise bad(f"added_tokens[{i}].id", tid, "a token id (an integer >= 0)")
        if not isinstance(content, str):
            raise bad(f"added_tokens[{i}].content", content, "a string")
        if "special" in at and not isinstance(at["special"], bool):
            raise bad(f"added_tokens[{i}].special", at["special"], "true or false")

    def walk(node: Any, where: str, child_key: str) -> None:
        """A (possibly nested) pre_tokenizer / normalizer / post_processor; the depth is bounded by read_json."""
        node = obj(node, where)
        if node is None:
            return
        string(node, "type", where)
        if node.get("type") == "Sequence" or child_key in node:
            for i, sub in enumerate(objects(node.get(child_key), f"{where}.{child_key}")):
                walk(sub, f"{where}.{child_key}[{i}]", child_key)
        if "pattern" in node:
            pattern = obj(node["pattern"], f"{where}.pattern")
            for key in ("Regex", "String"):
                if pattern is not None:
                    string(pattern, key, f"{where}.pattern")
        for key in ("replacement", "prepend", "content", "behavior", "prepend_scheme"):
            string(node, key, where)
        for key in ("single", "pair"):
            for i, item in enumerate(objects(node.get(key), f"{where}.{key}")):
                for part in ("SpecialToken", "Sequence"):
                    if part in item:
                        obj(item[part], f"{where}.{key}[{i}].{part}", nullable=False)

    walk(tj.get("pre_tokenizer"), "pre_tokenizer", "pretokenizers")
    walk(tj.get("normalizer"), "normalizer", "normalizers")
    walk(tj.get("post_processor"), "post_processor", "processors")


def _check_side_json(model_dir: Path) -> None:
    """tokenizer_config.json / chat_template.json, which gguf's SpecialVocab reads too: objects."""
    for name in ("tokenizer_config.json", "chat_template.json"):
        p = model_dir / name
        if p.is_file():
            read_json(p)


def _model_type(model: Mapping) -> str:
    t = model.get("type")
    if t:
        return str(t)
    # very old tokenizer.json files omit the tag
    if "merges" in model:
        return "BPE"
    if isinstance(model.get("vocab"), list):
        return "Unigram"
    return "WordLevel" if "unk_token" in model else "unknown"


def _token_table(tj: Mapping, n_vocab: int, path: Path) -> tuple[list[str], list[int], dict[int, bool]]:
    """tokens and types by id (holes and the tail up to ``n_vocab`` become ``[PAD{i}]`` UNUSED);
    also ``{id: special}`` for added tokens."""
    vocab = tj["model"].get("vocab") or {}
    entries: dict[int, str] = {int(i): tok for tok, i in vocab.items()}
    added: dict[int, bool] = {}
    for at in tj.get("added_tokens") or []:
        i = int(at["id"])
        entries[i] = at["content"]
        added[i] = bool(at.get("special", False))
    if not entries:
        raise BadInput("tokenizer.json has an empty vocabulary", path=path)
    size = max(entries) + 1
    if size > n_vocab:
        raise BadInput(f"tokenizer has {size} token ids but the model's embedding has only {n_vocab} rows",
                       path=path)
    tokens: list[str] = []
    types: list[int] = []
    for i in range(n_vocab):
        tok = entries.get(i)
        if tok is None:
            tokens.append(f"[PAD{i}]")
            types.append(int(TT.UNUSED))
        elif i in added:
            tokens.append(tok)
            types.append(int(TT.CONTROL if added[i] else TT.USER_DEFINED))
        else:
            tokens.append(tok)
            types.append(int(TT.NORMAL))
    return tokens, types, added


def _merge_pairs(merges: Sequence) -> list[tuple[str, str]]:
    out = []
    for m in merges:
        if isinstance(m, str):
            a, _, b = m.partition(" ")
        else:
            a, b = m
        out.append((a, b))
    return out


def _is_sentencepiece_like(tj: Mapping) -> tuple[bool, bool]:
    """(escapes spaces as U+2581, adds a dummy prefix) for a byte_fallback BPE tokenizer.json."""
    escapes = prefix = False

    def walk_norm(n: Mapping | None) -> None:
        nonlocal escapes, prefix
        if not n:
            return
        if n.get("type") == "Sequence":
            for s in n.get("normalizers") or []:
                walk_norm(s)
        elif n.get("type") == "Replace":
            if (n.get("pattern") or {}).get("String") == " " and n.get("content") == "\u2581":
                escapes = True
        elif n.get("type") == "Prepend" and n.get("prepend") == "\u2581":
            prefix = True

    def walk_pre(p: Mapping | None) -> None:
        nonlocal escapes, prefix
        if not p:
            return
        if p.get("type") == "Sequence":
            for s in p.get("pretokenizers") or []:
                walk_pre(s)
        elif p.get("type") == "Metaspace" and p.get("replacement", "\u2581") == "\u2581":
            escapes = True
            scheme = p.get("prepend_scheme")
            if scheme is None:
                prefix = prefix or bool(p.get("add_prefix_space", True))
            else:
                prefix = prefix or scheme in ("first", "always")

    walk_norm(tj.get("normalizer"))
    walk_pre(tj.get("pre_tokenizer"))
    return escapes, prefix


def _llama_hf_vocab(tj: Mapping, n_vocab: int, path: Path) -> tuple[list[str], list[float], list[int], bool]:
    """tokens, scores, types, add_space_prefix of a llama-2 style (byte_fallback BPE) tokenizer.json.

    llama.cpp's SentencePiece tokenizer merges the adjacent pair whose concatenation has the highest
    score; HF BPE applies the merge of lowest rank. Scoring each token by minus the rank of the
    first merge that produces it makes the two agree."""
    escapes, prefix = _is_sentencepiece_like(tj)
    if not escapes:
        raise BadInput("byte-fallback BPE tokenizer without SentencePiece whitespace handling "
                       "(no Metaspace pre-tokenizer nor Replace(' ', '\u2581') normalizer) cannot be "
                       "stored in GGUF", path=path)
    tokens, types, added = _token_table(tj, n_vocab, path)
    model = tj["model"]
    rank: dict[str, int] = {}
    for r, (a, b) in enumerate(_merge_pairs(model.get("merges") or [])):
        rank.setdefault(a + b, r)
    unk = model.get("unk_token")
    byte_re = re.compile(r"<0x[0-9A-Fa-f]{2}>")
    scores: list[float] = []
    for i, tok in enumerate(tokens):
        if types[i] == int(TT.NORMAL):
            if byte_re.fullmatch(tok):
                types[i] = int(TT.BYTE)
            elif unk is not None and tok == unk:
                types[i] = int(TT.UNKNOWN)
        elif unk is not None and tok == unk and types[i] == int(TT.CONTROL):
            types[i] = int(TT.UNKNOWN)
        if tok in rank:
            scores.append(-float(rank[tok]))
        elif len(tok) <= 1 or types[i] != int(TT.NORMAL):
            scores.append(0.0)
        else:
            scores.append(-1e9)  # a token no merge produces must never win a merge in llama.cpp
    missing = [f"<0x{b:02X}>" for b in range(256) if f"<0x{b:02X}>" not in set(tokens)]
    if missing:
        raise BadInput(f"byte-fallback tokenizer lacks byte tokens such as {missing[0]}", path=path)
    return tokens, scores, types, prefix


def _sentencepiece_vocab(model_dir: Path, n_vocab: int
                         ) -> tuple[list[bytes], list[float], list[int], bool, dict[str, int]]:
    sp_path = model_dir / "tokenizer.model"
    try:
        import sentencepiece  # noqa: F401  (gguf.SentencePieceVocab needs it)
    except ImportError:
        raise QConvertError("reading a SentencePiece tokenizer.model needs the sentencepiece package: "
                            "pip install sentencepiece", path=sp_path) from None
    from gguf.vocab import SentencePieceVocab

    try:
        vocab = SentencePieceVocab(model_dir)
    except (RuntimeError, ValueError, OSError, TypeError, KeyError, AttributeError):
        raise BadInput("sentencepiece cannot load this tokenizer.model (or the added_tokens.json beside it is "
                       "not an object of token ids)", path=sp_path) from None
    tokens: list[bytes] = []
    scores: list[float] = []
    types: list[int] = []
    for text, score, ttype in vocab.all_tokens():
        tokens.append(text)
        scores.append(float(score))
        types.append(int(ttype))
    if len(tokens) > n_vocab:
        raise BadInput(f"tokenizer has {len(tokens)} tokens but the model's embedding has only {n_vocab} rows",
                       path=sp_path)
    for i in range(len(tokens), n_vocab):
        tokens.append(f"[PAD{i}]".encode())
        scores.append(-1000.0)
        types.append(int(TT.UNUSED))
    proc = vocab.sentencepiece_tokenizer
    ids = {typ: int(i) for typ, i in (("unk", proc.unk_id()), ("bos", proc.bos_id()), ("eos", proc.eos_id()),
                                      ("pad", proc.pad_id())) if 0 <= int(i) < n_vocab}
    add_prefix = True
    try:
        from sentencepiece import sentencepiece_model_pb2 as pb2

        proto = pb2.ModelProto()
        proto.ParseFromString(sp_path.read_bytes())
        spec = proto.normalizer_spec
        add_prefix = bool(spec.add_dummy_prefix)
        if spec.remove_extra_whitespaces or spec.name not in ("identity", ""):
            logger.warning("%s: SentencePiece normalization (%s%s) is not applied by llama.cpp; text with "
                           "runs of spaces or non-normalized characters will tokenize differently", sp_path,
                           spec.name, ", remove_extra_whitespaces" if spec.remove_extra_whitespaces else "")
    except Exception:  # protobuf missing or an odd file: keep SentencePiece's default
        pass
    return tokens, scores, types, add_prefix, ids


# --------------------------------------------------------------------------------------------------
# Writer side
# --------------------------------------------------------------------------------------------------
def _first_int(v: Any) -> int | None:
    if isinstance(v, bool):
        return None
    if isinstance(v, int):
        return v
    if isinstance(v, (list, tuple)) and v and isinstance(v[0], int) and not isinstance(v[0], bool):
        return v[0]
    return None


class _OutOfRangeIds(logging.Filter):
    """Collects gguf-py's "Special token type T, id N out of range" warnings (which name no file) so that
    they are said once, in our words, with the folder."""

    _TEXT = re.compile(r"^Special token type (\w+), id (\d+) out of range")

    def __init__(self):
        super().__init__()
        self.ids: list[tuple[str, int]] = []

    def filter(self, record: logging.LogRecord) -> bool:
        if record.getMessage().startswith("Unknown separator token"):
            # a pair template's second special token (Gemma's `<bos> A <bos> B`): gguf-py writes no add_sep,
            # as llama.cpp's converter does, and llama.cpp encodes no pairs; nothing for the user to act on
            return False
        m = self._TEXT.match(record.getMessage())
        if m:
            self.ids.append((m.group(1), int(m.group(2))))
            return False
        return True


def _special_vocab(model_dir: Path, config: Mapping, n_vocab: int, *, merges: bool,
                   unk_token_id: int | None, add_bos_default: bool,
                   fallback_ids: Mapping[str, int] | None = None,
                   add_eos_default: bool | None = False) -> gguf.SpecialVocab:
    _check_side_json(model_dir)
    skipped = _OutOfRangeIds()
    vocab_logger = logging.getLogger("gguf.vocab")
    vocab_logger.addFilter(skipped)
    try:
        sv = gguf.SpecialVocab(model_dir, load_merges=merges, n_vocab=n_vocab)
    except ValueError:  # gguf-py refuses negative special token ids and merges it cannot parse
        raise BadInput("tokenizer files: a negative special token id (config.json / tokenizer_config.json "
                       "*_token_id) or merges of an unknown layout", path=model_dir) from None
    except (TypeError, AttributeError, KeyError, IndexError):
        raise BadInput("tokenizer files (tokenizer.json, tokenizer_config.json, merges.txt) hold a value of an "
                       "unexpected type or form", path=model_dir) from None
    finally:
        vocab_logger.removeFilter(skipped)
    for typ, tid in skipped.ids:
        # llama.cpp's converter skips such an id too (a pad id equal to the vocabulary size is common)
        logger.warning("%s: %s token id %d (config.json / tokenizer_config.json) is outside the %d-token "
                       "vocabulary; not written", model_dir, typ, tid, n_vocab)
    for typ in ("bos", "eos", "pad"):
        if typ not in sv.special_token_ids:
            tid = _first_int(config.get(f"{typ}_token_id"))
            if tid is not None and 0 <= tid < n_vocab:
                sv.special_token_ids[typ] = tid
    if "unk" not in sv.special_token_ids and unk_token_id is not None:
        sv.special_token_ids["unk"] = unk_token_id
    for typ, tid in (fallback_ids or {}).items():
        sv.special_token_ids.setdefault(typ, tid)
    sv.add_special_token.setdefault("bos", add_bos_default)
    if add_eos_default is not None:  # None: add_eos_token only where the tokenizer files say it
        sv.add_special_token.setdefault("eos", add_eos_default)
    for typ in ("bos", "eos"):
        if sv.add_special_token.get(typ) and typ not in sv.special_token_ids:
            raise BadInput(f"the tokenizer adds a {typ.upper()} token but names no {typ}_token id",
                           path=model_dir)
    if "eos" not in sv.special_token_ids:
        logger.warning("%s: no eos token id found; llama.cpp will fall back to its default id", model_dir)
    return sv


def add_tokenizer(writer: gguf.GGUFWriter, model_dir: Path, config: Mapping, n_vocab: int) -> None:
    """Write the ``tokenizer.ggml.*`` keys for the tokenizer in ``model_dir``; ``n_vocab`` is the
    number of embedding rows (the token list is padded to it).

    Raises :class:`BadInput` for missing tokenizer files and for tokenizers GGUF/llama.cpp cannot
    hold (WordLevel, WordPiece, Unigram without tokenizer.model, an unknown pre-tokenizer, ...).
    """
    model_dir = Path(model_dir)
    n_vocab = int(n_vocab)
    tj_path = model_dir / "tokenizer.json"
    sp_path = model_dir / "tokenizer.model"

    if tj_path.is_file():
        tj = read_json(tj_path)
        _check_tokenizer_json(tj, tj_path)
        _check_side_json(model_dir)
        model = tj.get("model") or {}
        mtype = _model_type(model)
        if mtype == "BPE" and model.get("byte_fallback") and _byte_fallback_model(writer) == "gemma4":
            _write_gemma4(writer, tj, tj_path, model_dir, config, n_vocab)
            return
        if mtype == "BPE" and model.get("byte_fallback"):
            tokens, scores, types, prefix = _llama_hf_vocab(tj, n_vocab, tj_path)
            unk_tok = model.get("unk_token")
            unk_id = tokens.index(unk_tok) if unk_tok is not None and unk_tok in tokens else None
            sv = _special_vocab(model_dir, config, n_vocab, merges=False, unk_token_id=unk_id,
                                add_bos_default=False)
            _write_llama(writer, tokens, scores, types, prefix, sv)
            return
        if mtype == "BPE":
            if _has_bytelevel(tj.get("pre_tokenizer")):
                _write_gpt2(writer, tj, tj_path, model_dir, config, n_vocab)
                return
            if not sp_path.is_file():
                raise BadInput("tokenizer model BPE without a ByteLevel pre-tokenizer or byte_fallback "
                               "cannot be stored in GGUF (llama.cpp runs byte-level BPE and SentencePiece "
                               "only)", path=tj_path)
        elif not sp_path.is_file():
            raise BadInput(f"tokenizer model {mtype} cannot be stored in GGUF: llama.cpp runs byte-level BPE "
                           "and SentencePiece tokenizers only (no tokenizer.model next to it)", path=tj_path)
    elif not sp_path.is_file():
        raise BadInput("no tokenizer.json or tokenizer.model in the model directory", path=model_dir)

    tokens_b, scores, types, prefix, sp_ids = _sentencepiece_vocab(model_dir, n_vocab)
    sv = _special_vocab(model_dir, config, n_vocab, merges=False, unk_token_id=None, add_bos_default=True,
                        fallback_ids=sp_ids)
    _write_llama(writer, tokens_b, scores, types, prefix, sv)


def _has_bytelevel(pt: Mapping | None) -> bool:
    if not pt:
        return False
    if pt.get("type") == "Sequence":
        return any(_has_bytelevel(s) for s in pt.get("pretokenizers") or [])
    return pt.get("type") == "ByteLevel"


def _check_bpe_normalizer(tj: Mapping, path: Path) -> None:
    def kinds(n: Mapping | None) -> list[str]:
        if not n:
            return []
        if n.get("type") == "Sequence":
            return [k for s in n.get("normalizers") or [] for k in kinds(s)]
        return [str(n.get("type"))]

    bad = [k for k in kinds(tj.get("normalizer")) if k not in _ALLOWED_BPE_NORMALIZERS]
    if bad:
        raise BadInput(f"byte-level BPE tokenizer with normalizer {', '.join(bad)} cannot be stored in GGUF: "
                       "llama.cpp applies no such normalization", path=path)


def _write_gpt2(writer: gguf.GGUFWriter, tj: Mapping, tj_path: Path, model_dir: Path, config: Mapping,
                n_vocab: int) -> None:
    pre = detect_pre_tokenizer(tj, path=tj_path)
    _check_bpe_normalizer(tj, tj_path)
    tokens, types, _ = _token_table(tj, n_vocab, tj_path)
    sv = _special_vocab(model_dir, config, n_vocab, merges=True, unk_token_id=None, add_bos_default=False)
    _add_named_special_tokens(sv, tokens, getattr(writer, "arch", ""), model_dir)
    if not sv.merges:
        raise BadInput("byte-level BPE tokenizer.json has no merges", path=tj_path)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    sv.add_to_gguf(writer, quiet=True)


def _byte_fallback_model(writer: gguf.GGUFWriter) -> str:
    """The tokenizer model the architecture's converter writes a byte-fallback BPE tokenizer.json as
    (archs: byte_fallback_tokenizer; `llama` unless the entry says otherwise)."""
    from .archs import arch_by_name

    spec = arch_by_name(getattr(writer, "arch", ""))
    return spec.byte_fallback_tokenizer if spec is not None else "llama"


def _special_token_texts(model_dir: Path) -> set[str]:
    """The texts transformers counts among a tokenizer's special tokens (all_special_tokens): the named ones
    (bos_token, eos_token, ...) and the extra / additional special tokens of tokenizer_config.json, then of
    special_tokens_map.json for a name the former lacks (an AddedToken may be saved as {"content": ...})."""
    def text(value: Any) -> str | None:
        if isinstance(value, Mapping):
            value = value.get("content")
        return value if isinstance(value, str) else None

    named: dict[str, str] = {}
    extra: list[str] = []
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        path = model_dir / name
        if not path.is_file():
            continue
        cfg = read_json(path)
        for key in ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token"):
            if key not in named and text(cfg.get(key)) is not None:
                named[key] = text(cfg[key])
        for key in ("extra_special_tokens", "additional_special_tokens"):
            values = cfg.get(key)
            values = list(values.values()) if isinstance(values, Mapping) else values
            if isinstance(values, list) and not extra:
                extra = [t for t in map(text, values) if t is not None]
    return set(named.values()) | set(extra)


# Gemma 4's chat markers its converter types USER_DEFINED whatever the tokenizer says, "so that the chat parser
# can read them" (llama.cpp renders a USER_DEFINED token's text; a CONTROL one's never)
GEMMA4_VISIBLE_TOKENS = frozenset({"<|channel>", "<channel|>", "<|tool_call>", "<tool_call|>", "<|tool_response>",
                                   "<tool_response|>", '<|"|>'})


def _write_gemma4(writer: gguf.GGUFWriter, tj: Mapping, tj_path: Path, model_dir: Path, config: Mapping,
                  n_vocab: int) -> None:
    """Gemma 4's byte-fallback BPE tokenizer as its converter writes it (conversion/gemma.py Gemma4Model.set_vocab,
    through gguf-py's LlamaHfVocab) and llama.cpp's `gemma4` tokenizer runs it: BPE with the tokenizer.json's
    merges over text whose spaces become U+2581 (no pre-tokenizer name: the model implies it), every score
    -1000, types BYTE for <0xXX>, CONTROL for transformers' special tokens, USER_DEFINED for added non-special
    ones and the chat markers above, NORMAL otherwise; no space prefix, <bos> always added."""
    tokens, types, added = _token_table(tj, n_vocab, tj_path)
    special = _special_token_texts(model_dir)
    byte_re = re.compile(r"<0x[0-9A-Fa-f]{2}>")
    base = len(tj["model"].get("vocab") or {})  # transformers' vocab_size: the model's own tokens
    for i, tok in enumerate(tokens):
        if types[i] == int(TT.UNUSED):
            continue
        if i < base and byte_re.fullmatch(tok):
            types[i] = int(TT.BYTE)
        elif i < base or tok in special:
            types[i] = int(TT.CONTROL if tok in special else TT.NORMAL)
        else:
            types[i] = int(TT.USER_DEFINED)
        if tok in GEMMA4_VISIBLE_TOKENS:
            types[i] = int(TT.USER_DEFINED)
    sv = _special_vocab(model_dir, config, n_vocab, merges=True, unk_token_id=None, add_bos_default=True,
                        add_eos_default=None)
    sv.add_special_token["bos"] = True  # whatever tokenizer_config.json says (llama.cpp forces it for gemma4 too)
    if not sv.merges:
        raise BadInput("Gemma 4's byte-fallback BPE tokenizer.json has no merges (llama.cpp's gemma4 tokenizer "
                       "merges by them)", path=tj_path)
    writer.add_tokenizer_model("gemma4")
    writer.add_token_list(tokens)
    writer.add_token_scores([-1000.0] * len(tokens))
    writer.add_token_types(types)
    sv.add_to_gguf(writer, quiet=True)
    writer.add_add_space_prefix(False)


def _add_named_special_tokens(sv: gguf.SpecialVocab, tokens: Sequence[str], arch: str, model_dir: Path) -> None:
    """The special tokens the architecture's converter finds by their text (archs: named_special_tokens),
    where the tokenizer files name no id of that kind (gguf-py's SpecialVocab keeps the first id it is given,
    as in llama.cpp's converter)."""
    from .archs import arch_by_name

    spec = arch_by_name(arch)
    wanted = spec.named_special_tokens if spec is not None else ()
    if not wanted:
        return
    ids = {tok: i for i, tok in enumerate(tokens)}
    for typ, text in wanted:
        if text in ids:
            sv.special_token_ids.setdefault(typ, ids[text])
        else:
            logger.warning("%s: the tokenizer has no %s token; llama.cpp's %s converter takes it as the %s token",
                           model_dir, text, arch, typ)


def _write_llama(writer: gguf.GGUFWriter, tokens: Sequence, scores: Sequence[float], types: Sequence[int],
                 add_space_prefix: bool, sv: gguf.SpecialVocab) -> None:
    writer.add_tokenizer_model("llama")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(list(tokens))
    writer.add_token_scores([float(s) for s in scores])
    writer.add_token_types([int(t) for t in types])
    writer.add_add_space_prefix(bool(add_space_prefix))
    sv.add_to_gguf(writer, quiet=True)


# --------------------------------------------------------------------------------------------------
# Reader side: GGUF -> tokenizer.json + tokenizer_config.json
# --------------------------------------------------------------------------------------------------
def pre_tokenizer_json(pre: str) -> dict:
    """tokenizer.json ``pre_tokenizer`` for a llama.cpp pre-tokenizer name of :data:`PRE_TOKENIZERS`
    (the layout real models of that family ship: ByteLevel, or Split regex + ByteLevel without regex)."""
    steps = PRE_TOKENIZERS.get(pre)
    if steps is None:
        raise BadInput(f"GGUF pre-tokenizer {pre!r} has no tokenizer.json equivalent here "
                       f"(known: {', '.join(PRE_TOKENIZERS)})")
    bytelevel = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}
    if steps == (RE_GPT2,):
        return bytelevel
    parts: list[dict] = []
    for i, rx in enumerate(steps):
        if rx == RE_GPT2 and i == len(steps) - 1:
            parts.append(bytelevel)
            return {"type": "Sequence", "pretokenizers": parts}
        if rx == RE_DIGIT:
            parts.append({"type": "Digits", "individual_digits": True})
        else:
            parts.append({"type": "Split", "pattern": {"Regex": rx}, "behavior": "Isolated", "invert": False})
    parts.append(dict(bytelevel, use_regex=False))
    return {"type": "Sequence", "pretokenizers": parts}


def _merges_from_scores(vocab: Mapping[str, int], scores: Sequence[float], types: Sequence[int]) -> list[list[str]]:
    """BPE merges equivalent to llama.cpp's SentencePiece merging: every split (a, b) of a NORMAL
    token t with both halves in the vocabulary, ranked by t's score (highest first), then by id."""
    entries = []
    for tok, tid in vocab.items():
        if len(tok) < 2 or types[tid] != int(TT.NORMAL):
            continue
        for i in range(1, len(tok)):
            a, b = tok[:i], tok[i:]
            if a in vocab and b in vocab:
                entries.append((-float(scores[tid]), tid, vocab[a], vocab[b], a, b))
    entries.sort()
    return [[a, b] for *_, a, b in entries]


def _check_tokenizer_kv(kv: Mapping, path: object) -> None:
    """The tokenizer.ggml.* values this module reads, checked for type (a GGUF edited or written by
    another tool may hold, say, token types as strings); BadInput naming the key."""
    def bad(key: str, expected: str) -> BadInput:
        return BadInput(f"metadata {key} is not {expected}", path=path)

    def is_int(v: Any) -> bool:
        return isinstance(v, int) and not isinstance(v, bool)

    for key, ok, expected in (
            ("tokenizer.ggml.tokens", lambda v: isinstance(v, list) and all(isinstance(t, str) for t in v),
             "an array of strings"),
            ("tokenizer.ggml.token_type", lambda v: isinstance(v, list) and all(is_int(t) for t in v),
             "an array of integers"),
            ("tokenizer.ggml.scores", lambda v: isinstance(v, list) and all(
                isinstance(t, (int, float)) and not isinstance(t, bool) for t in v), "an array of numbers"),
            ("tokenizer.ggml.merges", lambda v: isinstance(v, list) and all(isinstance(t, str) for t in v),
             "an array of strings"),
            ("tokenizer.ggml.pre", lambda v: isinstance(v, str), "a string"),
            ("tokenizer.chat_template", lambda v: isinstance(v, str), "a string"),
            ("tokenizer.ggml.add_bos_token", lambda v: isinstance(v, bool), "a boolean"),
            ("tokenizer.ggml.add_eos_token", lambda v: isinstance(v, bool), "a boolean"),
            ("tokenizer.ggml.add_space_prefix", lambda v: isinstance(v, bool), "a boolean"),
            *((f"tokenizer.ggml.{t}_token_id", is_int, "an integer") for t in ("bos", "eos", "padding", "unknown"))):
        if key in kv and not ok(kv[key]):
            raise bad(key, expected)


def tokenizer_files_from_gguf(fields: Any, out_dir: Path, *, path: object = None) -> list[Path]:
    """Write ``tokenizer.json`` and ``tokenizer_config.json`` into ``out_dir`` from GGUF metadata
    (a :class:`gguf.GGUFReader`, its ``fields`` or a plain dict) that ``tokenizers`` and
    ``transformers.AutoTokenizer`` load: byte-level BPE for model ``gpt2`` (merges and the
    pre-tokenizer of ``tokenizer.ggml.pre``), a byte-fallback BPE with merges rebuilt from the scores
    for model ``llama`` (SentencePiece style), and with the file's merges for model ``gemma4``. Returns the
    written paths."""
    kv = field_values(fields)
    _check_tokenizer_kv(kv, path)
    model = kv.get("tokenizer.ggml.model")
    if model not in ("gpt2", "llama", "gemma4"):
        raise BadInput(f"GGUF tokenizer model {model!r} cannot be turned into a tokenizer.json "
                       "(supported: 'gpt2' byte-level BPE, 'llama' SentencePiece, 'gemma4')", path=path)
    tokens: list[str] = [t.decode("utf-8", "replace") if isinstance(t, bytes) else t
                         for t in kv.get("tokenizer.ggml.tokens") or []]
    if not tokens:
        raise BadInput("GGUF metadata has no tokenizer.ggml.tokens", path=path)
    types = [int(t) for t in kv.get("tokenizer.ggml.token_type") or [int(TT.NORMAL)] * len(tokens)]
    if len(types) != len(tokens):
        raise BadInput(f"GGUF has {len(tokens)} tokens but {len(types)} token types", path=path)

    vocab: dict[str, int] = {}
    added: list[dict] = []
    for i, (tok, t) in enumerate(zip(tokens, types)):
        if tok in vocab:
            raise BadInput(f"GGUF token list repeats {_show(tok)} (ids {vocab[tok]} and {i})", path=path)
        vocab[tok] = i
        if t in (int(TT.CONTROL), int(TT.USER_DEFINED), int(TT.UNKNOWN)):
            added.append({"id": i, "content": tok, "single_word": False, "lstrip": False, "rstrip": False,
                          "normalized": False, "special": t != int(TT.USER_DEFINED)})

    def tok_at(key: str) -> str | None:
        tid = kv.get(key)
        return tokens[int(tid)] if tid is not None and 0 <= int(tid) < len(tokens) else None

    bos, eos = tok_at("tokenizer.ggml.bos_token_id"), tok_at("tokenizer.ggml.eos_token_id")
    pad, unk = tok_at("tokenizer.ggml.padding_token_id"), tok_at("tokenizer.ggml.unknown_token_id")
    # llama.cpp's defaults when the flags are absent: SentencePiece adds BOS, byte-level BPE does not
    add_bos = bool(kv.get("tokenizer.ggml.add_bos_token", model in ("llama", "gemma4"))) and bos is not None
    add_eos = bool(kv.get("tokenizer.ggml.add_eos_token", False)) and eos is not None

    if add_bos or add_eos:
        def seq(name: str, type_id: int) -> list[dict]:
            out = [{"SpecialToken": {"id": bos, "type_id": type_id}}] if add_bos else []
            out.append({"Sequence": {"id": name, "type_id": type_id}})
            if add_eos:
                out.append({"SpecialToken": {"id": eos, "type_id": type_id}})
            return out

        special_tokens = {tok: {"id": tok, "ids": [vocab[tok]], "tokens": [tok]}
                          for flag, tok in ((add_bos, bos), (add_eos, eos)) if flag}
        post: dict | None = {"type": "TemplateProcessing", "single": seq("A", 0),
                             "pair": seq("A", 0) + seq("B", 1), "special_tokens": special_tokens}
    elif model == "gpt2":
        post = {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": False, "use_regex": True}
    else:
        post = None

    if model == "gpt2":
        pre = kv.get("tokenizer.ggml.pre") or "gpt-2"
        bpe = {"byte_fallback": False, "ignore_merges": pre in _IGNORE_MERGES, "unk_token": None,
               "merges": [list(p) for p in _merge_pairs(kv.get("tokenizer.ggml.merges") or [])]}
        if not bpe["merges"]:
            raise BadInput("GGUF byte-level BPE tokenizer has no tokenizer.ggml.merges", path=path)
        normalizer = None
        try:
            pre_tokenizer: dict | None = pre_tokenizer_json(pre)
        except BadInput as e:
            raise BadInput(e.detail, path=path) from None
        decoder = {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True}
    elif model == "gemma4":
        # Gemma 4's own form (GemmaTokenizer's): BPE with the file's merges and byte fallback over text whose
        # spaces are U+2581, no pre-split and no prefix space, as llama.cpp's gemma4 tokenizer runs it
        bpe = {"byte_fallback": True, "ignore_merges": False, "unk_token": unk,
               "merges": [list(p) for p in _merge_pairs(kv.get("tokenizer.ggml.merges") or [])]}
        if not bpe["merges"]:
            raise BadInput("GGUF gemma4 tokenizer has no tokenizer.ggml.merges", path=path)
        normalizer = {"type": "Replace", "pattern": {"String": " "}, "content": "\u2581"}
        pre_tokenizer = None
        decoder = {"type": "Sequence", "decoders": [
            {"type": "Replace", "pattern": {"String": "\u2581"}, "content": " "}, {"type": "ByteFallback"},
            {"type": "Fuse"}]}
    else:
        scores = list(kv.get("tokenizer.ggml.scores") or [])
        if len(scores) != len(tokens):
            raise BadInput("GGUF SentencePiece tokenizer lacks one score per token (tokenizer.ggml.scores)", path=path)
        prefix = bool(kv.get("tokenizer.ggml.add_space_prefix", True))
        bpe = {"byte_fallback": True, "ignore_merges": False, "unk_token": unk,
               "merges": _merges_from_scores(vocab, scores, types)}
        norms: list[dict] = [{"type": "Prepend", "prepend": "\u2581"}] if prefix else []
        norms.append({"type": "Replace", "pattern": {"String": " "}, "content": "\u2581"})
        normalizer = {"type": "Sequence", "normalizers": norms}
        pre_tokenizer = None
        decoders: list[dict] = [{"type": "Replace", "pattern": {"String": "\u2581"}, "content": " "},
                                {"type": "ByteFallback"}, {"type": "Fuse"}]
        if prefix:
            decoders.append({"type": "Strip", "content": " ", "start": 1, "stop": 0})
        decoder = {"type": "Sequence", "decoders": decoders}

    tj = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": normalizer,
        "pre_tokenizer": pre_tokenizer,
        "post_processor": post,
        "decoder": decoder,
        "model": {
            "type": "BPE", "dropout": None, "unk_token": bpe["unk_token"], "continuing_subword_prefix": None,
            "end_of_word_suffix": None, "fuse_unk": bool(bpe["byte_fallback"]),
            "byte_fallback": bpe["byte_fallback"], "ignore_merges": bpe["ignore_merges"],
            "vocab": vocab,
            "merges": bpe["merges"],
        },
    }
    arch = kv.get("general.architecture")
    cfg: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": add_bos,
        "add_eos_token": add_eos,
        "clean_up_tokenization_spaces": False,
    }
    for key, tok in (("bos_token", bos), ("eos_token", eos), ("pad_token", pad), ("unk_token", unk)):
        if tok is not None:
            cfg[key] = tok
    ctx = kv.get(f"{arch}.context_length") if arch else None
    if ctx:
        cfg["model_max_length"] = int(ctx)
    tmpl = kv.get("tokenizer.chat_template")
    if tmpl:
        cfg["chat_template"] = tmpl

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    p_tok, p_cfg = out / "tokenizer.json", out / "tokenizer_config.json"
    p_tok.write_text(json.dumps(tj, ensure_ascii=False, indent=1) + "\n", encoding="utf-8")
    p_cfg.write_text(json.dumps(cfg, ensure_ascii=False, indent=2) + "\n", encoding="utf-8")
    return [p_tok, p_cfg]
