"""Plain data of the draft store: draft entries, prompt keys and the exception tree.

Exceptions::

    StoreError                 root of everything the draft store raises on purpose
    ├── StoreUnavailable       the backend is unreachable, refused us, or timed out
    └── CorruptEntry           stored bytes could not be decoded into a DraftEntry
        └── OversizedEntry     stored bytes over the size cap (not decoded at all)

Arguments that are wrong in themselves (a negative length, an empty prompt key) raise
``ValueError``: they are caller bugs, not store failures.
"""

from __future__ import annotations

import enum
import hashlib
import sys
from array import array
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = [
    "CorruptEntry",
    "DraftEntry",
    "DraftSource",
    "OversizedEntry",
    "StoreError",
    "StoreUnavailable",
    "check_length",
    "check_prompt_key",
    "prompt_key",
    "uint32_array",
    "uint32_from_bytes",
    "unique_prompt_keys",
]

# The array type code whose items are exactly four bytes ("I" on every mainstream platform).
_U32_TYPECODE = next(code for code in "IL" if array(code).itemsize == 4)


class DraftSource(str, enum.Enum):
    """Where a stored draft continuation came from (docs/EXACTNESS.md, "How drafts flow")."""

    FUTURE = "future"
    """Pre-generated in a bubble for an upcoming step."""
    HISTORY = "history"
    """A response of an earlier step or epoch for the same prompt."""
    SIBLING = "sibling"
    """Another sample of the same prompt in the same step."""


@dataclass(frozen=True, slots=True)
class DraftEntry:
    """One candidate continuation for a prompt."""

    tokens: tuple[int, ...]
    """Token ids of the continuation, each in ``[0, 2**31)``."""
    policy_version: int
    """Version of the policy weights that generated the tokens."""
    step_id: str
    """Training step that produced the entry (at most 256 UTF-8 bytes)."""
    source: DraftSource
    """Where the draft came from."""
    created_at: float
    """Creation time in seconds (wall clock of the writer)."""


class StoreError(Exception):
    """Root of the draft store's exceptions."""


class StoreUnavailable(StoreError):
    """The backend is unreachable, rejected the connection, or did not answer in time."""


class CorruptEntry(StoreError):
    """Stored bytes are not a valid encoded DraftEntry; the message says what is wrong."""


class OversizedEntry(CorruptEntry):
    """Stored bytes are longer than the store's ``max_entry_bytes``; not decoded at all."""


def uint32_array(values: Sequence[int]) -> array[int]:
    """Pack ``values`` into an array of unsigned 32-bit ints in little-endian byte order.

    Raises ValueError if a value is negative, too large or not an int.
    """
    try:
        packed = array(_U32_TYPECODE, values)
    except (OverflowError, TypeError) as exc:
        raise ValueError(f"token ids must be ints in [0, 2**32): {exc}") from None
    if sys.byteorder == "big":
        packed.byteswap()
    return packed


def uint32_from_bytes(data: bytes | memoryview) -> array[int]:
    """Unpack little-endian uint32 values; ``len(data)`` must be a multiple of four."""
    values = array(_U32_TYPECODE)
    values.frombytes(data)
    if sys.byteorder == "big":
        values.byteswap()
    return values


def prompt_key(token_ids: Sequence[int], adapter: tuple[str, int] | None = None) -> str:
    """Return the store key of a prompt: blake2b-96 hex of its token ids as LE uint32. Under a
    LoRA ``adapter`` (name, version) the key also hashes the adapter's name and version, so that
    drafts and lengths of one adapter version never serve another's requests or the base model's."""
    digest = hashlib.blake2b(uint32_array(token_ids).tobytes(), digest_size=12)
    if adapter is not None:
        name, version = adapter
        digest.update(b"\0lora\0" + name.encode() + b"\0" + str(int(version)).encode())
    return digest.hexdigest()


def check_prompt_key(key: str) -> str:
    """Return ``key`` if it can name a prompt in every backend, else raise ValueError.

    Braces are refused because the Redis layout wraps the key in a cluster hash tag.
    """
    if not isinstance(key, str) or not key:
        raise ValueError(f"prompt key must be a non-empty str, got {key!r}")
    if "{" in key or "}" in key:
        raise ValueError(f"prompt key must not contain braces, got {key!r}")
    return key


def unique_prompt_keys(prompt_keys: Sequence[str]) -> list[str]:
    """Return the checked keys in first-seen order without duplicates."""
    if isinstance(prompt_keys, str):
        raise ValueError("prompt_keys must be a sequence of keys, not a single str")
    return [check_prompt_key(key) for key in dict.fromkeys(prompt_keys)]


def check_length(length: int) -> int:
    """Return ``length`` if it is a response length in tokens (an int >= 0), else raise."""
    if isinstance(length, bool) or not isinstance(length, int) or length < 0:
        raise ValueError(f"length must be an int >= 0, got {length!r}")
    return length
