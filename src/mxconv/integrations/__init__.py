"""Integrations of mxconv outputs into engines a user runs. Each one is optional: its engine is never a
dependency of mxconv, and nothing outside its package imports the engine (``vllm/``: vLLM's plugin)."""
