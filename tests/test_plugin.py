"""The vLLM plugin: ``MooncakeLifecycleConnector`` registered by name.

Against vLLM 0.33's real ``KVConnectorFactory`` and plugin loader; the
registry entry is removed again after each test.
"""

import logging
import sys
import tomllib
from importlib.metadata import EntryPoint
from pathlib import Path

import pytest

from connector.integration import plugin
from connector.integration.plugin import CONNECTOR_NAME, Registration

PYPROJECT = Path(__file__).resolve().parent.parent / "pyproject.toml"


def test_the_entry_point_is_declared_and_resolves_to_register():
    project = tomllib.loads(PYPROJECT.read_text())["project"]
    group = project["entry-points"]["vllm.general_plugins"]
    assert group == {"kv_lifecycle": "connector.integration.plugin:register"}
    ep = EntryPoint("kv_lifecycle", group["kv_lifecycle"], "g")
    assert ep.load() is plugin.register


def test_without_vllm_it_registers_nothing_and_stays_silent(
    monkeypatch, caplog
):
    # A None entry makes the import raise ImportError, as without vLLM.
    monkeypatch.setitem(
        sys.modules, "vllm.distributed.kv_transfer.kv_connector.factory", None
    )
    with caplog.at_level(logging.DEBUG, logger="connector"):
        assert plugin.register() is Registration.NO_VLLM
    assert [r for r in caplog.records if r.levelno >= logging.INFO] == []


@pytest.fixture
def factory():
    """vLLM's factory with our name unregistered; restored afterwards."""
    pytest.importorskip("vllm")
    from vllm.distributed.kv_transfer.kv_connector.factory import (  # noqa: PLC0415
        KVConnectorFactory,
    )

    registry = KVConnectorFactory._registry
    saved = registry.pop(CONNECTOR_NAME, None)
    loggers = {n: logging.getLogger(n) for n in plugin.LOGGERS}
    state = {
        n: (lg.handlers[:], lg.level, lg.propagate)
        for n, lg in loggers.items()
    }
    yield KVConnectorFactory
    registry.pop(CONNECTOR_NAME, None)
    if saved is not None:
        registry[CONNECTOR_NAME] = saved
    for name, (handlers, level, propagate) in state.items():
        lg = loggers[name]
        lg.handlers[:] = handlers
        lg.setLevel(level)
        lg.propagate = propagate


def _transfer_config(**kwargs):
    from vllm.config import KVTransferConfig  # noqa: PLC0415

    return KVTransferConfig(
        kv_connector=CONNECTOR_NAME, kv_role="kv_both", **kwargs
    )


@pytest.mark.vllm
def test_register_makes_the_name_resolve_without_a_module_path(factory):
    with pytest.raises(ValueError, match="Unsupported connector"):
        factory.get_connector_class(_transfer_config())
    assert plugin.register() is Registration.REGISTERED
    from connector.integration.vllm_connector import (  # noqa: PLC0415
        MooncakeLifecycleConnector,
    )

    got = factory.get_connector_class(_transfer_config())
    assert got is MooncakeLifecycleConnector


@pytest.mark.vllm
def test_register_is_idempotent_and_quiet(factory, caplog):
    with caplog.at_level(logging.DEBUG):
        assert plugin.register() is Registration.REGISTERED
        caplog.clear()
        for _ in range(3):
            assert plugin.register() is Registration.ALREADY_REGISTERED
    assert [r for r in caplog.records if r.levelno >= logging.INFO] == []


@pytest.mark.vllm
def test_a_name_taken_by_another_class_is_left_alone_with_a_warning(
    factory, caplog
):
    factory.register_connector(
        CONNECTOR_NAME, "tests.reference_connectors", "ReferenceConnector"
    )
    with caplog.at_level(
        logging.WARNING, logger="connector.integration.plugin"
    ):
        assert plugin.register() is Registration.NAME_TAKEN
    [record] = [
        r for r in caplog.records if r.name == "connector.integration.plugin"
    ]
    assert record.levelno == logging.WARNING
    assert "tests.reference_connectors.ReferenceConnector" in record.message
    got = factory.get_connector_class(_transfer_config())
    assert got.__name__ == "ReferenceConnector"


@pytest.mark.vllm
def test_vllms_plugin_loader_calls_register(factory, monkeypatch):
    import importlib.metadata  # noqa: PLC0415

    import vllm.plugins  # noqa: PLC0415

    ours = EntryPoint(
        "kv_lifecycle",
        "connector.integration.plugin:register",
        "vllm.general_plugins",
    )

    def entry_points(group=None, **_):
        return [ours] if group == "vllm.general_plugins" else []

    monkeypatch.setattr(importlib.metadata, "entry_points", entry_points)
    monkeypatch.setattr(vllm.plugins, "plugins_loaded", False)
    vllm.plugins.load_general_plugins()
    assert CONNECTOR_NAME in factory._registry
    cls = factory.get_connector_class(_transfer_config())
    assert cls.__name__ == CONNECTOR_NAME


@pytest.fixture
def vllm_logger(factory):
    """vLLM's logger with one handler, as vLLM configures it by default."""
    logger = logging.getLogger("vllm")
    saved = logger.handlers[:], logger.level
    handler = logging.StreamHandler()
    logger.handlers[:] = [handler]
    logger.setLevel(logging.INFO)
    for name in plugin.LOGGERS:
        logging.getLogger(name).handlers.clear()
    yield logger
    logger.handlers[:], level = saved
    logger.setLevel(level)


@pytest.mark.vllm
def test_register_routes_the_package_logs_to_vllms_handlers(vllm_logger):
    plugin.register()
    for name in plugin.LOGGERS:
        ours = logging.getLogger(name)
        assert ours.handlers == vllm_logger.handlers
        assert ours.level == logging.INFO
        assert not ours.propagate
    # A second call adds nothing.
    assert plugin.route_logs() is False
    assert logging.getLogger("connector").handlers == vllm_logger.handlers


@pytest.mark.vllm
def test_logs_stay_alone_when_vllm_logging_is_off(vllm_logger):
    vllm_logger.handlers.clear()  # VLLM_CONFIGURE_LOGGING=0
    assert plugin.route_logs() is False
    assert logging.getLogger("connector").handlers == []
