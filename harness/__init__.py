"""Test infrastructure for driving a KV connector through vLLM's scheduler.

`harness.scheduler` holds `Harness`: vLLM 0.33's real `Scheduler` (or
`AsyncScheduler`) with a stand-in model runner whose KV content is a pure
function of the token prefix, so every step can check each computed block
against what recomputation would write (the KV oracle), check the block
pool, and, at the end, that every request finished and every block came
back.

It is a package of its own, beside the runtime packages, because four
trees use it: `tests/`, `demo/`, `benchmarks/` and `e2e/`.  The runtime
packages (`lifecycle`, `connector`) never import it; an import-linter
contract in `pyproject.toml` holds that.

It does not ship in the wheel.  It is test infrastructure for this
repository: it drives vLLM's scheduler with a synthetic model written
under the repository's `.cache/`, and its users (`tests/`, `demo/`,
`benchmarks/`) are not shipped either.  An operator installing
`kv-lifecycle` gets the connector and the lifecycle library only.

Importing it touches neither vLLM nor torch (`Harness` imports them when
built), so it imports where vLLM is absent.
"""

from harness.scheduler import (
    FinishedRequest,
    Harness,
    HarnessError,
    KVRole,
    StepReport,
    vllm_available,
)

__all__ = [
    "FinishedRequest",
    "Harness",
    "HarnessError",
    "KVRole",
    "StepReport",
    "vllm_available",
]
