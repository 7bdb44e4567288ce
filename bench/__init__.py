"""Pylon's benchmarks (issue 7): a multi-process HTTP/3 load generator, direct vs
Pylon vs Caddy comparisons, per-class priority behaviour under overload, and
Pylon's memory across a long run (soak).

Run `python -m bench --help`; what the numbers mean is in docs/performance.md.
Pure helpers (`stats`, `sse`, `table`, `workloads`, `queueing`, `compare_report`,
`soak_report`, `caddy`, the parsers in `procfs`) are separate from the I/O (`load`,
`drivers`, `h3client`, `stack`, `measure`, `output`, `plots`, `compare`, `priority`,
`soak`).
`experiments/` holds launchers that run a patched Pylon as a `--candidate-command`.
"""

__all__ = ["compare", "load", "priority", "soak"]
