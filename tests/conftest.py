"""Test-wide settings: keep vLLM's per-step logging out of test output."""

import os

os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
