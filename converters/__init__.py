"""The conversion core every format shares: the intermediate (records.py), the schemes and the one checker
(checker.py), the plan and the writer contract (plan.py), the runner (run.py), atomic output (output.py), the
report (report.py), the registry of formats (registry.py), errors, validation of what files say (validate.py)
and model shapes and architectures (model_shapes.py). It imports kernels, never a format nor an application;
the applications (the CLI, batch, verify and its runtimes) are converters/apps/."""
