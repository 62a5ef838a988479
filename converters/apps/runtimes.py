"""The runtimes that own each format, behind one interface (`Runtime`): transformers for dense and HQQ
checkpoints, gptqmodel for GPTQ and QQQ, llama.cpp (llama-cpp-python) for GGUF, mistral.rs (in a child
process) for UQFF. `verify --logits` (logits.py) runs a source and its output each in its own; a format's
runtime is registered with `register_runtime`. A runtime that is not installed is a one-line refusal naming
the package to install.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Protocol

import numpy as np

from ...kernels import usable_cpus
from ..errors import QConvertError


@dataclass
class TopK:
    """What a runtime that gives no full distribution knows of the next token at each position: its K most
    likely tokens and their log-probabilities (of the full softmax). `rows[i]` is (token ids [K] int64,
    log-probs [K] float64), or None where the runtime could not be asked about position i."""

    rows: list[tuple[np.ndarray, np.ndarray] | None]
    k: int
    runtime: str  # "mistral.rs", named in LogitReport.support
    vocab: int  # the model's vocabulary: a row of that many tokens is the whole distribution

    def whole(self) -> bool:
        return all(r is None or r[0].size >= self.vocab for r in self.rows)


class Runtime(Protocol):
    name: str  # "transformers 5.24.0", shown in the report

    def tokenize(self, text: str) -> list[int]: ...

    def log_probs(self, ids: list[int]) -> np.ndarray | TopK:
        """[len(ids), vocab] float64 log-softmax of the logits at every position, or, for a runtime that
        returns only the most likely tokens, their TopK."""

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
def runtime_output_hidden():
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


@functools.lru_cache(maxsize=None)
def _cpu_advertises_amx() -> bool:
    """Read once per process: every llama.cpp load asks, and the CPU does not change."""
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            return any(line.startswith("flags") and " amx_tile" in line for line in f)
    except OSError:
        return False


def llama_cpp_model(path: Path | str, **kwargs):
    """llama_cpp.Llama(path, **kwargs), without ggml's extra CPU buffer types where the CPU advertises AMX.

    Why: ggml's AMX buffer type (ggml-cpu/amx) is chosen whenever the CPU lists amx_tile and the kernel grants the
    tile state (arch_prctl), but in a VM whose hypervisor does not carry that state the first tile instruction
    faults and the process dies (measured on a Firecracker VM, Linux 6.18: a general protection fault in
    libggml-cpu on every model with Q4_0 weights). The extra buffer types only repack weights for faster kernels
    (`use_extra_bufts`, llama.cpp's --no-repack), so without them the same file runs through ggml's plain CPU
    kernels. Elsewhere nothing changes."""
    import llama_cpp
    from llama_cpp import llama_cpp as lib

    if not _cpu_advertises_amx():
        return llama_cpp.Llama(str(path), **kwargs)
    default = lib.llama_model_default_params

    def without_extra_buffers():
        params = default()
        params.use_extra_bufts = False
        return params

    lib.llama_model_default_params = without_extra_buffers  # read by Llama.__init__, which loads the model
    try:
        return llama_cpp.Llama(str(path), **kwargs)
    finally:
        lib.llama_model_default_params = default


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
    """A GGUF file in llama.cpp, with an F32 KV cache (an F16 cache would round the comparison itself); a
    folder holding one is its model file (llama.cpp loads a file, the other parts of a split set beside it)."""

    def __init__(self, path: Path, fmt: str, n_ctx: int = 512):
        _require("llama_cpp", "llama-cpp-python", fmt)
        from ...formats.gguf.folder import find_model

        if Path(path).is_dir():
            path = find_model(Path(path)).model

        self.name = f"llama.cpp (llama-cpp-python {_version('llama-cpp-python')})"
        self._path, self._n_ctx = path, n_ctx
        self.llm = _loaded("llama.cpp", "the model", path, lambda: llama_cpp_model(
            path, n_ctx=n_ctx, n_batch=n_ctx, logits_all=True, verbose=False, type_k=0, type_v=0,
            n_threads=max(1, min(8, usable_cpus()))))

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


# mistral.rs in a child process: the wheel prints its log on stdout and keeps worker threads, and a crash
# inside it must not take qconvert down. It loads the model once and answers one JSON line per request.
_MISTRALRS_SERVER = r'''
import json, os, sys
reply = os.fdopen(os.dup(1), "w")  # the answers; mistral.rs's own stdout lines go to stderr
os.dup2(2, 1)
a = json.loads(sys.argv[1])
from mistralrs import Architecture, ChatCompletionRequest, ModelDType, Runner, Which
which = dict(model_id=a["model"], from_uqff=a["from_uqff"], dtype=ModelDType.F32)
if a["arch"]:
    which["arch"] = getattr(Architecture, a["arch"])
r = Runner(which=Which.Plain(**which), token_source="none", no_paged_attn=True, jinja_explicit=a["jinja"])


def say(obj):
    reply.write(json.dumps(obj) + "\n")
    reply.flush()


def next_token(prefix, k):
    """mistral.rs's top-k next tokens after `prefix`, or why that position cannot be asked."""
    text = r.detokenize_text(prefix, False)
    if list(r.tokenize_text(text, False, None)) != prefix:
        return "round trip"  # the prompt is text: it must tokenize back to these very ids
    res = r.send_chat_completion_request(ChatCompletionRequest(
        messages=[{"role": "user", "content": text}], model="default", max_tokens=1, temperature=0.0,
        logprobs=True, top_logprobs=k, ignore_eos=True))
    if res.usage.prompt_tokens != len(prefix):
        return "prompt length"  # the chat path added tokens (a BOS) of its own
    return res.choices[0].logprobs.content[0].top_logprobs


def score(ids, k, dest):
    """Every position's answer, as [n, K] arrays (token -1 where a position has fewer or none) in `dest`."""
    import numpy as np

    rows = [next_token(ids[: i + 1], k) for i in range(len(ids))]
    width = max((len(t) for t in rows if not isinstance(t, str)), default=0)
    tokens = np.full((len(ids), width), -1, dtype=np.int64)
    logprobs = np.full((len(ids), width), -np.inf)
    for i, top in enumerate(rows):
        if not isinstance(top, str):
            tokens[i, : len(top)] = [t.token for t in top]
            logprobs[i, : len(top)] = [t.logprob for t in top]
    np.savez(dest, tokens=tokens, logprobs=logprobs)
    return {"file": dest, "why_not": [t if isinstance(t, str) else "" for t in rows]}


say({"ready": True})
for line in sys.stdin:
    q = json.loads(line)
    try:
        if q["op"] == "tokenize":
            say({"ids": list(r.tokenize_text(q["text"], True, None))})
        else:
            say(score(q["ids"], q["k"], q["dest"]))
    except Exception as e:
        say({"error": f"{type(e).__name__}: {' '.join(str(e).split())[:300]}"})
'''

# config.json's model_type -> mistral.rs' Architecture (text models); another type lets mistral.rs detect it
_MISTRALRS_ARCH = {"llama": "Llama", "mistral": "Mistral", "mixtral": "Mixtral", "gemma": "Gemma", "gemma2": "Gemma2",
                   "phi2": "Phi2", "phi3": "Phi3", "qwen2": "Qwen2", "qwen3": "Qwen3", "qwen3_moe": "Qwen3Moe",
                   "starcoder2": "Starcoder2", "smollm3": "SmolLm3", "glm4": "GLM4", "deepseek_v2": "DeepseekV2",
                   "deepseek_v3": "DeepseekV3", "gpt_oss": "GptOss"}


class MistralRsRuntime:
    """A UQFF model in mistral.rs (float32, F32 KV cache), by teacher forcing on prefixes: its API returns
    log-probabilities only of tokens it generates, so each position is one generated token from the prompt
    ids[:i+1] with its top-K next tokens, all of them by default (a `TopK`; the module's docstring has the
    estimator)."""

    def __init__(self, path: Path, fmt: str, top_k: int | None = None):
        """`top_k`: how many next tokens to ask for; None asks for the whole vocabulary (config.json's
        vocab_size), which mistral.rs 0.9.5 returns (it caps top_logprobs at its vocabulary only)."""
        from ...formats.uqff.reader import shard_set

        if not _installed("mistralrs"):  # not imported here: it runs in its own process
            raise QConvertError(f"verify --logits runs {fmt} models with mistralrs, which is not installed "
                                f"(pip install mistralrs)")
        path = Path(path)
        folder = path if path.is_dir() else path.parent
        shards = shard_set(path)
        cfg = _mistralrs_config(folder)
        args = {"model": str(folder), "from_uqff": shards[0].name, "arch": _MISTRALRS_ARCH.get(cfg.get("model_type"))}
        self._vocab = int(cfg.get("vocab_size") or 0) or 1 << 30  # unknown: no row counts as whole
        self.top_k = top_k or self._vocab
        asked = f"top-{top_k}" if top_k else "all"
        self.name = f"mistral.rs (mistralrs {_version('mistralrs')}, f32; {asked} log-probs of 1 generated token)"
        self._path, self._scored = path, 0
        self._scratch = tempfile.TemporaryDirectory(prefix="qconvert-mistralrs-")
        scratch = Path(self._scratch.name)
        # the prompt must reach the model as it is: a template that renders the content alone
        (scratch / "raw.jinja").write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")
        args["jinja"] = str(scratch / "raw.jinja")
        self._log = open(scratch / "stderr.txt", "w+")
        env = {**os.environ, "MISTRALRS_CPU_KV_F32": "1", "RUST_LOG": "error", "HF_HUB_OFFLINE": "1"}
        self._proc = subprocess.Popen([sys.executable, "-c", _MISTRALRS_SERVER, json.dumps(args)],
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log, text=True,
                                      env=env)
        self._answer("load the model")

    def _answer(self, what: str, request: dict | None = None) -> dict:
        try:
            if request is not None:
                self._proc.stdin.write(json.dumps(request) + "\n")
                self._proc.stdin.flush()
            line = self._proc.stdout.readline()
        except (BrokenPipeError, OSError):
            line = ""
        if not line:  # the process ended: its own last words say why
            failure = self._failure()
            self.close()
            raise QConvertError(f"mistral.rs cannot {what} ({failure})", path=self._path)
        answer = json.loads(line)
        if "error" in answer:
            self.close()
            raise QConvertError(f"mistral.rs cannot {what} ({answer['error']})", path=self._path)
        return answer

    def _failure(self) -> str:
        """mistral.rs's own error lines from its log (a Rust backtrace's frames left out)."""
        code = self._proc.wait()
        self._log.seek(0)
        lines = [ln.strip() for ln in self._log.read().splitlines() if ln.strip()]
        errors = [ln for ln in lines if "rror" in ln and "::bt" not in ln and "candle_core" not in ln]
        text = " | ".join(errors[:2] or lines[-2:]) or "no message"
        return f"exit {code}: {' '.join(text.split())[:300]}"

    def tokenize(self, text: str) -> list[int]:
        return self._answer("tokenize the prompt", {"op": "tokenize", "text": text})["ids"]

    def log_probs(self, ids: list[int]) -> TopK:
        self._scored += 1
        dest = str(Path(self._scratch.name) / f"scores-{self._scored}.npz")
        answer = self._answer("score the prompt", {"op": "score", "ids": list(ids), "k": self.top_k, "dest": dest})
        with np.load(answer["file"]) as f:
            tokens, logprobs = f["tokens"], f["logprobs"]
        rows = [None if why else _top_row(t, lp) for why, t, lp in zip(answer["why_not"], tokens, logprobs)]
        return TopK(rows, self.top_k, "mistral.rs", self._vocab)

    def close(self) -> None:
        if self._log.closed:  # closed already (after a failure, then by the caller)
            return
        if self._proc.poll() is None:
            with contextlib.suppress(OSError):
                self._proc.stdin.close()  # the server's loop ends at the end of its input
            try:
                self._proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        self._proc.stdin.close(), self._proc.stdout.close()
        self._log.close()
        self._scratch.cleanup()


def _top_row(tokens: np.ndarray, logprobs: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
    """A position's answer without its padding (token -1)."""
    keep = tokens >= 0
    return (tokens[keep], logprobs[keep]) if keep.any() else None


def _mistralrs_config(folder: Path) -> dict:
    """The folder's config.json, refusing in one line what mistral.rs needs and the folder lacks."""
    cfg_path = folder / "config.json"
    try:
        cfg = json.loads(cfg_path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise QConvertError(f"mistral.rs needs the model's config.json ({getattr(e, 'strerror', None) or e})",
                            path=cfg_path) from None
    if "rope_theta" not in cfg:
        raise QConvertError("mistral.rs 0.9.5 needs a top-level rope_theta in config.json, which this one lacks",
                            path=cfg_path)
    if not (folder / "tokenizer.json").is_file():
        raise QConvertError("mistral.rs needs the model's tokenizer.json beside the .uqff files", path=folder)
    return cfg


def _installed(package: str) -> bool:
    """Whether `package` can be imported, without importing it (sys.modules' None marks a blocked one)."""
    if package in sys.modules:
        return sys.modules[package] is not None
    return importlib.util.find_spec(package) is not None


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
    "uqff": MistralRsRuntime,
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
