"""Every exception of `lifecycle` and `connector` carries its data as
attrs fields and survives pickling (it may cross vLLM's process
boundaries) with its type, fields and message intact."""

from __future__ import annotations

import importlib
import pickle
import pkgutil

import attrs
import pytest

import connector
import lifecycle
from connector import errors as cerr
from lifecycle import errors as lerr
from lifecycle.__main__ import TableNotFoundError
from lifecycle.kv import Event, State
from lifecycle.sphinxext import TableReferenceError
from lifecycle.trace import writer as trace_writer

pytestmark = (
    pytest.mark.vllm
)  # connector.integration.vllm_connector is walked too

#: Bases that only name a family; they carry no data of their own.
BASES = {
    cerr.ConnectorError,
    cerr.MasterError,
    cerr.StoreError,
    lerr.LifecycleError,
}


def _samples() -> dict[type[BaseException], BaseException]:
    problem = lerr.TableProblem("duplicate-row", "NEW --finish--> twice")
    made: list[BaseException] = [
        cerr.ConnectorError("base"),
        cerr.MasterError("base"),
        cerr.StoreError("base"),
        lerr.LifecycleError("base"),
        cerr.ConfigError("global_segment_size", "-1", "must be >= 0"),
        cerr.KeySchemeError("tp_rank", -1, "must be >= 0"),
        cerr.MasterBinaryNotFoundError(("/usr/bin", "/opt")),
        cerr.MasterStartError("exited", 3, 2, ("a", "b")),
        cerr.MasterNotRunningError("pause"),
        cerr.ServiceStartError("etcd", "exited", 1, ("a",)),
        cerr.StoreUnavailable("127.0.0.1:1", None, "connection refused"),
        cerr.StoreClosedError("put"),
        cerr.RegistrationError(0x1000, 4096, -1, "no memory"),
        cerr.RegionError(3, "size 0"),
        cerr.UnsupportedKVGroups(
            ("0:full_attention", "1:mamba"),
            "full_attention, sliding_window",
            "group 1 is mamba",
        ),
        cerr.UnsupportedParallelism(
            "pipeline_parallel_size", 2, "stages cannot be looked up"
        ),
        cerr.ParallelRankError(
            "tensor-parallel rank", 2, "AssertionError: no TP group"
        ),
        lerr.IllegalTransition(State.NEW, Event.LOAD_DONE, "r1", 2),
        lerr.UnknownRequest(Event.FINISH, "r2"),
        lerr.GuardRefused(State.SAVING, Event.FINISH, "r3", 1, (), "kv"),
        lerr.ReentrantFire(Event.ABORT, "r4", "kv"),
        lerr.InvalidTable((problem,)),
        trace_writer.TraceError("traces/t.jsonl", "no such file"),
        trace_writer.TableMismatchError("traces/t.jsonl", "abc", "def"),
        TableNotFoundError("--table must be MODULE:NAME, got 'x'"),
        TableReferenceError("mod:NAME", "no attribute NAME"),
    ]
    return {type(e): e for e in made}


def _exception_classes() -> set[type[BaseException]]:
    found: set[type[BaseException]] = set()
    for package in (lifecycle, connector):
        names = [package.__name__] + [
            m.name
            for m in pkgutil.walk_packages(
                package.__path__, package.__name__ + "."
            )
        ]
        for name in names:
            module = importlib.import_module(name)
            for value in vars(module).values():
                if (
                    isinstance(value, type)
                    and issubclass(value, BaseException)
                    and value.__module__ == name
                ):
                    found.add(value)
    return found


def test_every_exception_class_has_a_sample():
    """A new exception class must be added here (and so be checked)."""
    assert _exception_classes() == set(_samples())


@pytest.mark.parametrize(
    "error", list(_samples().values()), ids=lambda e: type(e).__name__
)
def test_exception_pickles_with_its_fields(error):
    back = pickle.loads(pickle.dumps(error))  # noqa: S301 - our own bytes
    assert type(back) is type(error)
    assert str(back) == str(error)
    assert back.args == error.args
    if type(error) in BASES:
        return
    assert attrs.has(type(error)), "data belong in attrs fields"
    fields = attrs.fields(type(error))
    assert fields
    for field in fields:
        assert getattr(back, field.name) == getattr(error, field.name)


def test_messages_name_the_data():
    samples = _samples()
    assert str(samples[cerr.ConfigError]) == (
        "config key 'global_segment_size': must be >= 0 (got '-1')"
    )
    illegal = samples[lerr.IllegalTransition]
    assert str(illegal) == "`load_done` is not allowed in NEW (request r1)"
    unknown = samples[lerr.UnknownRequest]
    assert (unknown.state, unknown.epoch) == (None, None)
    assert "an unknown request" in str(unknown)
    mismatch = samples[trace_writer.TableMismatchError]
    assert mismatch.reason.startswith("recorded with table fingerprint def")
    assert str(mismatch).startswith("trace traces/t.jsonl: recorded with")
    assert samples[lerr.InvalidTable].kinds == {"duplicate-row"}
