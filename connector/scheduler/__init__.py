"""The connector's scheduler side: what runs in vLLM's scheduler process.

- ``side``: ``SchedulerSide``, the scheduler hooks as lifecycle events;
- ``lookup``: admission lookups, asked off the scheduler thread;
- ``jobs``: ``JobTable`` and ``BlockPool``, transfer jobs and the blocks
  they pin until the worker reports them;
- ``failed_keys``: ``FailedKeys``, the bounded memory of failed loads.

It imports no vLLM and nothing of the worker side: the two halves meet
only through ``connector.metadata``.
"""
