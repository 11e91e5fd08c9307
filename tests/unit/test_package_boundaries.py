"""The package boundaries the layout promises, checked on the source.

- The runtime packages (scheduler, worker, store, client, common, telemetry, integrations, api)
  never import the bench package (RLVR workload, tiny model, simulated engines) or the CLI.
- The three processes meet only in ``bubblespec.common`` (types, codec, transport options,
  shared rules) and the protocol (``bubblespec.api``): the scheduler and the worker import
  nothing of each other or of the SDK, the SDK nothing of either, and the shared package none
  of the three.
- No import cycles between modules (module-level imports; imports inside functions and under
  ``TYPE_CHECKING`` are deliberate late bindings and not counted).
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = {
    "bubblespec.api": "proto/bubblespec/api", "bubblespec.client": "client", "bubblespec.common": "common",
    "bubblespec.store": "store", "bubblespec.scheduler": "scheduler", "bubblespec.worker": "worker", "bubblespec.cli": "cli",
    "bubblespec.telemetry": "telemetry", "bubblespec.integrations": "integrations", "bubblespec.bench": "bench",
}
RUNTIME = ("bubblespec.api", "bubblespec.client", "bubblespec.common", "bubblespec.store", "bubblespec.scheduler",
           "bubblespec.worker", "bubblespec.telemetry", "bubblespec.integrations")
OFF_LIMITS = ("bubblespec.bench", "bubblespec.cli")


def _within(name: str, packages: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in packages)


def _modules() -> dict[str, Path]:
    found = {}
    for name, folder in PACKAGES.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            parts = path.relative_to(ROOT / folder).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join((name, *parts))] = path
    return found


def _imports(path: Path, module: str, *, top_level_only: bool, known: dict[str, Path]) -> set[str]:
    """The bubblespec modules ``path`` imports. ``from pkg import sub`` counts as importing ``pkg.sub``
    alone when ``sub`` is a module, since it needs nothing from ``pkg/__init__.py``."""
    tree = ast.parse(path.read_text(), filename=str(path))
    nodes = tree.body if top_level_only else list(ast.walk(tree))
    names: set[str] = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
                package = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{package}.{node.module}" if node.module else package
            subs = {f"{base}.{a.name}" for a in node.names}
            names.update(subs & known.keys())
            if subs - known.keys():
                names.add(base)
    return {n for n in names if n.startswith("bubblespec.")}


def test_the_runtime_packages_never_import_the_bench_package_or_the_cli():
    modules = _modules()
    wrong = sorted(
        f"{m} imports {name}"
        for m, path in modules.items() if _within(m, RUNTIME)
        for name in _imports(path, m, top_level_only=False, known=modules) if _within(name, OFF_LIMITS)
    )
    assert [m for m in modules if _within(m, ("bubblespec.bench.sim",))], "the bench package moved: fix PACKAGES"
    assert wrong == []


def test_the_processes_share_only_the_common_package_and_the_protocol():
    modules = _modules()
    assert [m for m in modules if _within(m, ("bubblespec.common",))], "the shared package moved: fix PACKAGES"
    apart = {"bubblespec.scheduler": ("bubblespec.worker", "bubblespec.client"),
             "bubblespec.worker": ("bubblespec.scheduler", "bubblespec.client"),
             "bubblespec.client": ("bubblespec.scheduler", "bubblespec.worker"),
             "bubblespec.common": ("bubblespec.scheduler", "bubblespec.worker", "bubblespec.client")}
    wrong = sorted(
        f"{m} imports {name}"
        for package, off_limits in apart.items()
        for m, path in modules.items() if _within(m, (package,))
        for name in _imports(path, m, top_level_only=False, known=modules) if _within(name, off_limits)
    )
    assert wrong == []


def _cycles(graph: dict[str, set[str]]) -> list[str]:
    cycles, done, stack = [], set(), []

    def visit(m: str) -> None:
        if m in stack:
            cycles.append(" -> ".join(stack[stack.index(m):] + [m]))
            return
        if m in done:
            return
        stack.append(m)
        for n in sorted(graph[m]):
            visit(n)
        stack.pop()
        done.add(m)

    for m in sorted(graph):
        visit(m)
    return cycles


def _cycles_within(packages: tuple[str, ...], *, top_level_only: bool = False) -> list[str]:
    """Import cycles among the modules of ``packages``, counting every import (module-level, inside
    functions and under ``TYPE_CHECKING``), or with ``top_level_only`` the module-level ones."""
    modules = _modules()
    mine = {m: p for m, p in modules.items() if _within(m, packages)}
    return _cycles({m: {n for n in _imports(p, m, top_level_only=top_level_only, known=modules) if n in mine and n != m}
                    for m, p in mine.items()})


def test_there_are_no_import_cycles_between_modules():
    assert _cycles_within(tuple(PACKAGES), top_level_only=True) == []


def test_the_cycle_finder_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a -> b -> c -> a"]


def test_the_cli_and_bench_modules_import_each_other_in_no_cycle_even_inside_functions():
    # the runtime packages never import these two (above), so no cycle through them comes back
    assert [m for m in _modules() if _within(m, ("bubblespec.cli",))], "the cli package moved: fix PACKAGES"
    assert _cycles_within(("bubblespec.cli", "bubblespec.bench")) == []


def test_the_scheduler_modules_import_each_other_in_no_cycle_even_inside_functions():
    # the core's collaborators take it as ``records.CoreParts``; the HTTP routers take the
    # scheduler as ``app.SchedulerApp`` and the chat route class as an argument
    assert [m for m in _modules() if _within(m, ("bubblespec.scheduler.core",))], "the scheduler moved"
    assert _cycles_within(("bubblespec.scheduler",)) == []
