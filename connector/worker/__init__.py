"""The connector's worker side: what runs beside each model runner.

- ``side``: ``WorkerSide``, which takes the scheduler's metadata, runs its
  transfer jobs and reports what finished;
- ``transfer``: moving KV blocks between the KV caches and the store;
- ``lanes``: per KV cache group, its keys and transfer (`Lane`), and
  running a job group by group (`move_blocks`).

It imports no vLLM and nothing of the scheduler side: the two halves meet
only through ``connector.metadata``.
"""
