"""A local HA master set: one etcd and N ``mooncake_master --enable_ha``.

``HAMasters`` starts an ``EmbeddedEtcd`` and ``n`` ``EmbeddedMaster``
processes in HA mode (``--enable_ha --etcd_endpoints --cluster_id
--enable_oplog``) on loopback, and returns from ``start()`` once one of
them leads and serves. Clients reach the set through etcd, not through a
master: ``rpc_address`` is Mooncake's ``etcd://host:port`` form, and the
transfer-engine metadata lives in the same etcd (``metadata_server``), so
neither dies with a master. ``store_config_for(ha)`` builds a client
config for it (``cluster_id`` included).

Failover as measured on the 0.3.13.post1 wheel: the leader's etcd lease
(5 s, fixed in Mooncake) expires, a standby is elected and warms up for
another lease period before it serves: about 10 s in all.

Example::

    with HAMasters(masters=2) as ha:
        config = store_config_for(ha)
        ...
        ha.leader().kill()
        ha.wait_serving(timeout_s=20)
"""

from __future__ import annotations

import time
from typing import Any, Final, Self

from connector.errors import ServiceStartError
from connector.ops.master import EmbeddedMaster, _StartStop
from connector.ops.procs import EmbeddedEtcd

__all__ = ["HAMasters"]

_SERVICE: Final = "HA master set"


class HAMasters(_StartStop):
    """etcd plus ``masters`` HA masters on loopback, all owned here.

    Contracts: ``start()`` returns once a leader serves (``/health``
    ``service_ready``), or raises ``ServiceStartError`` / a master's
    start error, having stopped what it started; ``stop()`` stops every
    master, then etcd, and is idempotent. Every process dies with its
    owner (``PR_SET_PDEATHSIG``).

    Args:
        masters: how many masters (2 or more for a failover).
        cluster_id: ``--cluster_id`` (also the clients' ``cluster_id``).
        enable_oplog: replicate the leader's metadata to standbys.
        master_kwargs: more ``EmbeddedMaster`` arguments for each master.
        start_timeout_s: bound of waiting for the first serving leader.
    """

    def __init__(
        self,
        *,
        masters: int = 2,
        cluster_id: str = "kv-lifecycle",
        enable_oplog: bool = True,
        master_kwargs: dict[str, Any] | None = None,
        start_timeout_s: float = 60.0,
    ) -> None:
        if masters < 1:
            reason = f"masters must be >= 1, got {masters}"
            raise ServiceStartError(_SERVICE, reason, None, ())
        self.n_masters = masters
        self.cluster_id = cluster_id
        self.enable_oplog = enable_oplog
        self.master_kwargs = dict(master_kwargs or {})
        self.start_timeout_s = start_timeout_s
        self.etcd: EmbeddedEtcd | None = None
        self.masters: list[EmbeddedMaster] = []

    # -- addresses (what store_config_for reads) ----------------------------

    @property
    def etcd_endpoint(self) -> str:
        """``127.0.0.1:<port>`` of the etcd."""
        if self.etcd is None:
            reason = "not started"
            raise ServiceStartError(_SERVICE, reason, None, ())
        return self.etcd.endpoint

    @property
    def rpc_address(self) -> str:
        """``etcd://127.0.0.1:<port>``: the clients' master address."""
        return f"etcd://{self.etcd_endpoint}"

    @property
    def metadata_server(self) -> str:
        """``etcd://127.0.0.1:<port>``: transfer-engine metadata in etcd."""
        return f"etcd://{self.etcd_endpoint}"

    # -- lifecycle -----------------------------------------------------------

    def start(self) -> Self:
        """Start etcd and the masters; wait for a serving leader."""
        try:
            self.etcd = EmbeddedEtcd().start()
            for _ in range(self.n_masters):
                master = EmbeddedMaster(
                    etcd_endpoints=self.etcd.endpoint,
                    cluster_id=self.cluster_id,
                    enable_oplog=self.enable_oplog,
                    **self.master_kwargs,
                )
                self.masters.append(master)
                master.start()
            self.wait_serving(timeout_s=self.start_timeout_s)
        except BaseException:
            self.stop()
            raise
        return self

    def leader(self) -> EmbeddedMaster | None:
        """The running master whose ``/health`` says it leads, if any."""
        for master in self.masters:
            if not master.running:
                continue
            body = master.health()
            if body is not None and body.get("role") == "leader":
                return master
        return None

    def wait_serving(self, *, timeout_s: float = 30.0) -> EmbeddedMaster:
        """Wait until a running master leads and serves; return it.

        Raises:
            ServiceStartError: none did within ``timeout_s``.
        """
        deadline = time.monotonic() + timeout_s
        while True:
            for master in self.masters:
                if master.running and master.serving():
                    return master
            if time.monotonic() >= deadline:
                reason = f"no serving leader within {timeout_s:.1f} s"
                tail = tuple(
                    line for m in self.masters for line in m.log_tail[-2:]
                )
                raise ServiceStartError(_SERVICE, reason, None, tail)
            time.sleep(0.05)

    def stop(self) -> None:
        """Stop every master, then etcd (idempotent)."""
        for master in self.masters:
            master.stop()
        if self.etcd is not None:
            self.etcd.stop()

    def health(self) -> list[dict[str, Any] | None]:
        """Each master's ``/health`` JSON, in start order."""
        return [m.health() if m.running else None for m in self.masters]

    def __repr__(self) -> str:
        where = self.etcd.endpoint if self.etcd is not None else "not started"
        return f"<HAMasters {self.n_masters} masters, etcd {where}>"
