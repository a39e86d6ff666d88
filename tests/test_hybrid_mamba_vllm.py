"""Recurrent-state (Mamba) groups under vLLM 0.33's hybrid KV cache manager.

Every scenario runs `harness.hybrid.HybridHarness` with a recurrent
group (a ``MambaSpec`` in ``mamba_cache_mode="align"``) beside full
attention, and beside full attention and a sliding window: vLLM's real
Scheduler and `HybridKVCacheCoordinator`, `MooncakeLifecycleConnector`
over a real master.  The harness runner reads and writes states as
vLLM's align-mode runner does and fails any step that resumes from a
missing or wrong state; after every step it checks every block of every
group, the recurrent ones included.  `pytest -k "hybrid and mamba"`
selects them.
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from connector.groups import GroupKind
from harness.hybrid import HybridHarness
from tests.connector_helpers import CONNECTOR, assert_clean, prompt, run, side
from tests.test_hybrid_vllm import moved, tally, worker

pytestmark = [pytest.mark.vllm, pytest.mark.mooncake]

BS = 16
LAYOUTS = {
    "mamba": ("full", "mamba"),
    "mamba+swa": ("full", "sliding", "mamba"),
}


@pytest.fixture(params=sorted(LAYOUTS))
def layout(request):
    return LAYOUTS[request.param]


@pytest.fixture
def make(extra, harnesses, layout):
    def _make(**kwargs):
        kwargs.setdefault("num_blocks", 64)
        kwargs.setdefault("sliding_window", 40)
        kwargs.setdefault("kinds", layout)
        h = HybridHarness(CONNECTOR, extra_config=extra, **kwargs)
        harnesses.append(h)
        return tally(h)

    return _make


def state_group(h):
    return h.kinds.index("mamba")


def test_hybrid_mamba_smoke(make):
    a = make(kv_role="kv_producer")
    a.add_request("a", prompt(1, 128), max_tokens=3)
    run(a)
    print(side(a).state_counts, moved(a, "save"))
    b = make(kv_role="kv_consumer")
    b.add_request("b", [*prompt(1, 128), 7, 8], max_tokens=4)
    run(b)
    print(b.external_hits, moved(b, "load"))
    assert_clean(b)
