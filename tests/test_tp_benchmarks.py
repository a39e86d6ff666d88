"""`benchmarks.tp` and `benchmarks.multiturn` run and report sane JSON.

Tiny runs on a real master; the figures are checked for shape and for
the direction each feature promises, never for speed.
"""

import json

import pytest

pytest.importorskip("vllm")

from benchmarks import multiturn, tp

pytestmark = [pytest.mark.vllm, pytest.mark.mooncake]


def test_tp_benchmark(capsys, master_binary):
    assert tp.main(["--json", "--prompts", "1"]) == 0
    doc = json.loads(capsys.readouterr().out)
    per_block = doc["bytes_put_per_block"]
    assert per_block["every_rank"] == 2 * per_block["one_writer"] > 0
    hits = doc["hit_tokens"]
    assert hits == {"asked": 128, "per_rank": 0, "head_shards": 128}


def test_multiturn_benchmark(capsys, master_binary):
    argv = ["--json", "--conversations", "2", "--turns", "2", "--seed", "3"]
    assert multiturn.main(argv) == 0
    doc = json.loads(capsys.readouterr().out)
    hit, redo = doc["hit_rate"], doc["tokens_recomputed"]
    assert (
        set(hit)
        == set(redo)
        == set(doc["bytes_put"])
        == {
            "decode_cache",
            "prompt_only",
        }
    )
    assert 0 <= hit["prompt_only"] <= hit["decode_cache"] <= 1
    assert redo["decode_cache"] <= redo["prompt_only"]
    stored = doc["store_hit_tokens"]
    assert stored["decode_cache"] >= stored["prompt_only"]
    assert doc["bytes_put"]["decode_cache"] > doc["bytes_put"]["prompt_only"]
