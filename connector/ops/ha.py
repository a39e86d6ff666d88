"""A local HA master set: one etcd and N ``mooncake_master --enable_ha``.

``HAMasters`` starts an ``EmbeddedEtcd`` and ``n`` ``EmbeddedMaster``
processes in HA mode (``--enable_ha --etcd_endpoints --cluster_id
--enable_oplog``) on loopback, and returns from ``start()`` once one of
them leads and serves. Clients reach the set through etcd, not through a
master: ``rpc_address`` is Mooncake's ``etcd://host:port`` form, and the
transfer-engine metadata lives in the same etcd (``metadata_server``), so
neither dies with a master. ``store_config_for(ha)`` builds a client
config for it (``cluster_id`` included).

Failover as measured on the 0.3.13.post1 wheel: when a leader dies, its
etcd lease (5 s, fixed in Mooncake) must expire before a standby is
elected, and the new leader waits another lease period before it serves:
about 10 s in all. ``HAMasters`` watches its masters and, when one exits
while the etcd leader key still names it, revokes that key's lease at
once (``revoke_leader_lease``): a standby is elected immediately and
serves about 5 s after the death (measured 5.1 s against 9.1 s). A
master that dies with its host has no watcher left: the lease expires
on its own (about 10 s).

Example::

    with HAMasters(masters=2) as ha:
        config = store_config_for(ha)
        ...
        ha.leader().kill()
        ha.wait_serving(timeout_s=20)
"""

from __future__ import annotations

import base64
import json
import logging
import threading
import time
import urllib.request
from typing import Any, Final, Self

from connector.errors import ServiceStartError
from connector.ops.master import EmbeddedMaster, _StartStop
from connector.ops.procs import EmbeddedEtcd

__all__ = ["HAMasters", "leader_key", "revoke_leader_lease"]

log = logging.getLogger(__name__)

_SERVICE: Final = "HA master set"
_WATCH_S: Final = 0.05  # how often HAMasters looks for a dead master


def leader_key(cluster_id: str) -> str:
    """The etcd key naming the leader of ``cluster_id``.

    Mooncake's ``mooncake-store/<cluster_id>/master_view``; its value is
    the leader's rpc address, held by the leader's etcd lease.
    """
    return f"mooncake-store/{cluster_id}/master_view"


def _b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


def _etcd_post(
    endpoint: str, path: str, body: dict[str, Any], timeout_s: float
) -> dict[str, Any]:
    """POST to etcd's v3 JSON gateway (etcd 3.4+).

    Raises ``OSError`` or ``ValueError`` on any failure.
    """
    request = urllib.request.Request(
        f"http://{endpoint}{path}",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=timeout_s) as resp:  # noqa: S310
        answer = json.loads(resp.read().decode("utf-8", "replace"))
    if not isinstance(answer, dict):
        msg = f"etcd answered {answer!r}"
        raise ValueError(msg)  # noqa: TRY004 - a bad answer, not a bad argument
    return answer


def revoke_leader_lease(
    etcd_endpoints: str,
    cluster_id: str,
    address: str,
    *,
    timeout_s: float = 1.0,
) -> bool:
    """Revoke the leader key's lease if the key names ``address``.

    Call it only once the master at ``address`` is known dead (its
    process exited): the key then goes at once and a standby is elected
    without waiting for the lease to expire. A key naming another master
    (a successor already leads) is left alone; revoking the lease read
    with a matching value is safe even if a successor wins meanwhile (it
    holds a lease of its own).

    Args:
        etcd_endpoints: ``host:port[;host:port...]`` (tried in order).
        cluster_id: the masters' ``--cluster_id``.
        address: the dead master's rpc address (``host:port``).
        timeout_s: bound of each etcd request.

    Returns:
        Whether a lease was revoked; ``False`` (logged) when the key
        names another master, is gone, or no endpoint answered.
    """
    key = _b64(leader_key(cluster_id))
    for endpoint in filter(None, etcd_endpoints.split(";")):
        try:
            found = _etcd_post(
                endpoint, "/v3/kv/range", {"key": key}, timeout_s
            )
            kvs = found.get("kvs") or []
            if not kvs:
                return False
            value = base64.b64decode(kvs[0].get("value", "")).decode()
            lease = kvs[0].get("lease")
            if value != address or not lease:
                return False
            _etcd_post(endpoint, "/v3/lease/revoke", {"ID": lease}, timeout_s)
        except (OSError, ValueError) as exc:
            log.warning(
                "etcd %s: leader lease not revoked (%s)", endpoint, exc
            )
            continue
        return True
    return False


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
        fast_failover: when a master exits while it still leads, revoke
            its etcd lease (a standby serves in about 5 s, not 10).
        master_kwargs: more ``EmbeddedMaster`` arguments for each master.
        start_timeout_s: bound of waiting for the first serving leader.
    """

    def __init__(
        self,
        *,
        masters: int = 2,
        cluster_id: str = "kv-lifecycle",
        enable_oplog: bool = True,
        fast_failover: bool = True,
        master_kwargs: dict[str, Any] | None = None,
        start_timeout_s: float = 60.0,
    ) -> None:
        if masters < 1:
            reason = f"masters must be >= 1, got {masters}"
            raise ServiceStartError(_SERVICE, reason, None, ())
        self.n_masters = masters
        self.cluster_id = cluster_id
        self.enable_oplog = enable_oplog
        self.fast_failover = fast_failover
        self.revoked: list[str] = []  # dead leaders whose lease was revoked
        self._stopping = threading.Event()
        self._watcher: threading.Thread | None = None
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
        if self.fast_failover:
            self._stopping.clear()
            self._watcher = threading.Thread(
                target=self._watch, name="ha-masters-watch", daemon=True
            )
            self._watcher.start()
        return self

    def _watch(self) -> None:
        """Revoke the lease of a leader whose process exited."""
        alive = {id(m) for m in self.masters if m.running}
        while not self._stopping.wait(_WATCH_S):
            for master in self.masters:
                if id(master) in alive and not master.running:
                    alive.discard(id(master))
                    self._on_exit(master)
                elif id(master) not in alive and master.running:
                    alive.add(id(master))  # restarted

    def _on_exit(self, master: EmbeddedMaster) -> None:
        if self._stopping.is_set() or self.etcd is None:
            return
        address = master.rpc_address
        if revoke_leader_lease(self.etcd.endpoint, self.cluster_id, address):
            self.revoked.append(address)
            log.warning(
                "HA master %s exited while leading: its etcd lease was "
                "revoked, a standby is elected now",
                address,
            )

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
        self._stopping.set()
        if self._watcher is not None:
            self._watcher.join(timeout=5)
            self._watcher = None
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
