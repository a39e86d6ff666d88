"""Mooncake tenants through the connector's store client, on a real master.

A master started with ``--enable_multi_tenants=true`` and a quota file
(Mooncake's YAML policy: ``version: 1``, ``tenants: [{name, quota}]``)
keeps each client's tenant (``tenant_id``) apart: a tenant never sees
another's keys, and a tenant that fills its quota evicts its own objects,
never another tenant's.
"""

from __future__ import annotations

import time

import numpy as np
import pytest

from connector.ops.master import EmbeddedMaster, store_config_for
from connector.store import StoreClient

pytestmark = [pytest.mark.mooncake]

BLOCK = 1 << 20
QUOTA_BLOCKS = 8


@pytest.fixture(scope="module")
def tenant_master(tmp_path_factory):
    quota = tmp_path_factory.mktemp("tenants") / "quota.yaml"
    quota.write_text(
        "version: 1\n\ntenants:\n"
        f'  - name: "alpha"\n    quota: {QUOTA_BLOCKS}MB\n'
        f'  - name: "beta"\n    quota: {QUOTA_BLOCKS}MB\n'
    )
    with EmbeddedMaster(
        lease_ttl_ms=200,
        extra_flags=(
            "--enable_multi_tenants=true",
            f"--tenant_quota_connector_uri={quota}",
        ),
    ) as master:
        yield master


@pytest.fixture
def tenant(tenant_master):
    """Opens a client of a tenant; all are closed at teardown."""
    opened = []

    def open_client(name):
        client = StoreClient.open(
            store_config_for(tenant_master, tenant_id=name)
        )
        opened.append(client)
        return client

    yield open_client
    for client in opened:
        client.close()


def blocks(n, first=0):
    data = [np.full(BLOCK, first + i, dtype=np.uint8) for i in range(n)]
    return data, [(d.ctypes.data, BLOCK) for d in data]


def test_tenants_never_see_each_others_keys(tenant):
    alpha, beta = tenant("alpha"), tenant("beta")
    data, regions = blocks(2)
    for client in (alpha, beta):
        for d in data:
            client.register(d.ctypes.data, BLOCK)
    assert alpha.put(["k0"], regions[:1]).num_failed == 0
    assert alpha.exists(["k0"]).num_failed == 0
    assert beta.exists(["k0"]).num_failed == 1  # a MISS for beta
    got = np.zeros(BLOCK, dtype=np.uint8)
    beta.register(got.ctypes.data, BLOCK)
    assert beta.get(["k0"], [(got.ctypes.data, BLOCK)]).num_failed == 1
    # beta's own k0 is another object: alpha's stays as it was.
    assert beta.put(["k0"], regions[1:]).num_failed == 0
    alpha.register(got.ctypes.data, BLOCK)
    assert alpha.get(["k0"], [(got.ctypes.data, BLOCK)]).num_failed == 0
    assert got[0] == 0
    assert beta.get(["k0"], [(got.ctypes.data, BLOCK)]).num_failed == 0
    assert got[0] == 1


def test_a_tenant_filling_its_quota_evicts_only_its_own_objects(tenant):
    alpha, beta = tenant("alpha"), tenant("beta")
    data, regions = blocks(3 * QUOTA_BLOCKS)
    for client in (alpha, beta):
        for d in data:
            client.register(d.ctypes.data, BLOCK)
    mine = [f"b{i}" for i in range(4)]
    assert beta.put(mine, regions[:4]).num_failed == 0
    theirs = [f"a{i}" for i in range(3 * QUOTA_BLOCKS)]
    for key, region in zip(theirs, regions, strict=True):
        alpha.put([key], [region])
        time.sleep(0.01)
    time.sleep(0.5)  # leases of the puts' own lookups run out
    held = alpha.exists(theirs)
    assert len(theirs) - held.num_failed <= QUOTA_BLOCKS
    assert beta.exists(mine).num_failed == 0
