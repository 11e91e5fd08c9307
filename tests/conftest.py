"""Test-wide settings: keep vLLM's per-step logging out of test output, and start test engines
without torch.compile.

``BUBBLESPEC_ENFORCE_EAGER`` is the CLI's ``--enforce-eager`` (cli/main.py reads every flag from
its ``BUBBLESPEC_<FLAG>`` variable), so the workers that tests start as processes (``worker``,
``up``, ``bench``) run eager too; in-process engines get it from ``engine_settings``
(tests/integration/conftest.py), and plain vLLM, the reference, from ``--enforce-eager``. A
compiling start costs 35-75 s on this machine against 25 s eager, and the suite starts about
twenty engines. The demo's test runs the default (compiled), as the README's command does."""

import os

os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
os.environ.setdefault("BUBBLESPEC_ENFORCE_EAGER", "1")
