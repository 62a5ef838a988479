"""Fuzz every qconvert reader with seeded mutations of real checkpoints, run as a user runs qconvert.

    python scripts/fuzz [--readers gptq,gguf,...] [--cases N] [--seed S] [--jobs J] [--timeout T]
                        [--no-inspect] [--targets hf,gguf] [--mutations REGEX] [--summary-json F]
                        [--findings F.jsonl] [--report-md F.md] [--keep DIR] [--work DIR]
    python scripts/fuzz --replay CASE.json          (or --replay '{"reader": ..., "seed": ..., ...}')

Seeds (seeds.READER_SEEDS, one entry per reader; 16 readers) are the test fixtures (tests/_fixtures: gptqmodel
GPTQ/QQQ checkpoints, hqq's transformers safetensors and qmodel.pt folders, mistral.rs UQFF folders, the dense
base models, FP8 and gpt-oss MXFP4 checkpoints), the producer fixtures (tests/producer_fixtures: AWQ,
auto-round, bitsandbytes, compressed-tensors, MLX, ModelOpt) and GGUFs written by `qconvert gptq->gguf` /
`hf->gguf` and, when llama-cpp-python is installed, by llama.cpp's own `llama_model_quantize` (cached under
--work). Each case copies one seed, applies one mutation (truncation, byte flips, structured header / metadata /
config / file edits) and runs `qconvert inspect PATH` (unless --no-inspect), the reader's target conversion
(`qconvert 'FMT->hf' PATH OUT --type f32 --quiet`, or `FMT->gguf` for a reader whose target is gguf) and, with
--targets hf,gguf, `FMT->gguf --type f16`, through `qconvert.converters.apps.cli.main` in a forked child of
this process (which imported qconvert once and never runs a torch op itself), with its fd 1/2 in files,
one torch thread, a time bound (--timeout) and a memory bound (RLIMIT_AS = VmSize + max(512 MB, 8 x input
bytes); the peak RSS growth is read too).

The oracle: every case whose target conversion exits 0 has each output tensor (name, dtype, shape, SHA-1 of
its bytes) compared with the seed's own conversion.

Outcomes:
  exact          exit 0, every output tensor equal to the seed's
  changed        exit 0 after a data mutation (tensor bytes, a same-size type, a finite scale) that changed
                 tensors: undetectable without a checksum
  refused        exit 2, exactly one stderr line `qconvert: error: ...` naming a file of the input, nothing at OUT
  noisy          exit 0 with something on stderr (informational)
  silent         any other mutation (header / metadata / config / file edit, truncation) that exits 0 with
                 output tensors that differ from the seed's conversion (missing, extra, other bytes)
  warning-first  something on stderr before the error line
  no-file        exit 2 with a line that names no file of the input
  bad-refusal    exit 2 but several lines, library text quoted (`IndexError:`, ...), or output / temporaries
                 left behind
  traceback      any other exit (an uncaught exception, a crash by signal)
  hang           over the time bound
  alloc          over the memory bound (MemoryError, allocator failures, RSS growth)
  error          the fuzzer itself failed on the case
  ok             exit 0 not compared (the seed's own conversion failed: a seed problem)

A case is reproducible from (reader, seed name, case number, master seed): the seed is drawn with
Random("master:reader:case") and the mutation with Random("master:reader:case:seed").

The package (run as `python scripts/fuzz`, see __main__.py):
  common.py       the repository, the fixtures folder (set once from --fixtures), small helpers
  seeds.py        the readers and their seeds (READER_SEEDS: one entry per reader), the GGUFs the fuzzer builds
  formats.py      safetensors, GGUF and zip structure in pure Python (the parent never runs torch)
  mutations.py    the mutations (m_*), their weights (MUTATIONS) and apply_mutation
  tested_code.py  the only place that imports qconvert: the code hash, preload_qconvert, run_cli
  child.py        what a forked child does: copy and mutate a seed, run the CLI under bounds, build GGUF seeds
  pool.py         the fork server (ForkPool)
  classify.py     a finished child's files -> its outcome and signature
  fuzzer.py       the driver: plan the cases, the seeds' reference conversions, count and record findings
  report.py       the console table and summary, the markdown report, the summary JSON
  cli.py          main (the options) and --replay
"""

import os

# before anything imports torch or qconvert (every entry to the package runs this first): one thread per
# child, no compilation, never the network
for _k, _v in {"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "QCONVERT_THREADS": "1",
               "QCONVERT_COMPILE": "0", "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1",
               "TRANSFORMERS_OFFLINE": "1", "GPTQMODEL_CPU_WORKERS": "2"}.items():
    os.environ.setdefault(_k, _v)
