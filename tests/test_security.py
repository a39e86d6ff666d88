"""Security: store contents are untrusted bytes; namespaces isolate tenants.

- No code in `connector/` can turn bytes into objects or code: no
  pickle-family import, no `eval`/`exec`/`compile`/`__import__`, no
  `torch.load` or `numpy.load` (checked on the AST).
- A pickle payload stored under a KV key is loaded into the KV block as
  plain bytes, and never runs.
- Through the real connector in vLLM's real scheduler, a different
  namespace (tenant) or model never sees another's KV; the same one does.
"""

from __future__ import annotations

import ast
import os
import pickle
import time
from pathlib import Path

import pytest
import torch

from connector.metadata import ConnectorMeta, JobKind, TransferJob
from connector.store import Regions
from connector.store.keys import KeyLayout, KeyScheme
from connector.worker.side import KVLayout, WorkerSide
from tests.connector_helpers import CONNECTOR, run, store_extra

CONNECTOR_DIR = Path(__file__).resolve().parent.parent / "connector"

FORBIDDEN_MODULES = frozenset(
    {"pickle", "cPickle", "_pickle", "marshal", "shelve", "dill",
     "cloudpickle", "joblib", "jsonpickle", "yaml"}
)  # fmt: skip
FORBIDDEN_CALLS = frozenset({"eval", "exec", "compile", "__import__"})
FORBIDDEN_ATTRS = frozenset(
    {("torch", "load"), ("numpy", "load"), ("np", "load"),
     ("pickle", "loads"), ("pickle", "load")}
)  # fmt: skip


def dangerous(tree):
    """(line, what) for every way the module could deserialize or exec."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [
                (node.lineno, f"import {a.name}")
                for a in node.names
                if a.name.split(".")[0] in FORBIDDEN_MODULES
            ]
        elif isinstance(node, ast.ImportFrom):
            root = (node.module or "").split(".")[0]
            if root in FORBIDDEN_MODULES:
                found.append((node.lineno, f"from {node.module} import"))
            found += [
                (node.lineno, f"from {node.module} import {a.name}")
                for a in node.names
                if (root, a.name) in FORBIDDEN_ATTRS
            ]
        elif isinstance(node, ast.Call):
            func = node.func
            if isinstance(func, ast.Name) and func.id in FORBIDDEN_CALLS:
                found.append((node.lineno, f"{func.id}()"))
            if (
                isinstance(func, ast.Attribute)
                and isinstance(func.value, ast.Name)
                and (func.value.id, func.attr) in FORBIDDEN_ATTRS
            ):
                found.append((node.lineno, f"{func.value.id}.{func.attr}()"))
    return found


class TestNoDeserialization:
    def test_connector_never_unpickles_or_executes(self):
        """No module of `connector/` can deserialize objects or run code."""
        sources = sorted(CONNECTOR_DIR.glob("*.py"))
        assert len(sources) >= 5
        found = {
            path.name: hits
            for path in sources
            if (hits := dangerous(ast.parse(path.read_text())))
        }
        assert found == {}

    @pytest.mark.parametrize(
        "source",
        [
            "import pickle",
            "from pickle import loads",
            "import torch\ntorch.load(f)",
            "eval(data)",
            "exec(code)",
            "import numpy as np\nnp.load(f)",
            "from torch import load",
        ],
    )
    def test_the_check_catches(self, source):
        """The AST check is not vacuous: each pattern is found."""
        assert dangerous(ast.parse(source))


class Boom:
    """Unpickling this creates `path`: proof that something unpickled."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (os.mkdir, (self.path,))


@pytest.mark.mooncake
def test_pickle_payload_loads_as_bytes(store_client, kv_blocks, tmp_path):
    """A pickle stored as KV arrives in the block byte for byte, inert."""
    block = 4096
    marker = tmp_path / "unpickled"
    payload = pickle.dumps(Boom(str(marker)))
    data = payload + b"\0" * (block - len(payload))
    scheme = KeyScheme(
        namespace="security",
        model="m",
        tp_rank=0,
        tp_size=1,
        layout=KeyLayout("uint8", 16, block),
    )
    src = kv_blocks(store_client, 1, block)
    src.tensor[0] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    hashes = [os.urandom(16)]
    assert store_client.put(scheme.keys(hashes), src.regions([0])).ok

    kv = kv_blocks(store_client, 4, block)
    kv.zero()
    layout = KVLayout.from_tensors({"layer": kv.tensor}, 4)
    worker = WorkerSide(store_client, scheme, layout, Regions)
    job = TransferJob(0, JobKind.LOAD, "evil", 0, (2,), tuple(hashes))
    try:
        worker.start_load_kv(ConnectorMeta(step=1, jobs=(job,)))
        finished = set()
        deadline = time.monotonic() + 10.0
        while not finished and time.monotonic() < deadline:
            finished |= worker.get_finished()[1] or set()
            time.sleep(0.01)
    finally:
        worker.shutdown()
    assert finished == {"evil"}
    assert worker.get_block_ids_with_load_errors() == set()
    assert bytes(kv.tensor[2].numpy()) == data
    assert not marker.exists()


@pytest.mark.vllm
@pytest.mark.mooncake
class TestNamespaces:
    """Tenants (namespaces) and models sharing one master stay apart."""

    @pytest.fixture
    def make(self, mooncake_master, unique, harnesses):
        pytest.importorskip("vllm")
        from harness import Harness  # noqa: PLC0415

        def _make(namespace, **kwargs):
            extra = store_extra(
                mooncake_master,
                f"{unique}-{namespace}",
                local_hostname="127.0.0.1",
            )
            h = Harness(CONNECTOR, extra_config=extra, num_blocks=40, **kwargs)
            harnesses.append(h)
            return h

        return _make

    @staticmethod
    def hits(h, tokens):
        h.add_request("r", tokens, max_tokens=2)
        run(h)
        return h.external_hits["r"]

    def test_tenants_and_models_are_isolated(self, make):
        """Only the same namespace and model load what tenant A saved."""
        tokens = [(7 * i + 3) % 500 for i in range(64)]
        self.hits(make("tenant-a"), tokens)
        query = [*tokens, 1]
        assert self.hits(make("tenant-b"), query) == 0
        # Another model: the harness writes a second model folder.
        assert self.hits(make("tenant-a", max_model_len=2048), query) == 0
        assert self.hits(make("tenant-a"), query) == 64
