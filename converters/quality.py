"""The quality gate: the source and the output, each run in the runtime that owns its format, on the same tokens.

    qconvert verify SRC OUT --logits [--prompts FILE] [--max-tokens N]

Weights can be exact while a model is not (a tokenizer or a norm convention lost on the way), and a
requantized model's per-tensor error does not say how much its predictions moved. This runs both models:
transformers for dense and HQQ checkpoints, gptqmodel for GPTQ and QQQ, llama.cpp (llama-cpp-python) for GGUF.
The source's runtime tokenizes each prompt; the same ids go to both, so a tokenizer difference cannot hide
in the numbers. Per position it compares the next-token distributions as llama.cpp's `perplexity
--kl-divergence` does: KL(source || output), and whether the most likely token is the same; and it reports
each model's perplexity on the prompts.

A runtime that is not installed is a one-line refusal naming the package to install. mistral.rs (UQFF) has
no Python call that scores a given sequence (its API returns log-probabilities of tokens it generates), so a
UQFF side is refused with that reason; `qconvert verify` without --logits still measures its weights.
"""

from __future__ import annotations

import contextlib
import importlib
import math
import os
import sys
import warnings
from dataclasses import asdict, dataclass
from importlib import resources
from pathlib import Path
from typing import Callable, Protocol

import numpy as np

from .errors import QConvertError

__all__ = ["LogitReport", "Runtime", "register_runtime", "runtime_for", "compare_logits", "read_prompts",
           "bundled_text", "kl_rows"]

DEFAULT_MAX_TOKENS = 128


class Runtime(Protocol):
    name: str  # "transformers 5.24.0", shown in the report

    def tokenize(self, text: str) -> list[int]: ...

    def log_probs(self, ids: list[int]) -> np.ndarray:
        """[len(ids), vocab] float64 log-softmax of the logits at every position."""

    def close(self) -> None: ...


def _require(package: str, pip_name: str, fmt: str) -> None:
    try:
        importlib.import_module(package)
    except ImportError:
        raise QConvertError(f"verify --logits runs {fmt} models with {pip_name}, which is not installed "
                            f"(pip install {pip_name})") from None


def _version(package: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(package)
    except PackageNotFoundError:
        return "?"


@contextlib.contextmanager
def _runtime_output_hidden():
    """The runtimes' own banners, progress bars and log lines (gptqmodel prints its logo and kernel choices
    to stdout; llama.cpp's C code writes to the file descriptors) stay off the user's terminal: the result
    is our report. Their failures still reach the user, as the exceptions they raise."""
    sys.stdout.flush(), sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 1), os.dup2(devnull, 2)
        with open(os.devnull, "w") as sink, contextlib.redirect_stdout(sink), contextlib.redirect_stderr(sink), \
                warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        sys.stdout.flush(), sys.stderr.flush()
        os.dup2(saved[0], 1), os.dup2(saved[1], 2)
        os.close(saved[0]), os.close(saved[1]), os.close(devnull)


def _log_softmax(logits: np.ndarray) -> np.ndarray:
    x = np.asarray(logits, dtype=np.float64)
    x = x - x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


def _loaded(loader: str, what: str, path: Path, load: Callable):
    """`load()`, with a failure turned into one line naming the file and the loader's own first words."""
    try:
        return load()
    except Exception as e:
        raise QConvertError(f"{loader} cannot load {what} ({_first_line(e)})", path=path) from None


class _TorchRuntime:
    """A Hugging Face folder run by torch: its tokenizer from transformers, the model from `load_model`."""

    loader = "transformers"

    def __init__(self, path: Path, fmt: str):
        self.require(fmt)
        import torch
        from transformers import AutoTokenizer

        self._torch = torch
        self.tokenizer = _loaded("transformers", "the tokenizer", path, lambda: AutoTokenizer.from_pretrained(str(path)))
        self.model = _loaded(self.loader, "the model", path, lambda: self.load_model(path, fmt))
        self.model.eval()

    def require(self, fmt: str) -> None:
        _require("transformers", "transformers", fmt)

    def load_model(self, path: Path, fmt: str):
        raise NotImplementedError

    def tokenize(self, text: str) -> list[int]:
        return list(self.tokenizer(text)["input_ids"])

    def log_probs(self, ids: list[int]) -> np.ndarray:
        with self._torch.inference_mode():
            logits = self.model(self._torch.tensor([ids])).logits[0]
        return _log_softmax(logits.float().numpy())

    def close(self) -> None:
        del self.model


class TransformersRuntime(_TorchRuntime):
    """A Hugging Face checkpoint (dense; HQQ through its transformers integration, which needs hqq) in
    transformers, float32 on the CPU: float32 activations add no rounding of their own to the comparison."""

    def require(self, fmt: str) -> None:
        super().require(fmt)
        if fmt == "hqq":
            _require("hqq", "hqq", fmt)

    def load_model(self, path: Path, fmt: str):
        from transformers import AutoModelForCausalLM

        self.name = f"transformers {_version('transformers')}"
        return AutoModelForCausalLM.from_pretrained(str(path), dtype=self._torch.float32, device_map="cpu")


class GptqmodelRuntime(_TorchRuntime):
    """GPTQ (v1 and v2) and QQQ in gptqmodel, their producer's own loader. transformers loads only GPTQ v1 (a
    gptq_v2 checkpoint fails its shape check), so both conventions run here, in the one kernel, where an exact
    v1 <-> v2 conversion gives the same logits. gptqmodel's CPU kernels (torch, qqq_torch) compute in fp16."""

    loader = "gptqmodel"
    BACKENDS = {"gptq": "torch", "gptq-v2": "torch", "qqq": "qqq_torch"}

    def require(self, fmt: str) -> None:
        _require("gptqmodel", "gptqmodel", fmt)
        super().require(fmt)

    def load_model(self, path: Path, fmt: str):
        from gptqmodel import GPTQModel

        backend = self.BACKENDS[fmt]
        self.name = f"gptqmodel {_version('gptqmodel')} ({backend}, fp16)"
        return GPTQModel.load(str(path), backend=backend, device="cpu", dtype=self._torch.float16).model


class LlamaCppRuntime:
    """A GGUF file in llama.cpp, with an F32 KV cache (an F16 cache would round the comparison itself)."""

    def __init__(self, path: Path, fmt: str, n_ctx: int = 512):
        _require("llama_cpp", "llama-cpp-python", fmt)
        from llama_cpp import Llama

        self.name = f"llama.cpp (llama-cpp-python {_version('llama-cpp-python')})"
        self._path, self._n_ctx = path, n_ctx
        self.llm = _loaded("llama.cpp", "the model", path, lambda: Llama(
            str(path), n_ctx=n_ctx, n_batch=n_ctx, logits_all=True, verbose=False, type_k=0, type_v=0,
            n_threads=max(1, min(8, _cores()))))

    def tokenize(self, text: str) -> list[int]:
        return list(self.llm.tokenize(text.encode("utf-8"), add_bos=True, special=False))

    def log_probs(self, ids: list[int]) -> np.ndarray:
        if len(ids) > self._n_ctx:
            raise QConvertError(f"{len(ids)} tokens exceed the context of {self._n_ctx} this check opens",
                                path=self._path)
        self.llm.reset()
        self.llm.eval(ids)
        return _log_softmax(np.array(self.llm.scores[: len(ids)], dtype=np.float32))

    def close(self) -> None:
        self.llm.close()


def _refuse_uqff(path: Path, fmt: str):
    raise QConvertError("verify --logits cannot run a UQFF model: mistral.rs's Python API (mistralrs 0.9.5) "
                        "returns log-probabilities only of tokens it generates, not the logits of a given "
                        "sequence; `qconvert verify` without --logits measures its weights", path=path)


def _cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def _first_line(e: BaseException) -> str:
    text = " ".join(str(e).split())[:200]
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


# -- which runtime owns which format: a new format registers its own -----------------------------------------
_RUNTIMES: dict[str, Callable[[Path, str], Runtime]] = {
    "hf": TransformersRuntime,
    "gptq": GptqmodelRuntime,
    "gptq-v2": GptqmodelRuntime,
    "hqq": TransformersRuntime,
    "qqq": GptqmodelRuntime,
    "gguf": LlamaCppRuntime,
    "uqff": _refuse_uqff,
}


def register_runtime(fmt: str, factory: Callable[[Path, str], Runtime]) -> None:
    """`factory(path, fmt)` opens a model of format `fmt` in its runtime (raising QConvertError if it cannot)."""
    _RUNTIMES[fmt] = factory


def runtime_for(fmt: str, path: Path) -> Runtime:
    factory = _RUNTIMES.get(fmt)
    if factory is None:
        raise QConvertError(f"verify --logits has no runtime for {fmt} models (it runs: {', '.join(sorted(_RUNTIMES))})",
                            path=path)
    return factory(Path(path), fmt)


# -- prompts ---------------------------------------------------------------------------------------------------
def bundled_text() -> str:
    """The default text: plain English prose written for this check (no licence attached to it)."""
    return resources.files("qconvert.converters").joinpath("verify_text.txt").read_text(encoding="utf-8")


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


@dataclass
class LogitReport:
    source_runtime: str
    output_runtime: str
    prompts: int
    tokens: int  # positions compared (every token of every prompt)
    kl_mean: float
    kl_max: float
    top1_agreement: float
    ppl_source: float
    ppl_output: float

    def as_dict(self) -> dict:
        return asdict(self)

    def line(self) -> str:
        return (f"logits over {self.tokens} tokens ({self.prompts} prompt(s)): KL mean {self.kl_mean:.6g}, "
                f"max {self.kl_max:.6g}; top-1 agreement {self.top1_agreement:.4f}; perplexity "
                f"{self.ppl_source:.6g} (source, {self.source_runtime}) vs {self.ppl_output:.6g} "
                f"(output, {self.output_runtime})")


def _nll(logp: np.ndarray, ids: list[int]) -> float:
    """Total negative log-likelihood of ids[1:] given the prefixes."""
    return float(-logp[np.arange(len(ids) - 1), ids[1:]].sum())


def compare_logits(src_fmt: str, src_path: Path, out_fmt: str, out_path: Path, prompts: list[str],
                   max_tokens: int = DEFAULT_MAX_TOKENS) -> LogitReport:
    """Run the source, then the output (one model in memory at a time) and compare them on the same ids."""
    with _runtime_output_hidden():
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
