#!/usr/bin/env bash
# Lint and type check, as CI runs them (after scripts/setup.sh, before the tests):
# `ruff check .` over the repo and mypy over the packages of [tool.mypy], both configured in
# pyproject.toml. Prints the findings and a one-line summary; exits non-zero on any finding.
set -uo pipefail
cd "$(dirname "$0")/.."

for tool in ruff mypy; do
  if [ ! -x ".venv/bin/$tool" ]; then
    echo "lint: .venv/bin/$tool missing: run bash scripts/setup.sh (it installs the dev extra)" >&2
    exit 2
  fi
done

# mypy cannot follow setuptools' package-dir mapping (bubblespec.client = client/, ...): link each
# mapped package under build/typecheck/ (mypy_path in [tool.mypy]); the findings are printed with
# the repo's own paths.
sed_script=$(.venv/bin/python - <<'EOF'
import pathlib, tomllib
root = pathlib.Path.cwd()
cfg = tomllib.loads((root / "pyproject.toml").read_text())
base = root / cfg["tool"]["mypy"]["mypy_path"]
for name, src in sorted(cfg["tool"]["setuptools"]["package-dir"].items()):
    link = base.joinpath(*name.split("."))
    link.parent.mkdir(parents=True, exist_ok=True)
    if link.is_symlink() or link.exists():
        link.unlink()
    link.symlink_to(root / src, target_is_directory=True)
    print(f"s#^{link.relative_to(root)}/#{src}/#")
EOF
) || { echo "lint: could not link the packages for mypy" >&2; exit 2; }

ruff_out=$(.venv/bin/ruff check --output-format concise . 2>&1); ruff_rc=$?
[ -n "$ruff_out" ] && echo "$ruff_out"
mypy_out=$(.venv/bin/mypy 2>&1 | sed -e "$sed_script"); mypy_rc=$?  # mypy's status (pipefail)
[ -n "$mypy_out" ] && echo "$mypy_out"

ruff_n=$(grep -cE '^[^ ]+:[0-9]+:[0-9]+: ' <<<"$ruff_out")
mypy_n=$(grep -cE ': error: ' <<<"$mypy_out")
if [ "$ruff_rc" -eq 0 ] && [ "$mypy_rc" -eq 0 ]; then
  echo "lint: clean (ruff: 0 findings; mypy: 0 errors)"
  exit 0
fi
echo "lint: FAILED (ruff: $ruff_n findings, exit $ruff_rc; mypy: $mypy_n errors, exit $mypy_rc)"
exit 1
