"""Draft store: per-prompt draft continuations and response lengths (docs/EXACTNESS.md, "How drafts flow").

Importing this package does not import redis; ``RedisStore`` and ``open_store`` for a
``redis://`` URL load it on first use.

Exceptions::

    StoreError
    ├── StoreUnavailable    backend unreachable, refused or timed out
    └── CorruptEntry        undecodable stored bytes (skipped and counted by the stores)
        └── OversizedEntry  stored bytes over ``max_entry_bytes`` (skipped and counted too)
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .base import DraftStore, StoreStats
from .codec import decode_entry, encode_entry
from .memory import MemoryStore
from .resilient import ResilientStore
from .settings import StoreSettings
from .types import (
    CorruptEntry,
    DraftEntry,
    DraftSource,
    OversizedEntry,
    StoreError,
    StoreUnavailable,
    prompt_key,
)

if TYPE_CHECKING:
    from .redis_store import RedisStore

__all__ = [
    "CorruptEntry",
    "DraftEntry",
    "DraftSource",
    "DraftStore",
    "MemoryStore",
    "OversizedEntry",
    "RedisStore",
    "ResilientStore",
    "StoreError",
    "StoreSettings",
    "StoreStats",
    "StoreUnavailable",
    "decode_entry",
    "encode_entry",
    "open_store",
    "prompt_key",
]


def open_store(settings: StoreSettings, *, resilient: bool = False) -> DraftStore:
    """Open the store ``settings.url`` names: memory when empty, else Redis.

    No connection is made here; the first operation connects. With ``resilient=True`` the
    store is wrapped in ``ResilientStore`` (what workers use).
    """
    settings.validate()
    store: DraftStore
    if settings.backend == "memory":
        store = MemoryStore(settings)
    else:
        from .redis_store import RedisStore

        store = RedisStore(settings)
    return ResilientStore(store, settings) if resilient else store


def __getattr__(name: str) -> Any:
    if name == "RedisStore":
        from .redis_store import RedisStore

        return RedisStore
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
