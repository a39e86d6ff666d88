"""Operator tooling: the ``kv-lifecycle`` command and the embedded master.

- ``master``: ``EmbeddedMaster``, the wheel's ``mooncake_master`` on
  loopback ports;
- ``cli``: the ``kv-lifecycle`` console script.
"""
