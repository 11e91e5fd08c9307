"""CI lints and type-checks: .ci/run runs scripts/lint.sh after set-up, beside the tests, the tools
come from the dev extra that scripts/setup.sh installs, and mypy checks every runtime package
whole: the client, the shared package, the scheduler, the worker, the store, telemetry and the integrations."""

import fnmatch
import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CONFIG = tomllib.loads((ROOT / "pyproject.toml").read_text())


README_TEST_COMMAND = "bash scripts/setup.sh && bash scripts/lint.sh && .venv/bin/python -m pytest -q"


def _steps(text: str) -> list[str]:
    """The commands a shell script runs, in order (comments and blank lines left out)."""
    return [line.strip() for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]


def test_ci_runs_setup_then_lint_and_the_tests_as_the_readme_says():
    """The README's test command is set-up, lint, tests; .ci/run runs the same three (lint beside
    the tests, at the lowest priority) and fails when either lint or the tests fail."""
    assert README_TEST_COMMAND in (ROOT / "README.md").read_text(), "README's test command changed: update .ci/run"
    steps = _steps((ROOT / ".ci" / "run").read_text())
    runs = [s for s in steps if not s.startswith(("set ", "cd "))]
    assert runs[0] == "bash scripts/setup.sh", runs
    lint = next(i for i, s in enumerate(runs) if "scripts/lint.sh" in s)
    tests = next(i for i, s in enumerate(runs) if ".venv/bin/python -m pytest -q" in s)
    assert lint < tests, "lint must start before the tests"
    assert runs[lint].endswith("&"), "lint runs beside the tests"
    assert (ROOT / "scripts" / "lint.sh").is_file()
    # both exit codes decide the run's
    assert 'wait "$lint_pid" || lint_rc=$?' in runs
    assert runs[-1] == '[ "$tests_rc" -eq 0 ] && [ "$lint_rc" -eq 0 ]', runs[-1]


def test_lint_tools_are_pinned_in_the_dev_extra_that_setup_installs():
    dev = CONFIG["project"]["optional-dependencies"]["dev"]
    for tool in ("ruff", "mypy"):
        assert any(re.fullmatch(rf"{tool}==[0-9.]+", d) for d in dev), f"{tool} not pinned in the dev extra"
    setup = (ROOT / "scripts" / "setup.sh").read_text()
    assert "dev" in re.search(r"pip install -q -e '\.\[([^]]*)\]'", setup).group(1)
    assert re.search(r"import [^\"]*\bruff\b[^\"]*\bmypy\b", setup), "setup.sh does not reinstall when they are missing"


RUNTIME = {"client", "common", "integrations", "scheduler", "store", "telemetry", "worker"}
"""The runtime packages' folders; the others are the CLI, the bench and the generated protobuf modules."""


def test_mypy_checks_every_runtime_package_whole():
    packages = CONFIG["tool"]["mypy"]["packages"]
    package_dir = CONFIG["tool"]["setuptools"]["package-dir"]

    def folder(package: str) -> Path:
        """The folder of a package, through setuptools' package-dir mapping (as scripts/lint.sh links it)."""
        for name in sorted(package_dir, key=len, reverse=True):
            if package == name or package.startswith(name + "."):
                return ROOT / package_dir[name] / Path(*package[len(name):].split(".")[1:])
        raise AssertionError(f"{package} is not under any package-dir entry")

    folders = {folder(p).relative_to(ROOT).as_posix() for p in packages}
    assert folders == RUNTIME, "mypy must name each runtime package whole (not some of its modules)"
    assert all((ROOT / f / "__init__.py").is_file() for f in folders)
    assert RUNTIME | {"cli", "bench", "proto/bubblespec/api"} == set(package_dir.values()), \
        "a package was added: type-check it (a runtime package) or name it here"


def test_ruff_skips_only_the_generated_protobuf_modules():
    ruff = CONFIG["tool"]["ruff"]
    assert ruff["line-length"] == 130
    excluded = [p.relative_to(ROOT).as_posix() for p in ROOT.glob("proto/**/*.py*")
                if any(fnmatch.fnmatch(p.relative_to(ROOT).as_posix(), pat) for pat in ruff["extend-exclude"])]
    assert excluded and all(Path(p).name.startswith("rollout_pb2") for p in excluded), excluded
