"""The core/shell boundary: code outside ``scheduler/core`` reads the core only through its
public, read-only API (``SchedulerCore.stats()``, ``.step()``, ``.worker()``, a few cheap
properties, and the event / command methods), never its records or collaborators.

The scan is static (AST): every attribute read on an expression named ``core`` (``core.x``,
``self.core.x``, ``scheduler.service.core.x``) in ``scheduler/*.py`` and ``cli/*.py``.
"""

from __future__ import annotations

import ast
from pathlib import Path

from bubblespec.scheduler.core.state import SchedulerCore

ROOT = Path(__file__).resolve().parents[2]

PUBLIC = frozenset({
    # views (core/view.py) and cheap read-only values
    "stats", "step", "worker", "has_step", "now", "status", "settings", "policy_version", "policy_weights_path",
    "policy_loading", "model_limits", "worker_count", "any_step_active", "paused", "pause_waiting",
    # events (``handle`` is the one way in for them: core/events.py) and commands
    "handle", "check_step", "submit_step", "check_requests", "submit_requests",
    "dispatch", "cancel_requests", "announce", "cancel_step", "update_policy",
    "tick", "pause", "resume", "restore_policy", "forget_history",
    "adapters", "unload_adapter",  # LoRA adapters (core/adapters.py)
})
"""What outside code may read of a ``SchedulerCore``."""

INTERNAL = ("steps", "workers", "version", "weights_path", "limits", "pauser", "planner", "clock", "balancer",
            "history", "timing", "rng", "lengths")
"""Records and collaborators: never public."""


def _is_core(node: ast.expr) -> bool:
    return (isinstance(node, ast.Name) and node.id == "core") or (isinstance(node, ast.Attribute) and node.attr == "core")


def internal_reads(source: str, filename: str = "<source>") -> list[str]:
    """``file:line: core.attr`` for each read of a core attribute outside ``PUBLIC``."""
    out = []
    for node in ast.walk(ast.parse(source, filename)):
        if isinstance(node, ast.Attribute) and _is_core(node.value) and node.attr not in PUBLIC:
            out.append(f"{filename}:{node.lineno}: core.{node.attr}")
    return out


def shell_files() -> list[Path]:
    return sorted([*(ROOT / "scheduler").glob("*.py"), *(ROOT / "cli").glob("*.py")])


def test_no_code_outside_the_core_reads_its_internals():
    reads = [r for p in shell_files() for r in internal_reads(p.read_text(), str(p.relative_to(ROOT)))]
    assert reads == []


def test_the_public_api_exists_and_names_no_internal():
    for name in PUBLIC:
        assert hasattr(SchedulerCore, name) or name in SchedulerCore().__dict__, name
        assert not name.startswith("_")
    assert not PUBLIC & set(INTERNAL)


def test_the_scan_finds_reads_of_internals_and_private_names():
    src = ("def f(scheduler, core):\n"
           "    a = scheduler.service.core.steps\n"
           "    b = core._barrier\n"
           "    c = self.core.pauser.paused\n"
           "    return core.stats(), scheduler.core.policy_version\n")
    assert [r.split(": ")[1] for r in internal_reads(src)] == ["core.steps", "core._barrier", "core.pauser"]
