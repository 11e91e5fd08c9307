"""docs/INTEGRATIONS.md's route tables against the scheduler's HTTP app: every route a table
lists answers on the app (with the method it names: no 404 for a missing route, no 405), and
every route the app serves for trainers is in a table. The scheduler's own pages (health,
status, metrics, UI) are in docs/SECURITY.md's "HTTP routes" and docs/METRICS.md, not listed here."""

from __future__ import annotations

import re
from pathlib import Path

from types import SimpleNamespace

import httpx
import pytest
from bubblespec.scheduler.core.settings import CoreSettings
from bubblespec.scheduler.core.state import SchedulerCore
from bubblespec.scheduler.http import create_app
from bubblespec.scheduler.service import SchedulerService
from bubblespec.scheduler.settings import SchedulerSettings

DOC = Path(__file__).resolve().parents[2] / "docs" / "INTEGRATIONS.md"
OWN_PAGES = {"/healthz", "/readyz", "/status", "/metrics", "/ui", "/openapi.json"}  # and FastAPI's schema
ROUTE = re.compile(r"`(GET|POST|PUT|DELETE) (/[A-Za-z0-9_/.{}-]*)")


def app():
    service = SchedulerService(SchedulerCore(CoreSettings(), lambda: 0.0))
    return create_app(SimpleNamespace(settings=SchedulerSettings(), service=service, core=service.core, ready=True))


def documented() -> set[tuple[str, str]]:
    """(method, path) of every route named at the start of a table row: "| `POST /pause?...` |"."""
    routes = set()
    for line in DOC.read_text().splitlines():
        if not line.startswith("| `"):
            continue
        first_cell = line.split("|")[1]
        routes.update((m, p) for m, p in ROUTE.findall(first_cell))
    return routes


def served(asgi) -> set[tuple[str, str]]:
    return {(m, r.path) for r in asgi.routes for m in getattr(r, "methods", None) or ()
            if m != "HEAD" and r.path not in OWN_PAGES}


def test_the_tables_list_every_trainer_route_the_app_serves():
    missing = served(app()) - documented()
    assert not missing, f"served but not in docs/INTEGRATIONS.md's tables: {sorted(missing)}"


def _route_missing(r: httpx.Response) -> bool:
    """FastAPI's own answers for a path or method it has no route for (not a route's 404)."""
    if r.status_code == 405:
        return True
    return r.status_code == 404 and r.headers.get("content-type", "").startswith("application/json") \
        and r.json() == {"detail": "Not Found"}


@pytest.mark.parametrize("method,path", sorted(documented()))
async def test_every_documented_route_answers(method, path):
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app()), base_url="http://test") as http:
        r = await http.request(method, path, json={} if method == "POST" else None)
    assert not _route_missing(r), f"{method} {path}: {r.status_code} {r.text[:200]}"
