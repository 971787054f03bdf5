"""The planner: model config -> KV-cache groups -> offload geometry -> pod sizing -> plan.

Pure (no I/O beyond reading a config, no vLLM import); the operator and the CLI call
:func:`make_plan`, and everything downstream reads the :class:`Plan` it returns.
"""
