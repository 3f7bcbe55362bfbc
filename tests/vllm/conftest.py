"""Fixtures for the vLLM facade tests (see vllm_harness.py)."""

from vllm_harness import clean_agent, doubles  # noqa: F401  (fixtures)
