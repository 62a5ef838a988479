"""The quality gate: the source and the output, each run in the runtime that owns its format, on the same tokens.

    qconvert verify SRC OUT --logits [--prompts FILE] [--max-tokens N]

Weights can be exact while a model is not (a tokenizer or a norm convention lost on the way), and a
requantized model's per-tensor error does not say how much its predictions moved. This runs both models:
transformers for dense and HQQ checkpoints, gptqmodel for GPTQ and QQQ, llama.cpp (llama-cpp-python) for GGUF,
mistral.rs for UQFF.
The source's runtime tokenizes each prompt; the same ids go to both, so a tokenizer difference cannot hide
in the numbers. Per position it compares the next-token distributions as llama.cpp's `perplexity
--kl-divergence` does: KL(source || output), and whether the most likely token is the same; and it reports
each model's perplexity on the prompts.

A runtime that is not installed is a one-line refusal naming the package to install.

mistral.rs (UQFF) has no Python call that scores a given sequence: it returns the log-probabilities of the
tokens it generates. So a UQFF side is measured by teacher forcing on prefixes: for every position i,
mistral.rs generates one token from the prompt ids[:i+1] (given as text: its own detokenization of those ids,
kept only where its own tokenizer gives the very ids back and the prompt it ran had that many tokens; other
positions are skipped and counted) and returns its `top_logprobs` next tokens (`TopK`). mistral.rs 0.9.5
caps top_logprobs only at its vocabulary, so asking for vocab_size gives the whole distribution and the
figures are the full-vocabulary ones. With a smaller K (`MistralRsRuntime(top_k=K)`) top-1 agreement stays
exact (a top-K holds the argmax); KL is computed over the tokens both sides know, each distribution
renormalised over that set, an estimate that leaves out the tail beyond the top-K; a perplexity needs every
true next token within the K (else it is None, with the count of positions where it was not).
`LogitReport.support` says which estimator ran.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from importlib import resources
from pathlib import Path

import numpy as np

from ..errors import QConvertError
from .runtimes import TopK, runtime_for, runtime_output_hidden

DEFAULT_MAX_TOKENS = 128


# -- prompts ---------------------------------------------------------------------------------------------------
def bundled_text() -> str:
    """The default text: plain English prose written for this check (no licence attached to it)."""
    return resources.files("qconvert.converters.apps").joinpath("verify_text.txt").read_text(encoding="utf-8")


def read_prompts(path: Path | None) -> list[str]:
    """The prompts of a text file, separated by blank lines; the bundled text when `path` is None."""
    if path is None:
        return [bundled_text().strip()]
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise QConvertError(f"cannot read the prompts ({getattr(e, 'strerror', None) or type(e).__name__})",
                            path=path) from None
    prompts = [p.strip() for p in text.replace("\r\n", "\n").split("\n\n") if p.strip()]
    if not prompts:
        raise QConvertError("no prompts in the file (prompts are separated by blank lines)", path=path)
    return prompts


# -- the comparison -----------------------------------------------------------------------------------------
def kl_rows(src_logp: np.ndarray, out_logp: np.ndarray) -> np.ndarray:
    """KL(source || output) per position, in nats, from log-softmax rows."""
    p = np.exp(src_logp)
    return np.maximum((p * (src_logp - out_logp)).sum(axis=-1), 0.0)  # tiny negatives are float noise


FULL_VOCABULARY = "full vocabulary"


@dataclass
class LogitReport:
    source_runtime: str
    output_runtime: str
    prompts: int
    tokens: int  # positions compared (every token of every prompt, less positions_skipped)
    kl_mean: float
    kl_max: float
    top1_agreement: float
    ppl_source: float | None  # None: a true next token outside a top-K side's K (ppl_*_unscored positions)
    ppl_output: float | None
    # the tokens KL runs over: FULL_VOCABULARY, or "top-K of <runtime>" (both sides renormalised over them)
    support: str = FULL_VOCABULARY
    positions_skipped: int = 0  # positions a top-K runtime could not be asked about (its tokenizer round trip)
    ppl_source_unscored: int = 0  # positions whose true next token is outside that side's top-K
    ppl_output_unscored: int = 0

    def as_dict(self) -> dict:
        return asdict(self)

    def line(self) -> str:
        over = "" if self.support == FULL_VOCABULARY else f", over the {self.support}"
        skipped = f", {self.positions_skipped} skipped" if self.positions_skipped else ""
        return (f"logits over {self.tokens} tokens ({self.prompts} prompt(s){skipped}): KL mean {self.kl_mean:.6g}, "
                f"max {self.kl_max:.6g}{over}; top-1 agreement {self.top1_agreement:.4f}; perplexity "
                f"{_ppl_text(self.ppl_source, self.ppl_source_unscored)} (source, {self.source_runtime}) vs "
                f"{_ppl_text(self.ppl_output, self.ppl_output_unscored)} (output, {self.output_runtime})")


def _ppl_text(ppl: float | None, unscored: int) -> str:
    return f"{ppl:.6g}" if ppl is not None else f"n/a (true token outside the top-K at {unscored} positions)"


def _nll(logp: np.ndarray, ids: list[int]) -> float:
    """Total negative log-likelihood of ids[1:] given the prefixes."""
    return float(-logp[np.arange(len(ids) - 1), ids[1:]].sum())


def compare_logits(src_fmt: str, src_path: Path, out_fmt: str, out_path: Path, prompts: list[str],
                   max_tokens: int = DEFAULT_MAX_TOKENS) -> LogitReport:
    """Run the source, then the output (one model in memory at a time) and compare them on the same ids."""
    with runtime_output_hidden():
        source = runtime_for(src_fmt, src_path)
        try:
            ids = [source.tokenize(p)[:max_tokens] for p in prompts]
            ids = [i for i in ids if len(i) >= 2]
            if not ids:
                raise QConvertError("the prompts tokenize to fewer than 2 tokens each: nothing to predict",
                                    path=src_path)
            src_rows = [source.log_probs(i) for i in ids]
            src_name = source.name
        finally:
            source.close()
        output = runtime_for(out_fmt, out_path)
        try:
            out_rows = [output.log_probs(i) for i in ids]
            out_name = output.name
        finally:
            output.close()
    if any(isinstance(r, TopK) for r in src_rows + out_rows):
        return _compare_top_k(ids, src_rows, out_rows, src_name, out_name, out_path)
    kls, agree, nll_src, nll_out, n_pred = [], 0, 0.0, 0.0, 0
    for tok, s, o in zip(ids, src_rows, out_rows):
        if s.shape != o.shape:
            raise QConvertError(f"the output's runtime gives {o.shape[-1]} logits per token, the source's "
                                f"{s.shape[-1]}: the vocabularies differ", path=out_path)
        kls.append(kl_rows(s, o))
        agree += int((s.argmax(-1) == o.argmax(-1)).sum())
        nll_src += _nll(s, tok)
        nll_out += _nll(o, tok)
        n_pred += len(tok) - 1
    kl = np.concatenate(kls)
    return LogitReport(src_name, out_name, len(ids), int(kl.size), float(kl.mean()), float(kl.max()),
                       agree / kl.size, math.exp(nll_src / n_pred), math.exp(nll_out / n_pred))


# -- a side that knows only its top-K tokens -----------------------------------------------------------------
def _position(side: np.ndarray | TopK, i: int) -> tuple[np.ndarray, np.ndarray] | None:
    """(token ids, log-probs) a side knows at position i: the whole row of a full side, the K of a TopK."""
    if isinstance(side, TopK):
        return side.rows[i]
    return np.arange(side.shape[-1]), side[i]


def kl_on_shared_tokens(src: tuple[np.ndarray, np.ndarray], out: tuple[np.ndarray, np.ndarray]) -> float | None:
    """KL(source || output) over the tokens both sides know, each distribution renormalised over that set
    (the whole vocabulary when both are full; the top-K of a TopK side). None when they share no token."""
    _, si, oi = np.intersect1d(src[0], out[0], assume_unique=True, return_indices=True)
    if si.size == 0:
        return None
    p, q = src[1][si], out[1][oi]
    p, q = p - np.logaddexp.reduce(p), q - np.logaddexp.reduce(q)
    return max(float((np.exp(p) * (p - q)).sum()), 0.0)  # tiny negatives are float noise


def _best(known: tuple[np.ndarray, np.ndarray]) -> int:
    return int(known[0][np.argmax(known[1])])


def _target_logprob(known: tuple[np.ndarray, np.ndarray], token: int) -> float | None:
    hit = np.flatnonzero(known[0] == token)
    return float(known[1][hit[0]]) if hit.size else None


def _support(src_rows: list, out_rows: list) -> str:
    """Which tokens KL runs over, for the report: FULL_VOCABULARY when each TopK side returned its whole
    vocabulary at every position it answered, else "top-20 of mistral.rs (output)"."""
    partial = [(rows[0], side) for rows, side in ((src_rows, "source"), (out_rows, "output"))
               if isinstance(rows[0], TopK) and not all(r.whole() for r in rows)]
    if not partial:
        return FULL_VOCABULARY
    return " and ".join(f"top-{top.k} of {top.runtime} ({side})" for top, side in partial)


def _compare_top_k(ids, src_rows, out_rows, src_name, out_name, out_path) -> LogitReport:
    """The figures where a side is a TopK: per position both sides are asked for what they know; a position
    either side could not be asked about is skipped (counted); top-1 compares each side's best token (exact:
    a top-K holds the argmax); a perplexity is None unless every true next token is within that side's K."""
    kls, agree, skipped = [], 0, 0
    nll = {"source": 0.0, "output": 0.0}
    unscored = {"source": 0, "output": 0}
    n_pred = 0
    for tok, s_side, o_side in zip(ids, src_rows, out_rows):
        _check_vocabulary(s_side, o_side, out_path)
        for i in range(len(tok)):
            s, o = _position(s_side, i), _position(o_side, i)
            kl = kl_on_shared_tokens(s, o) if s is not None and o is not None else None
            if kl is None:
                skipped += 1
                continue
            kls.append(kl)
            agree += int(_best(s) == _best(o))
            if i + 1 < len(tok):
                n_pred += 1
                for side, known in (("source", s), ("output", o)):
                    lp = _target_logprob(known, tok[i + 1])
                    if lp is None:
                        unscored[side] += 1
                    else:
                        nll[side] -= lp
    if not kls:
        raise QConvertError(f"no position could be compared: {skipped} positions could not be asked of the "
                            f"runtime that returns only its top tokens", path=out_path)

    def ppl(side):
        return math.exp(nll[side] / n_pred) if n_pred and not unscored[side] else None

    kl = np.array(kls)
    return LogitReport(src_name, out_name, len(ids), int(kl.size), float(kl.mean()), float(kl.max()),
                       agree / kl.size, ppl("source"), ppl("output"), _support(src_rows, out_rows),
                       skipped, unscored["source"], unscored["output"])


def _check_vocabulary(src_side, out_side, out_path: Path) -> None:
    """A top-K token beyond the other side's full vocabulary: the two models do not share a vocabulary."""
    for side, other, what in ((src_side, out_side, "source"), (out_side, src_side, "output")):
        if isinstance(side, TopK) and not isinstance(other, TopK):
            top = max((int(r[0].max()) for r in side.rows if r is not None and r[0].size), default=-1)
            if top >= other.shape[-1]:
                raise QConvertError(f"the {what}'s runtime names token {top}, beyond the other's "
                                    f"{other.shape[-1]} logits per token: the vocabularies differ", path=out_path)
