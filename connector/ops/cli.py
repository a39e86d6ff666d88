"""The ``kv-lifecycle`` console script.

Commands:

- ``render``, ``table``, ``replay``, ``demo``: the ``python -m lifecycle``
  commands; their arguments go to that command line untouched, so both
  spell the same options.
- ``master``: runs the Mooncake wheel's ``mooncake_master`` on loopback
  (chosen or free ports) with the flags a single node needs, waits until
  it serves, prints the matching ``--kv-transfer-config`` JSON on one
  stdout line (and writes a ``MOONCAKE_CONFIG_PATH`` file on request),
  then keeps it running until Ctrl-C or SIGTERM, and stops it.
  ``master --ha`` does the same for a local HA set (one etcd and
  ``--masters`` masters with ``--enable_ha --enable_oplog``); the printed
  config reaches the leader through etcd (``etcd://...``).
- ``pool``: runs the wheel's ``mooncake_client`` as the node-level pool
  against a running master (or HA set), prints the engines' config
  (``global_segment_size: 0``, ``mode: standalone-store``), and stops it
  on Ctrl-C/SIGTERM; it dies with this command unless ``--detach``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final, Protocol

from connector.integration.plugin import CONNECTOR_NAME

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence
    from types import FrameType

    from connector.ops.ha import HAMasters
    from connector.ops.master import EmbeddedMaster

__all__ = ["LIFECYCLE_COMMANDS", "kv_transfer_config", "main"]

PROG: Final = "kv-lifecycle"
LIFECYCLE_COMMANDS: Final = {
    "render": "write the lifecycle diagrams (python -m lifecycle render)",
    "table": "print the lifecycle table as Markdown",
    "replay": "replay a lifecycle trace (python -m lifecycle replay)",
    "demo": "walk one request through a preemption",
}
ROLES: Final = ("kv_both", "kv_producer", "kv_consumer")
EXIT_START_FAILED: Final = 3


def kv_transfer_config(
    master: EmbeddedMaster | HAMasters,
    *,
    role: str = "kv_both",
    store: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """vLLM's ``--kv-transfer-config`` for the connector on ``master``.

    The connector is named through the plugin (no module path); ``store``
    adds or overrides ``kv_connector_extra_config`` keys.  A failed load
    (say, the master restarted and lost the keys) is recomputed: vLLM's
    default ``kv_load_failure_policy`` (``"fail"``) would fail the request.
    """
    extra: dict[str, Any] = {
        "master_server_address": master.rpc_address,
        "metadata_server": master.metadata_server,
        "protocol": "tcp",
        "local_hostname": "127.0.0.1",
    }
    cluster_id = getattr(master, "cluster_id", None)
    if master.rpc_address.startswith("etcd://") and cluster_id:
        extra["cluster_id"] = cluster_id
    extra.update(store or {})
    return {
        "kv_connector": CONNECTOR_NAME,
        "kv_role": role,
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": extra,
    }


def _store_keys(args: argparse.Namespace) -> dict[str, Any]:
    keys: dict[str, Any] = {}
    if args.global_segment_size is not None:
        keys["global_segment_size"] = args.global_segment_size
    if args.local_buffer_size is not None:
        keys["local_buffer_size"] = args.local_buffer_size
    if args.namespace is not None:
        keys["namespace"] = args.namespace
    return keys


def _validated(config: dict[str, Any]) -> dict[str, Any]:
    """``config``, failing before serving if it would not load."""
    from connector.config import StoreConfig

    StoreConfig.from_extra_config(config["kv_connector_extra_config"])
    return config


def _write_config_file(path: Path, extra: dict[str, Any]) -> None:
    """The store keys, as a ``MOONCAKE_CONFIG_PATH`` file (vLLM format)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(extra, indent=2, sort_keys=True) + "\n")
    tmp.replace(path)


class _Stop:
    """Set by SIGINT/SIGTERM; the main thread waits on it."""

    def __init__(self) -> None:
        self.event = threading.Event()
        self.signal: int | None = None

    def __call__(self, signum: int, _frame: FrameType | None) -> None:
        self.signal = signum
        self.event.set()


def _log_to_stderr(verbose: bool) -> None:  # noqa: FBT001 - one flag
    logging.basicConfig(
        level=logging.INFO if verbose else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )


class _Service(Protocol):
    """What ``_serve`` runs: a master, an HA set or the node pool."""

    def start(self) -> object:
        """Start it; raises ``MasterError`` when it cannot."""
        ...  # pragma: no cover

    def stop(self) -> object:
        """Stop it (idempotent)."""
        ...  # pragma: no cover


def _serve(
    label: str,
    service: _Service,
    *,
    config: Callable[[], dict[str, Any]],
    announce: Callable[[], int | None],
    exited: Callable[[], str | None],
    on_signal: Callable[[int | None], str],
    config_file: str | None = None,
) -> int:
    """The serving commands' flow, until a signal; returns the exit status.

    Signals are caught first; ``service`` starts (a ``MasterError`` gives
    ``EXIT_START_FAILED``); ``config()`` builds the printed config (a
    ``ConfigError`` gives 2), written to ``config_file`` too; the JSON goes
    to stdout, ``announce()`` tells stderr (a status it returns ends the
    command there); then every 0.5 s ``exited()`` says why the service
    died (status 1), until SIGINT/SIGTERM (status 0). ``service`` is
    always stopped and the signal handlers restored.
    """
    from connector.errors import ConfigError, MasterError

    stop = _Stop()
    previous = {
        sig: signal.signal(sig, stop)
        for sig in (signal.SIGINT, signal.SIGTERM)
    }
    try:
        try:
            service.start()
        except MasterError as exc:
            print(f"{PROG} {label}: {exc}", file=sys.stderr)
            return EXIT_START_FAILED
        try:
            printed = config()
        except ConfigError as exc:
            print(f"{PROG} {label}: {exc}", file=sys.stderr)
            return 2
        if config_file is not None:
            _write_config_file(
                Path(config_file), printed["kv_connector_extra_config"]
            )
        print(json.dumps(printed), flush=True)
        status = announce()
        if status is not None:
            return status
        while not stop.event.wait(timeout=0.5):
            reason = exited()
            if reason is not None:
                print(f"{PROG} {label}: {reason}", file=sys.stderr)
                return 1
        print(f"{PROG} {label}: {on_signal(stop.signal)}", file=sys.stderr)
        return 0
    finally:
        service.stop()
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _master(args: argparse.Namespace) -> int:
    if args.ha:
        return _ha_master(args)
    from connector.ops.master import EmbeddedMaster

    _log_to_stderr(args.verbose)
    master = EmbeddedMaster(
        rpc_port=args.rpc_port,
        http_port=args.http_port,
        metrics_port=args.metrics_port,
        **_master_kwargs(args),
    )

    def exited() -> str | None:
        if master.running:
            return None
        return (
            f"mooncake_master pid {master.pid} exited;"
            f" last output: {list(master.log_tail)[-5:]}"
        )

    def announce() -> None:
        _say_ready(master, args)

    return _serve(
        "master",
        master,
        config=lambda: _validated(
            kv_transfer_config(
                master, role=args.kv_role, store=_store_keys(args)
            )
        ),
        announce=announce,
        exited=exited,
        on_signal=lambda sig: f"signal {sig}, stopping pid {master.pid}",
        config_file=args.config_file,
    )


def _master_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    flags = [f"--{flag.removeprefix('--')}" for flag in args.flag or ()]
    return {
        "lease_ttl_ms": args.lease_ttl_ms,
        "client_ttl_s": args.client_ttl_s,
        "eviction_high_watermark_ratio": args.eviction_high_watermark_ratio,
        "eviction_ratio": args.eviction_ratio,
        "extra_flags": flags,
        "binary": args.binary,
        "start_timeout_s": args.start_timeout_s,
        "log_level": logging.INFO,
    }


def _ha_master(args: argparse.Namespace) -> int:
    """``master --ha``: etcd and ``--masters`` HA masters, until a signal."""
    from connector.ops.ha import HAMasters

    _log_to_stderr(args.verbose)
    if args.rpc_port or args.http_port or args.metrics_port:
        print(
            f"{PROG} master: --ha picks free ports (no --*-port)",
            file=sys.stderr,
        )
        return 2
    ha = HAMasters(
        masters=args.masters,
        cluster_id=args.cluster_id,
        enable_oplog=not args.no_oplog,
        fast_failover=not args.no_fast_failover,
        master_kwargs=_master_kwargs(args),
    )

    def announce() -> None:
        lines = [f"{PROG} master --ha: etcd {ha.etcd_endpoint}"]
        lines.extend(
            f"  mooncake_master pid {m.pid} at {m.rpc_address}"
            f" (health {m.health_url})"
            for m in ha.masters
        )
        lines.append("  pass the JSON above to vLLM: --kv-transfer-config")
        lines.append("  Ctrl-C or SIGTERM stops them")
        print("\n".join(lines), file=sys.stderr, flush=True)

    def exited() -> str | None:
        etcd_down = ha.etcd is None or not ha.etcd.running
        if etcd_down or not any(m.running for m in ha.masters):
            return f"{'etcd' if etcd_down else 'every master'} exited"
        return None

    return _serve(
        "master --ha",
        ha,
        config=lambda: _validated(
            kv_transfer_config(ha, role=args.kv_role, store=_store_keys(args))
        ),
        announce=announce,
        exited=exited,
        on_signal=lambda sig: f"signal {sig}",
        config_file=args.config_file,
    )


def _pool_extra(args: argparse.Namespace) -> dict[str, Any]:
    """The engines' store keys for ``pool`` (validated).

    Raises:
        ConfigError: a bad address, cluster id, or ``--detach`` alone.
    """
    from connector.config import StoreConfig
    from connector.errors import ConfigError

    if args.detach and args.log_file is None:
        reason = "--detach needs --log-file (nobody reads its output)"
        key = "log_file"
        raise ConfigError(key, None, reason)
    if args.dummy and args.mirror is not None:
        reason = "--dummy engines contribute no segment to mirror into"
        key = "mirror"
        raise ConfigError(key, args.mirror, reason)
    extra: dict[str, Any] = {
        "master_server_address": args.master_server_address,
        "metadata_server": args.metadata_server,
        "protocol": "tcp",
        "local_hostname": "127.0.0.1",
        "global_segment_size": 0,
        "mode": "standalone-store",
    }
    if args.mirror is not None:  # placement: once the pool has a name
        extra["global_segment_size"] = args.mirror
        extra["mode"] = "embedded"
    if args.cluster_id is not None:
        extra["cluster_id"] = args.cluster_id
    StoreConfig.from_extra_config(extra)
    return extra


def _engine_keys(
    args: argparse.Namespace, extra: dict[str, Any], pool: Any
) -> dict[str, Any]:
    """The printed store keys: ``extra`` plus what names the running pool."""
    if args.dummy:
        return {**extra, "real_client_address": pool.address}
    if args.mirror is not None:
        return {**extra, "placement": "mirror", "pool_segment": pool.segment}
    return extra


def _pool(args: argparse.Namespace) -> int:
    """``pool``: the node-level ``mooncake_client``, until a signal."""
    from connector.config import parse_size
    from connector.errors import ConfigError
    from connector.ops.procs import NodePool

    _log_to_stderr(args.verbose)
    try:
        size = parse_size("global_segment_size", args.global_segment_size)
        buffer = parse_size("local_buffer_size", args.local_buffer_size)
        extra = _pool_extra(args)
    except ConfigError as exc:
        print(f"{PROG} pool: {exc}", file=sys.stderr)
        return 2
    pool = NodePool(
        master_server_address=args.master_server_address,
        metadata_server=args.metadata_server,
        global_segment_size=size,
        local_buffer_size=buffer,
        cluster_id=args.cluster_id,
        port=args.port,
        http_port=args.http_port,
        dies_with_owner=not args.detach,
        log_file=args.log_file,
        log_level=logging.INFO,
        start_timeout_s=args.start_timeout_s,
    )

    def announce() -> int | None:
        print(
            f"{PROG} pool: mooncake_client pid {pool.pid} owns "
            f"{size} B at {pool.address}, segment {pool.segment} "
            f"(health {pool.health_url}); "
            + (
                "engines mirror into it"
                if args.mirror is not None
                else "engines contribute 0"
            ),
            file=sys.stderr,
            flush=True,
        )
        if not args.detach:
            return None
        pid = pool.detach()
        print(f"{PROG} pool: detached pid {pid}", file=sys.stderr)
        return 0

    def exited() -> str | None:
        if pool.running:
            return None
        tail = list(pool.log_tail)[-5:]
        return f"mooncake_client pid {pool.pid} exited; last output: {tail}"

    return _serve(
        "pool",
        pool,
        config=lambda: {
            "kv_connector": CONNECTOR_NAME,
            "kv_role": args.kv_role,
            "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": _engine_keys(args, extra, pool),
        },
        announce=announce,
        exited=exited,
        on_signal=lambda sig: f"signal {sig}",
    )


def _say_ready(master: EmbeddedMaster, args: argparse.Namespace) -> None:
    ready = (
        f"{PROG} master: mooncake_master pid {master.pid} ready at "
        f"{master.rpc_address} (metadata {master.metadata_server}, "
        f"metrics {master.metrics_url})"
    )
    lines = [
        ready,
        "  pass the JSON above to vLLM: --kv-transfer-config '<JSON>'",
    ]
    if args.config_file is not None:
        path = os.path.abspath(args.config_file)  # noqa: PTH100 - no resolve
        lines.append(f"  or: export MOONCAKE_CONFIG_PATH={path}")
    lines.append("  Ctrl-C or SIGTERM stops it")
    print("\n".join(lines), file=sys.stderr, flush=True)


def _port(text: str) -> int:
    value = int(text)
    if not 0 < value < 65536:  # noqa: PLR2004 - the TCP port range
        msg = f"not a TCP port: {text}"
        raise argparse.ArgumentTypeError(msg)
    return value


def build_parser() -> argparse.ArgumentParser:
    """The argument parser (``render``/``table``/... only for help)."""
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="kv-lifecycle: the KV lifecycle library's commands and "
        "a single-node Mooncake master for vLLM.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    for name, help_text in LIFECYCLE_COMMANDS.items():
        sub.add_parser(name, help=help_text, add_help=False)
    m = sub.add_parser(
        "master",
        help="run a loopback mooncake_master; print the vLLM config",
        description="Start the Mooncake wheel's mooncake_master on "
        "127.0.0.1, print the --kv-transfer-config JSON for vLLM on one "
        "stdout line, and stop the master on Ctrl-C/SIGTERM.",
    )
    ports = m.add_argument_group("ports (default: free ones)")
    ports.add_argument("--rpc-port", type=_port, help="master RPC port")
    ports.add_argument(
        "--http-port", type=_port, help="HTTP metadata server port"
    )
    ports.add_argument(
        "--metrics-port", type=_port, help="metrics and /health port"
    )
    cfg = m.add_argument_group("printed config")
    cfg.add_argument("--kv-role", choices=ROLES, default="kv_both")
    cfg.add_argument("--namespace", help="cache prefix of the keys")
    cfg.add_argument(
        "--global-segment-size",
        help='memory each vLLM worker contributes, e.g. "4GB"',
    )
    cfg.add_argument("--local-buffer-size", help='e.g. "256MB"')
    cfg.add_argument(
        "--config-file",
        metavar="PATH",
        help="also write the store keys to PATH (for MOONCAKE_CONFIG_PATH)",
    )
    flags = m.add_argument_group("master flags")
    flags.add_argument("--lease-ttl-ms", type=int)
    flags.add_argument("--client-ttl-s", type=int)
    flags.add_argument("--eviction-high-watermark-ratio", type=float)
    flags.add_argument("--eviction-ratio", type=float)
    flags.add_argument(
        "--flag",
        action="append",
        metavar="NAME=VALUE",
        help="another mooncake_master flag (repeatable)",
    )
    ha = m.add_argument_group("HA set (--ha)")
    ha.add_argument(
        "--ha",
        action="store_true",
        help="start etcd and --masters HA masters; print an etcd:// config",
    )
    ha.add_argument("--masters", type=int, default=2, help="default 2")
    ha.add_argument("--cluster-id", default="kv-lifecycle")
    ha.add_argument(
        "--no-oplog",
        action="store_true",
        help="do not replicate metadata (stored blocks are lost on failover)",
    )
    ha.add_argument(
        "--no-fast-failover",
        action="store_true",
        help="keep a dead leader's etcd lease (failover ~10 s, not ~5)",
    )
    m.add_argument("--binary", help="mooncake_master executable")
    m.add_argument("--start-timeout-s", type=float, default=20.0)
    m.add_argument(
        "-v", "--verbose", action="store_true", help="log the master output"
    )
    m.set_defaults(func=_master)
    p = sub.add_parser(
        "pool",
        help="run the node-level mooncake_client; print the engines' config",
        description="Start the Mooncake wheel's mooncake_client as the "
        "node's KV pool against a running master, print the "
        "--kv-transfer-config JSON for engines that contribute no memory "
        "(global_segment_size 0, mode standalone-store), and stop it on "
        "Ctrl-C/SIGTERM (it dies with this command unless --detach).",
    )
    p.add_argument("--master-server-address", required=True)
    p.add_argument("--metadata-server", required=True)
    p.add_argument("--cluster-id", help="with an etcd:// master address")
    p.add_argument("--global-segment-size", default="4GB")
    p.add_argument("--local-buffer-size", default="64MB")
    p.add_argument("--port", type=_port, help="RPC port (default: free)")
    p.add_argument("--http-port", type=_port, help="/health port")
    p.add_argument("--kv-role", choices=ROLES, default="kv_both")
    p.add_argument(
        "--dummy",
        action="store_true",
        help="the printed config makes each engine's client a dummy of "
        "this pool (real_client_address): the pool process moves every "
        "byte through shared memory, no transfer engine in the engines",
    )
    p.add_argument(
        "--mirror",
        nargs="?",
        const="4GB",
        metavar="SIZE",
        help="the printed config keeps a segment of SIZE (default 4GB) in "
        "each engine and a second replica of every block in this pool "
        "(placement: mirror): hits are copies inside the engine, and an "
        "engine's restart keeps its blocks here",
    )
    p.add_argument(
        "--detach",
        action="store_true",
        help="leave it running after this command exits (needs --log-file)",
    )
    p.add_argument("--log-file", metavar="PATH")
    p.add_argument("--start-timeout-s", type=float, default=30.0)
    p.add_argument("-v", "--verbose", action="store_true")
    p.set_defaults(func=_pool)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; return the exit status."""
    args_list = list(sys.argv[1:] if argv is None else argv)
    if args_list and args_list[0] in LIFECYCLE_COMMANDS:
        from lifecycle.__main__ import main as lifecycle_main

        return lifecycle_main(args_list)
    args = build_parser().parse_args(args_list)
    status: int = args.func(args)
    return status


if __name__ == "__main__":
    sys.exit(main())
