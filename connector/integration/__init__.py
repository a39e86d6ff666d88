"""The vLLM glue: the only part of the connector that imports vLLM.

- ``vllm_connector``: ``MooncakeLifecycleConnector``, vLLM's
  ``KVConnectorBase_V1``, which builds the two halves and delegates to
  them;
- ``plugin``: the ``vllm.general_plugins`` entry point that registers the
  connector with vLLM by name;
- ``stats``: vLLM's ``KVConnectorStats`` and Prometheus metrics.
"""
