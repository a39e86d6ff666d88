"""vLLM general plugin: ``MooncakeLifecycleConnector`` by name.

The package declares ``register`` under the ``vllm.general_plugins``
entry-point group, so every vLLM process (API server, engine core,
workers) calls it before it builds a connector, and

    --kv-transfer-config '{"kv_connector": "MooncakeLifecycleConnector",
                           "kv_role": "kv_both", ...}'

works without ``kv_connector_module_path``.  Registration is lazy (vLLM
imports ``connector.integration.vllm_connector`` only when it builds the
connector),
idempotent, and silent when vLLM is absent or the name already maps to
this class.  A name taken by another class is left alone, with a
warning: the other class keeps the name.  The package's own log records
go to vLLM's handlers, in vLLM's format and at its level.
"""

from __future__ import annotations

import enum
import logging
from typing import Any, Final

__all__ = [
    "CONNECTOR_CLASS",
    "CONNECTOR_MODULE",
    "CONNECTOR_NAME",
    "Registration",
    "register",
    "route_logs",
]

log: Final = logging.getLogger(__name__)

CONNECTOR_NAME: Final = "MooncakeLifecycleConnector"
CONNECTOR_MODULE: Final = "connector.integration.vllm_connector"
CONNECTOR_CLASS: Final = "MooncakeLifecycleConnector"
LOGGERS: Final = ("connector", "lifecycle")


class Registration(enum.Enum):
    """What `register` found and did."""

    REGISTERED = "registered"
    ALREADY_REGISTERED = "already registered"
    NO_VLLM = "no vLLM"
    NAME_TAKEN = "name taken by another class"


def _factory() -> Any:
    """vLLM's ``KVConnectorFactory``, or ``None`` without vLLM."""
    try:
        from vllm.distributed.kv_transfer.kv_connector.factory import (  # noqa: PLC0415 - optional dependency
            KVConnectorFactory,
        )
    except ImportError:
        return None
    return KVConnectorFactory


def _describe(loader: Any) -> str:
    """``module.QualName`` of the class a registry loader returns."""
    try:
        cls = loader()
    except Exception as exc:  # noqa: BLE001 - any import error is "other"
        return f"<unloadable: {type(exc).__name__}: {exc}>"
    module = getattr(cls, "__module__", "?")
    name = getattr(cls, "__qualname__", repr(cls))
    return f"{module}.{name}"


def route_logs() -> bool:
    """Send ``connector`` and ``lifecycle`` records to vLLM's log handlers.

    Without this, a vLLM process drops their INFO records and prints
    their warnings unformatted.  Loggers that already have handlers, or
    a vLLM whose own logger has none (``VLLM_CONFIGURE_LOGGING=0``), are
    left alone.

    Returns:
        Whether any logger was routed by this call.
    """
    vllm_logger = logging.getLogger("vllm")
    if not vllm_logger.handlers:
        return False
    routed = False
    for name in LOGGERS:
        ours = logging.getLogger(name)
        if ours.handlers:
            continue
        for handler in vllm_logger.handlers:
            ours.addHandler(handler)
        ours.setLevel(vllm_logger.level)
        ours.propagate = False
        routed = True
    return routed


def register() -> Registration:
    """Register the connector with vLLM's ``KVConnectorFactory``.

    Safe to call any number of times, in any process.  Also routes the
    package's logs to vLLM's handlers (`route_logs`).

    Returns:
        What happened; only `Registration.NAME_TAKEN` logs (a warning).
    """
    factory = _factory()
    if factory is None:
        log.debug("vLLM is not installed: %s not registered", CONNECTOR_NAME)
        return Registration.NO_VLLM
    route_logs()
    ours = f"{CONNECTOR_MODULE}.{CONNECTOR_CLASS}"
    registry = getattr(factory, "_registry", {})
    loader = registry.get(CONNECTOR_NAME)
    if loader is None:
        try:
            factory.register_connector(
                CONNECTOR_NAME, CONNECTOR_MODULE, CONNECTOR_CLASS
            )
        except ValueError:  # registered by another thread meanwhile
            loader = registry.get(CONNECTOR_NAME)
        else:
            log.debug("registered %s -> %s", CONNECTOR_NAME, ours)
            return Registration.REGISTERED
    theirs = _describe(loader)
    if theirs == ours:
        return Registration.ALREADY_REGISTERED
    log.warning(
        "vLLM KV connector name %r is already registered to %s; "
        "kv-lifecycle's %s is not registered under it (use "
        '"kv_connector_module_path": "%s" to load it explicitly)',
        CONNECTOR_NAME,
        theirs,
        ours,
        CONNECTOR_MODULE,
    )
    return Registration.NAME_TAKEN
