"""CI lints and type-checks: .ci/run calls scripts/lint.sh between set-up and the tests, the tools
come from the dev extra that scripts/setup.sh installs, and mypy checks every runtime package
whole: the client, the scheduler, the worker, the store, telemetry and the integrations."""

import fnmatch
import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CONFIG = tomllib.loads((ROOT / "pyproject.toml").read_text())


def _command(text: str) -> str:
    """The line that runs the tests."""
    lines = [line.strip() for line in text.splitlines() if "pytest" in line and not line.lstrip().startswith("#")]
    assert len(lines) == 1, lines
    return lines[0]


def test_ci_runs_lint_after_setup_and_before_the_tests_as_the_readme_says():
    ci = _command((ROOT / ".ci" / "run").read_text())
    steps = [s.strip() for s in ci.split("&&")]
    assert steps[0] == "bash scripts/setup.sh"
    assert steps.index("bash scripts/lint.sh") < next(i for i, s in enumerate(steps) if "pytest" in s)
    assert (ROOT / "scripts" / "lint.sh").is_file()
    assert ci in (ROOT / "README.md").read_text(), "README's test command differs from .ci/run"


def test_lint_tools_are_pinned_in_the_dev_extra_that_setup_installs():
    dev = CONFIG["project"]["optional-dependencies"]["dev"]
    for tool in ("ruff", "mypy"):
        assert any(re.fullmatch(rf"{tool}==[0-9.]+", d) for d in dev), f"{tool} not pinned in the dev extra"
    setup = (ROOT / "scripts" / "setup.sh").read_text()
    assert "dev" in re.search(r"pip install -q -e '\.\[([^]]*)\]'", setup).group(1)
    assert re.search(r"import [^\"]*\bruff\b[^\"]*\bmypy\b", setup), "setup.sh does not reinstall when they are missing"


RUNTIME = {"client", "integrations", "scheduler", "store", "telemetry", "worker"}
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
