"""Fuzz every qconvert reader with seeded mutations of real checkpoints, run as a user runs qconvert.

    python scripts/fuzz [--readers gptq,gguf,...] [--cases N] [--seed S] [--jobs J] [--timeout T]
                        [--findings F.jsonl] [--report-md F.md] [--keep DIR] [--work DIR]
    python scripts/fuzz --replay CASE.json          (or --replay '{"reader": ..., "seed": ..., ...}')

Seeds are the test fixtures (tests/_fixtures: gptqmodel GPTQ/QQQ checkpoints, hqq's transformers safetensors
and qmodel.pt folders, mistral.rs UQFF folders, the dense base models) and GGUFs written by
`qconvert gptq->gguf` / `hf->gguf` and, when llama-cpp-python is installed, by llama.cpp's own
`llama_model_quantize` (cached under --work). Each case copies one seed, applies one mutation (truncation,
byte flips, structured header / metadata / config / file edits) and runs `qconvert inspect PATH` and
`qconvert 'FMT->hf' PATH OUT --type f32 --quiet` through `qconvert.converters.apps.cli.main` in a forked child of
this process (which imported qconvert once and never runs a torch op itself), with its fd 1/2 in files,
one torch thread, a time bound (--timeout) and a memory bound (RLIMIT_AS = VmSize + max(512 MB, 8 x input
bytes); the peak RSS growth is read too).

Outcomes:
  ok             exit 0
  refused        exit 2, exactly one stderr line `qconvert: error: ...` naming a file of the input, nothing at OUT
  bad-refusal    exit 2 but several lines, no input file named, library text quoted (`IndexError:`, ...), or
                 output / temporaries left behind
  warning-first  something on stderr before the error line
  traceback      any other exit (an uncaught exception, a crash by signal)
  hang           over the time bound
  alloc          over the memory bound (MemoryError, allocator failures, RSS growth)
  silent         a structural mutation (header / metadata / config / file edit, truncation; not a data-byte
                 flip) that exits 0 with converted tensors that differ from the seed's conversion (names,
                 dtypes, shapes, bytes)
  noisy          exit 0 with something on stderr (informational)

A case is reproducible from (reader, seed name, case number, master seed): the seed is drawn with
Random("master:reader:case") and the mutation with Random("master:reader:case:seed").

The package (run as `python scripts/fuzz`, see __main__.py):
  common.py       the repository, the fixtures folder (set once from --fixtures), the readers, small helpers
  seeds.py        the seeds each reader draws from: fixture folders and the GGUFs the fuzzer builds
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
