"""UQFF fixtures made by mistral.rs itself (PyPI wheel mistralrs==0.9.5, CPU), and mistral.rs's own
log-probabilities for them.

mistral.rs is the only producer and loader of UQFF, so every UQFF the reader tests decode was written
by it: a tiny Llama is loaded with in-situ quantization (`Runner(in_situ_quant=TYPE)` with
`Which.Plain(write_uqff=...)`), which quantizes, writes the model directory (shards, residual, config,
tokenizer) and then serves the quantized model; the same runner then answers a greedy chat request
with top-3 log-probabilities, which is mistral.rs's own view of the quantized weights (the wheel
exposes no API to read a weight back).

Layout under ``root`` (default ``tests/_fixtures/uqff``)::

    wide/               f32 Llama, hidden 256, ffn 512 (K types need rows of 256), rope_theta and a
                        chat template added (mistral.rs needs both)
    narrow/             the 128-wide fixtures.py model (fp16), same additions
    kv32/               the wide model with 8 heads of 32 and one kv head: k/v projections of 32 rows, fewer
                        than mistral.rs' HQQ group of 64 (its groups run over the flattened weight)
    <model>-<type>/     what mistral.rs wrote: <type>-0.uqff, residual.safetensors, config.json, ...
                        plus mistralrs_logprobs.json {"ids", "steps": [[[token, logprob] x3] ...]}

Every mistral.rs call runs in a subprocess: the wheel prints its log on stdout, keeps worker threads,
and a failure inside it must not take the test process down.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
DEFAULT_ROOT = HERE.parent / "_fixtures" / "uqff"
PROMPT_TEXT = "the quantized model weights convert to a checkpoint"
STEPS = 4
CHAT_TEMPLATE = "{% for m in messages %}{{ m['content'] }}{% endfor %}"

# (model, ISQ type) pairs written by mistral.rs. K types need rows of 256 (the wide model); the narrow
# model shows mistral.rs's fallback (q4k -> Q4_1, embeddings Q6K -> Q5_1).
WIDE_TYPES = ("q4_0", "q4k", "q6k", "hqq4", "hqq8", "afq4", "afq8", "fp8", "f8q8", "mxfp4")
NARROW_TYPES = ("q4k",)
KV32_TYPES = ("hqq4", "hqq8")


def _fixtures_module():
    import importlib.util

    spec = importlib.util.spec_from_file_location("qconvert_test_fixtures_base", HERE / "fixtures.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def mistralrs_ready(model_dir: Path) -> None:
    """Add what mistral.rs needs and transformers ignores: a top-level rope_theta, a chat template."""
    cfg_path = model_dir / "config.json"
    cfg = json.loads(cfg_path.read_text())
    if "rope_theta" not in cfg:
        cfg["rope_theta"] = (cfg.get("rope_parameters") or {}).get("rope_theta", 10000.0)
        cfg_path.write_text(json.dumps(cfg, indent=2) + "\n")
    tc_path = model_dir / "tokenizer_config.json"
    tc = json.loads(tc_path.read_text())
    if tc.get("chat_template") != CHAT_TEMPLATE:
        tc["chat_template"] = CHAT_TEMPLATE
        tc_path.write_text(json.dumps(tc, indent=2) + "\n")


def build_wide_llama(out_dir: Path, seed: int = 77, heads: int = 4, kv_heads: int = 2, head_dim: int = 64) -> Path:
    """A float32 Llama with rows of 256 (hidden 256, ffn 512, 2 layers, 4 heads of 64, 2 kv heads)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    fx = _fixtures_module()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    config = LlamaConfig(vocab_size=fx.VOCAB_SIZE, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                         num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
                         max_position_embeddings=256,
                         rms_norm_eps=1e-5, tie_word_embeddings=False, bos_token_id=1, eos_token_id=0,
                         pad_token_id=None, attention_bias=False, mlp_bias=False, dtype=torch.float32)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters(), key=lambda kv: kv[0]):
            shape = tuple(p.shape)
            if name.endswith("norm.weight"):
                v = 1.0 + 0.2 * (torch.rand(shape, generator=gen) - 0.5)
            elif "embed_tokens" in name:
                v = torch.randn(shape, generator=gen)
            else:
                v = torch.randn(shape, generator=gen) / shape[1] ** 0.5
            p.copy_(v)
    model.save_pretrained(str(out), safe_serialization=True)
    fx.build_tokenizer(out)
    mistralrs_ready(out)
    return out


def build_kv32_llama(out_dir: Path) -> Path:
    """The wide model's sizes with 8 heads of 32 and one kv head: k_proj / v_proj are [32, 256]."""
    return build_wide_llama(out_dir, seed=91, heads=8, kv_heads=1, head_dim=32)


def build_narrow_llama(out_dir: Path) -> Path:
    fx = _fixtures_module()
    out = fx.build_tiny_llama(out_dir, seed=1234)
    mistralrs_ready(Path(out))
    return Path(out)


# -- mistral.rs, in a subprocess --------------------------------------------------------------------------
_RUN_ONE = r'''
import json, os, sys
os.environ["MISTRALRS_CPU_KV_F32"] = "1"   # else the CPU KV cache is f16
os.environ["HF_HUB_OFFLINE"] = "1"
from mistralrs import Runner, Which, ChatCompletionRequest, Architecture, ModelDType
def run(a):
    which = dict(model_id=a["model"], dtype=ModelDType.F32)
    if a.get("arch") != "auto":  # "auto": mistral.rs picks its loader from config.json's architectures
        which["arch"] = getattr(Architecture, a.get("arch") or "Llama")
    runner_kw = dict(token_source="none", no_paged_attn=True)
    if a.get("write_uqff"):
        which["write_uqff"] = a["write_uqff"]
        runner_kw["in_situ_quant"] = a["isq"]
    if a.get("from_uqff"):
        which["from_uqff"] = a["from_uqff"]
    if a.get("jinja"):
        runner_kw["jinja_explicit"] = a["jinja"]
    r = Runner(which=Which.Plain(**which), **runner_kw)
    ids = r.tokenize_text(a["text"], False, None)
    res = r.send_chat_completion_request(ChatCompletionRequest(
        messages=[{"role": "user", "content": a["text"]}], model="default", max_tokens=a["steps"],
        temperature=0.0, logprobs=True, top_logprobs=3, ignore_eos=True))
    steps = [[[t.token, t.logprob] for t in c.top_logprobs] for c in res.choices[0].logprobs.content]
    with open(a["out"], "w") as f:
        json.dump({"ids": list(ids), "prompt_tokens": res.usage.prompt_tokens, "steps": steps}, f)
'''
_RUNNER = _RUN_ONE + "run(json.loads(sys.argv[1]))\n"
# several models, one after another in one process (mistral.rs imported once); a model that fails leaves
# {"error": its message} as its result and the next one still runs
_RUNNER_MANY = _RUN_ONE + r'''
for a in json.loads(sys.argv[1]):
    try:
        run(a)
    except Exception as e:
        with open(a["out"], "w") as f:
            json.dump({"error": str(e).strip().splitlines()[0] if str(e).strip() else repr(e)}, f)
'''


def mistralrs_logprobs(model_dir: Path, out_json: Path, *, from_uqff=None, write_uqff=None, isq=None,
                       text: str = PROMPT_TEXT, steps: int = STEPS, jinja: Path | None = None,
                       arch: str = "Llama", timeout: int = 600) -> dict:
    """Run mistral.rs on `model_dir` (optionally quantizing in situ and writing a UQFF, or loading one);
    return {"ids": prompt ids, "steps": greedy steps of [[token, logprob] x3]}. Raises with mistral.rs's
    own message on failure."""
    args = {"model": str(model_dir), "out": str(out_json), "text": text, "steps": steps,
            "from_uqff": from_uqff, "write_uqff": write_uqff, "isq": isq,
            "jinja": str(jinja) if jinja else None, "arch": arch}
    proc = subprocess.run([sys.executable, "-c", _RUNNER, json.dumps(args)], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, "RUST_LOG": "error"})
    if proc.returncode != 0 or not Path(out_json).exists():
        lines = (proc.stderr + proc.stdout).strip().splitlines()
        errors = [ln.strip() for ln in lines if "Error" in ln and "::bt" not in ln and "candle_core" not in ln]
        raise RuntimeError(f"mistral.rs failed (exit {proc.returncode}): " + " | ".join(errors[:3] or lines[-5:]))
    return json.loads(Path(out_json).read_text())


def mistralrs_logprobs_many(jobs: list[dict], timeout: int = 600) -> list[dict]:
    """`mistralrs_logprobs` for several models in one mistral.rs process: each job is that function's keywords
    plus `model_dir` and `out_json`; returns each result, or {"error": mistral.rs' message} for a model it
    could not load or run."""
    args = [{"model": str(j["model_dir"]), "out": str(j["out_json"]), "text": j.get("text", PROMPT_TEXT),
             "steps": j.get("steps", STEPS), "from_uqff": j.get("from_uqff"), "write_uqff": j.get("write_uqff"),
             "isq": j.get("isq"), "jinja": str(j["jinja"]) if j.get("jinja") else None,
             "arch": j.get("arch", "Llama")} for j in jobs]
    for a in args:
        Path(a["out"]).unlink(missing_ok=True)
    proc = subprocess.run([sys.executable, "-c", _RUNNER_MANY, json.dumps(args)], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, "RUST_LOG": "error"})
    missing = [a["model"] for a in args if not Path(a["out"]).exists()]
    if proc.returncode != 0 or missing:
        lines = (proc.stderr + proc.stdout).strip().splitlines()
        raise RuntimeError(f"mistral.rs failed (exit {proc.returncode}) before {missing[:1]}: "
                           + " | ".join(lines[-5:]))
    return [json.loads(Path(a["out"]).read_text()) for a in args]


def raw_tensors(d: Path) -> dict:
    """Every tensor of a UQFF set, read with safetensors only (no code of ours)."""
    from safetensors import safe_open

    out = {}
    for shard in sorted(Path(d).glob("*.uqff")):
        with safe_open(str(shard), "pt") as f:
            out.update({k: f.get_tensor(k) for k in f.keys()})
    return out


def teacher_forced_gap(model_dir: Path, mistral: dict, every_weight: bool = False) -> float:
    """Max |logprob| difference between mistral.rs' top-3 at each greedy step (`mistralrs_logprobs`' output)
    and transformers (float32) on `model_dir`, fed mistral.rs' own prompt ids and chosen tokens (so a near-tie
    flip cannot cascade). every_weight: transformers must load every tensor of the folder and miss none (a MoE
    whose experts go unread would run with random ones)."""
    import torch
    from transformers import AutoModelForCausalLM

    model, info = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32, output_loading_info=True)
    # a multi-token-prediction layer after the trunk (GLM-4.5's model.layers.<num_hidden_layers>) is the model's but
    # not the causal LM's: transformers ignores it by index for the released sizes only (46, 92), not a tiny one's
    n = model.config.num_hidden_layers + (getattr(model.config, "num_nextn_predict_layers", 0) or 0)
    mtp = {f"model.layers.{i}." for i in range(model.config.num_hidden_layers, n)}
    unexpected = {k for k in info["unexpected_keys"] if not k.startswith(tuple(mtp))}
    assert not every_weight or not (info["missing_keys"] or unexpected), info
    ids, worst = list(mistral["ids"]), 0.0
    with torch.no_grad():
        for step in mistral["steps"]:
            lp = torch.log_softmax(model(torch.tensor([ids])).logits[0, -1].float(), -1)
            worst = max(worst, max(abs(lp_m - float(lp[tok])) for tok, lp_m in step))
            ids.append(step[0][0])
    return worst


def chat_template_file(dest: Path) -> Path:
    """A jinja template file for mistral.rs (`jinja_explicit`) for model dirs without a chat template."""
    dest.write_text(CHAT_TEMPLATE)
    return dest


# -- the cached set --------------------------------------------------------------------------------------
def _write_one(root: Path, model: str, isq: str) -> Path:
    d = root / f"{model}-{isq}"
    if (d / ".done").exists():
        return d
    if d.exists():
        import shutil

        shutil.rmtree(d)
    d.mkdir(parents=True)
    mistralrs_logprobs(root / model, d / "mistralrs_logprobs.json", write_uqff=str(d / f"{isq}.uqff"), isq=isq)
    (d / ".done").write_text(json.dumps({"model": model, "isq": isq}))
    return d


def ensure_uqff_fixtures(root: Path = DEFAULT_ROOT) -> dict:
    """Build (once) the base models and every mistral.rs-written UQFF; return
    {"wide": dir, "narrow": dir, "uqff": {"wide-q4k": dir, ...}, "failed": {name: message}}."""
    import fcntl

    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    with open(root / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (root / "wide" / ".done").exists():
            build_wide_llama(root / "wide")
            (root / "wide" / ".done").write_text("ok")
        if not (root / "narrow" / ".done").exists():
            build_narrow_llama(root / "narrow")
            (root / "narrow" / ".done").write_text("ok")
        if not (root / "kv32" / ".done").exists():
            build_kv32_llama(root / "kv32")
            (root / "kv32" / ".done").write_text("ok")
        made, failed = {}, {}
        for model, types in (("wide", WIDE_TYPES), ("narrow", NARROW_TYPES), ("kv32", KV32_TYPES)):
            for isq in types:
                try:
                    made[f"{model}-{isq}"] = _write_one(root, model, isq)
                except Exception as e:  # reported by the tests, never silently skipped
                    failed[f"{model}-{isq}"] = str(e)
    return {"root": root, "wide": root / "wide", "narrow": root / "narrow", "kv32": root / "kv32", "uqff": made,
            "failed": failed}


if __name__ == "__main__":
    info = ensure_uqff_fixtures(Path(sys.argv[1]) if len(sys.argv) > 1 else DEFAULT_ROOT)
    for name, d in info["uqff"].items():
        print(name, sorted(p.name for p in d.iterdir()))
    print("failed:", info["failed"])


# -- MoE: tiny Mixtral / Qwen3-MoE and what mistral.rs writes for them -------------------------------------
MOE_ROOT = HERE.parent / "_fixtures" / "uqff_moe"
# transformers model_type -> mistral.rs Architecture
MOE_ARCH = {"mixtral": "Mixtral", "qwen3_moe": "Qwen3Moe"}
MOE_EXPERTS = 4
# ISQ types mistral.rs writes for the MoE models; q8_0 / q4_0 run on a CPU. afq4 is written (and its UQFF
# loads) but mistral.rs 0.9.5's CPU AFQ expert matmul fails ("moe experts forward: non-contiguous lhs"), so
# for afq4 only the files are kept, without log-probabilities.
MOE_RUN_TYPES = ("q8_0", "q4_0")
MOE_WRITE_ONLY_TYPES = ("afq4",)


def mistralrs_moe_ready(model_dir: Path) -> None:
    """mistralrs_ready, plus what mistral.rs' Qwen3-MoE config needs and transformers 5 no longer writes:
    `num_experts` (transformers writes `num_local_experts`) and `max_window_layers` (no sliding window here)."""
    mistralrs_ready(model_dir)
    cfg_path = Path(model_dir) / "config.json"
    cfg = json.loads(cfg_path.read_text())
    if cfg.get("model_type") == "qwen3_moe" and ("num_experts" not in cfg or "max_window_layers" not in cfg):
        cfg.setdefault("num_experts", cfg["num_local_experts"])
        cfg.setdefault("max_window_layers", cfg["num_hidden_layers"])
        cfg_path.write_text(json.dumps(cfg, indent=2) + "\n")


def build_moe(out_dir: Path, kind: str, seed: int = 515) -> Path:
    """A float32 MixtralForCausalLM / Qwen3MoeForCausalLM: hidden 256, expert FFN 512 (so a stacked
    down_proj [E, 256, 512] is told apart from gate/up [E, 512, 256], and K types get rows of 256),
    2 layers, 4 heads of 64, 2 kv heads, 4 experts, top-2, vocab 512. transformers 5.24 saves the experts
    per expert (Mixtral: block_sparse_moe.experts.E.w1/w2/w3, Qwen3-MoE: mlp.experts.E.gate/up/down_proj)."""
    import torch
    from transformers import MixtralConfig, MixtralForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    fx = _fixtures_module()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    common = dict(vocab_size=fx.VOCAB_SIZE, hidden_size=256, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=64, max_position_embeddings=256, rms_norm_eps=1e-5,
                  tie_word_embeddings=False, bos_token_id=1, eos_token_id=0, pad_token_id=None,
                  num_experts_per_tok=2, dtype=torch.float32)
    if kind == "mixtral":
        config, cls = MixtralConfig(intermediate_size=512, num_local_experts=MOE_EXPERTS, **common), MixtralForCausalLM
    elif kind == "qwen3_moe":
        config = Qwen3MoeConfig(intermediate_size=512, moe_intermediate_size=512, num_experts=MOE_EXPERTS,
                                decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True, **common)
        cls = Qwen3MoeForCausalLM
    else:
        raise ValueError(f"unknown MoE kind {kind!r}; known: {sorted(MOE_ARCH)}")
    torch.manual_seed(seed)
    model = cls(config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters(), key=lambda kv: kv[0]):
            shape = tuple(p.shape)
            if name.endswith("norm.weight"):
                v = 1.0 + 0.2 * (torch.rand(shape, generator=gen) - 0.5)
            elif "embed_tokens" in name:
                v = torch.randn(shape, generator=gen)
            else:  # linears, fused 3-D experts and the router: 1/sqrt(fan_in), the last dim
                v = torch.randn(shape, generator=gen) / shape[-1] ** 0.5
            p.copy_(v)
    model.save_pretrained(str(out), safe_serialization=True)
    fx.build_tokenizer(out)
    mistralrs_moe_ready(out)
    return out


_WRITE_ONLY_RUNNER = r'''
import json, os, sys
os.environ["MISTRALRS_CPU_KV_F32"] = "1"
os.environ["HF_HUB_OFFLINE"] = "1"
from mistralrs import Runner, Which, Architecture, ModelDType
a = json.loads(sys.argv[1])
which = dict(model_id=a["model"], arch=getattr(Architecture, a["arch"]), dtype=ModelDType.F32)
runner_kw = dict(token_source="none", no_paged_attn=True)
if a.get("write_uqff"):
    which["write_uqff"] = a["write_uqff"]
    runner_kw["in_situ_quant"] = a["isq"]
if a.get("from_uqff"):
    which["from_uqff"] = a["from_uqff"]
Runner(which=Which.Plain(**which), **runner_kw)
with open(a["out"], "w") as f:
    json.dump({"loaded": True}, f)
'''


def mistralrs_load_only(model_dir: Path, out_json: Path, *, from_uqff=None, write_uqff=None, isq=None,
                        arch: str = "Llama", timeout: int = 600) -> None:
    """Build a mistral.rs Runner (loading a UQFF, or quantizing in situ and writing one) without running a
    request; raises with mistral.rs's message when it cannot load."""
    args = {"model": str(model_dir), "out": str(out_json), "from_uqff": from_uqff, "write_uqff": write_uqff,
            "isq": isq, "arch": arch}
    proc = subprocess.run([sys.executable, "-c", _WRITE_ONLY_RUNNER, json.dumps(args)], capture_output=True,
                          text=True, timeout=timeout, env={**os.environ, "RUST_LOG": "error"})
    if proc.returncode != 0 or not Path(out_json).exists():
        lines = (proc.stderr + proc.stdout).strip().splitlines()
        errors = [ln.strip() for ln in lines if "Error" in ln and "::bt" not in ln and "candle_core" not in ln]
        raise RuntimeError(f"mistral.rs failed (exit {proc.returncode}): " + " | ".join(errors[:3] or lines[-5:]))


def _write_moe_one(root: Path, kind: str, isq: str) -> Path:
    d = root / f"{kind}-{isq}"
    if (d / ".done").exists():
        return d
    if d.exists():
        import shutil

        shutil.rmtree(d)
    d.mkdir(parents=True)
    arch = MOE_ARCH[kind]
    if isq in MOE_WRITE_ONLY_TYPES:
        mistralrs_load_only(root / kind, d / "mistralrs_loaded.json", write_uqff=str(d / f"{isq}.uqff"), isq=isq,
                            arch=arch)
    else:
        mistralrs_logprobs(root / kind, d / "mistralrs_logprobs.json", write_uqff=str(d / f"{isq}.uqff"), isq=isq,
                           arch=arch)
    (d / ".done").write_text(json.dumps({"model": kind, "isq": isq}))
    return d


def ensure_moe_uqff_fixtures(root: Path = MOE_ROOT) -> dict:
    """Build (once) the tiny MoE models and mistral.rs' own UQFFs of them; return
    {"models": {kind: dir}, "uqff": {"mixtral-q8_0": dir, ...}, "plain": {kind: logprobs of the unquantized
    model in mistral.rs}, "failed": {name: message}}."""
    import fcntl

    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    with open(root / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        models, made, plain, failed = {}, {}, {}, {}
        for kind in MOE_ARCH:
            if not (root / kind / ".done").exists():
                build_moe(root / kind, kind)
                (root / kind / ".done").write_text("ok")
            models[kind] = root / kind
            plain_json = root / f"{kind}-plain.json"
            try:
                if not plain_json.exists():
                    mistralrs_logprobs(root / kind, plain_json, arch=MOE_ARCH[kind])
                plain[kind] = json.loads(plain_json.read_text())
            except Exception as e:  # reported by the tests, never silently skipped
                failed[f"{kind}-plain"] = str(e)
            for isq in MOE_RUN_TYPES + MOE_WRITE_ONLY_TYPES:
                try:
                    made[f"{kind}-{isq}"] = _write_moe_one(root, kind, isq)
                except Exception as e:
                    failed[f"{kind}-{isq}"] = str(e)
    return {"root": root, "models": models, "uqff": made, "plain": plain, "failed": failed}
