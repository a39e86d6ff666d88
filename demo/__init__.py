"""A serving session through vLLM's real scheduler (`make demo`).

`demo.session` drives two `harness.scheduler.Harness` instances over one
Mooncake master with a seeded workload and collects what happened;
`python -m demo` runs it with a progress bar and prints the report;
`benchmarks.soak` runs the same workload at scale.  Needs vLLM 0.33 and
the `mooncake_master` binary (both installed by `make venv`).
"""
