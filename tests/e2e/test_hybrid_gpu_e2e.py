"""A real hybrid model on a GPU: sliding-window + full attention under HMA.

Needs a CUDA device, a CUDA build of vLLM 0.33 and the real
``mooncake_master``; skipped with a reason elsewhere (CI and the CPU e2e
venv have no device).  A tiny random-weight Gemma 2 (layers alternate
sliding-window and full attention, so vLLM plans two KV cache groups) is
written locally, no hub involved.  Engine A saves its prompts' KV through
`MooncakeLifecycleConnector`; engine B, with its own prefix cache off,
serves the same prompts from the store: its prompt tokens are reported
cached and its greedy tokens equal a connector-less baseline.  Both run
with the hybrid KV cache manager on: vLLM kept HMA for the connector.
"""

from __future__ import annotations

import gc
import uuid

import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip(
        "needs a CUDA device (torch.cuda.is_available() is False)",
        allow_module_level=True,
    )
pytest.importorskip("vllm")
transformers = pytest.importorskip("transformers")

from tests.connector_helpers import store_extra  # noqa: E402

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.gpu,
    pytest.mark.vllm,
    pytest.mark.mooncake,
    pytest.mark.slow,
]

BLOCK = 16
MAX_TOKENS = 8
PROMPT_LENS = (97, 150, 64)


@pytest.fixture(scope="module")
def gemma2(tmp_path_factory):
    """A 4-layer random Gemma 2 with a 32-token sliding window."""
    config = transformers.Gemma2Config(
        vocab_size=512,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        sliding_window=32,
        max_position_embeddings=512,
        torch_dtype="bfloat16",
    )
    torch.manual_seed(0)
    model = transformers.Gemma2ForCausalLM(config).to(torch.bfloat16)
    out = tmp_path_factory.mktemp("gemma2-tiny")
    model.save_pretrained(out, safe_serialization=True)
    return out


def _prompts():
    return [
        {"prompt_token_ids": [(i * 7 + n) % 500 + 3 for i in range(n)]}
        for n in PROMPT_LENS
    ]


def _generate(model, transfer=None):
    from vllm import LLM, SamplingParams  # noqa: PLC0415

    llm = LLM(
        model=str(model),
        skip_tokenizer_init=True,
        block_size=BLOCK,
        max_model_len=512,
        gpu_memory_utilization=0.2,
        enforce_eager=True,
        enable_prefix_caching=False,
        kv_transfer_config=transfer,
    )
    try:
        config = llm.llm_engine.vllm_config
        hma = not config.scheduler_config.disable_hybrid_kv_cache_manager
        params = SamplingParams(
            max_tokens=MAX_TOKENS, temperature=0.0, detokenize=False
        )
        outputs = llm.generate(_prompts(), params)
        return hma, outputs
    finally:
        del llm
        gc.collect()
        torch.cuda.empty_cache()


def test_hybrid_gemma2_prefix_served_from_store(gemma2, mooncake_master):
    """B serves A's prompts from the store, both groups, same tokens."""
    from vllm.config import KVTransferConfig  # noqa: PLC0415

    _, baseline = _generate(gemma2)
    extra = store_extra(mooncake_master, f"hybrid-gpu-{uuid.uuid4().hex}")

    def transfer():
        return KVTransferConfig(
            kv_connector="MooncakeLifecycleConnector",
            kv_connector_module_path="connector.integration.vllm_connector",
            kv_role="kv_both",
            kv_connector_extra_config=extra,
        )

    hma_a, _ = _generate(gemma2, transfer())
    hma_b, served = _generate(gemma2, transfer())
    assert hma_a
    assert hma_b
    for want, got, n in zip(baseline, served, PROMPT_LENS, strict=True):
        assert got.outputs[0].token_ids == want.outputs[0].token_ids
        assert got.num_cached_tokens == (n - 1) // BLOCK * BLOCK
