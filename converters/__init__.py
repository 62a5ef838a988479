"""The core every format shares: records, registry, alignment checker, planner, runner, report, CLI."""
