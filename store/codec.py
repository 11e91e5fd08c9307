"""Compact binary encoding of a DraftEntry (format BSD1, version 1).

All integers are little-endian::

    offset      size  field
    0           4     magic b"BSD1"
    4           1     format version (1)
    5           1     source code: 1 future, 2 history, 3 sibling
    6           8     policy_version, int64
    14          8     created_at, float64 (finite)
    22          2     n = length of step_id in bytes, uint16 (n <= 256)
    24          n     step_id, UTF-8
    24+n        4     k = token count, uint32
    28+n        4*k   token ids, uint32 each, every id < 2**31

``decode_entry`` checks every field and raises only ``CorruptEntry`` for bad input.
"""

from __future__ import annotations

import math
import struct

from .types import CorruptEntry, DraftEntry, DraftSource, OversizedEntry, uint32_array, uint32_from_bytes

__all__ = [
    "FORMAT_VERSION",
    "MAGIC",
    "MAX_STEP_ID_BYTES",
    "MAX_TOKEN_ID",
    "decode_entry",
    "encode_entry",
]

MAGIC = b"BSD1"
FORMAT_VERSION = 1
MAX_STEP_ID_BYTES = 256
MAX_TOKEN_ID = 2**31 - 1

_PREFIX = struct.Struct("<4sBBqdH")
_COUNT = struct.Struct("<I")
_TOKEN_BYTES = 4
_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1

_SOURCE_CODES: dict[DraftSource, int] = {
    DraftSource.FUTURE: 1,
    DraftSource.HISTORY: 2,
    DraftSource.SIBLING: 3,
}
_SOURCES_BY_CODE = {code: source for source, code in _SOURCE_CODES.items()}


def encode_entry(entry: DraftEntry) -> bytes:
    """Encode ``entry``; raise ValueError if a field cannot be represented."""
    step_bytes = _encode_step_id(entry.step_id)
    if not isinstance(entry.policy_version, int):
        raise ValueError(f"policy_version must be an int, got {entry.policy_version!r}")
    if not _INT64_MIN <= entry.policy_version <= _INT64_MAX:
        raise ValueError(f"policy_version {entry.policy_version} does not fit in int64")
    created_at = float(entry.created_at)
    if not math.isfinite(created_at):
        raise ValueError(f"created_at must be finite, got {created_at}")
    tokens = uint32_array(entry.tokens)
    if tokens and max(tokens) > MAX_TOKEN_ID:
        raise ValueError(f"token ids must be < 2**31, got {max(tokens)}")
    source_code = _SOURCE_CODES[DraftSource(entry.source)]
    prefix = _PREFIX.pack(
        MAGIC, FORMAT_VERSION, source_code, entry.policy_version, created_at, len(step_bytes)
    )
    return b"".join((prefix, step_bytes, _COUNT.pack(len(tokens)), tokens.tobytes()))


def decode_entry(data: bytes | bytearray | memoryview, max_bytes: int | None = None) -> DraftEntry:
    """Decode bytes written by ``encode_entry``; raise CorruptEntry naming what is wrong
    (``OversizedEntry``, before any decoding, for more than ``max_bytes`` bytes)."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise CorruptEntry(f"expected bytes, got {type(data).__name__}")
    try:
        view = memoryview(data).cast("B")
    except (TypeError, ValueError) as exc:
        raise CorruptEntry(f"unreadable buffer: {exc}") from None
    if max_bytes is not None and len(view) > max_bytes:
        raise OversizedEntry(f"entry is {len(view)} bytes, over the {max_bytes}-byte cap")
    if len(view) < _PREFIX.size:
        raise CorruptEntry(
            f"entry is {len(view)} bytes, shorter than the {_PREFIX.size}-byte header"
        )
    magic, version, source_code, policy_version, created_at, step_len = _PREFIX.unpack_from(view)
    if magic != MAGIC:
        raise CorruptEntry(f"bad magic {bytes(magic)!r}, expected {MAGIC!r}")
    if version != FORMAT_VERSION:
        raise CorruptEntry(f"unsupported format version {version}")
    source = _SOURCES_BY_CODE.get(source_code)
    if source is None:
        raise CorruptEntry(f"unknown source code {source_code}")
    if not math.isfinite(created_at):
        raise CorruptEntry(f"created_at is not finite ({created_at})")
    if step_len > MAX_STEP_ID_BYTES:
        raise CorruptEntry(f"step_id length {step_len} exceeds {MAX_STEP_ID_BYTES} bytes")
    step_id = _decode_step_id(view, _PREFIX.size, step_len)
    tokens = _decode_tokens(view, _PREFIX.size + step_len)
    return DraftEntry(tokens, policy_version, step_id, source, created_at)


def _encode_step_id(step_id: str) -> bytes:
    if not isinstance(step_id, str):
        raise ValueError(f"step_id must be a str, got {type(step_id).__name__}")
    try:
        step_bytes = step_id.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(f"step_id is not encodable as UTF-8: {exc}") from None
    if len(step_bytes) > MAX_STEP_ID_BYTES:
        raise ValueError(f"step_id is {len(step_bytes)} bytes, at most {MAX_STEP_ID_BYTES} allowed")
    return step_bytes


def _decode_step_id(view: memoryview, start: int, length: int) -> str:
    end = start + length
    if len(view) < end:
        raise CorruptEntry(f"truncated step_id: needs {length} bytes, {len(view) - start} left")
    try:
        return str(view[start:end], "utf-8")
    except UnicodeDecodeError as exc:
        raise CorruptEntry(f"step_id is not valid UTF-8: {exc.reason}") from None


def _decode_tokens(view: memoryview, start: int) -> tuple[int, ...]:
    if len(view) < start + _COUNT.size:
        raise CorruptEntry("truncated entry: token count is missing")
    (count,) = _COUNT.unpack_from(view, start)
    start += _COUNT.size
    actual = len(view) - start
    if actual != count * _TOKEN_BYTES:
        raise CorruptEntry(f"token count {count} needs {count * _TOKEN_BYTES} bytes, got {actual}")
    tokens = uint32_from_bytes(view[start:])
    if tokens and max(tokens) > MAX_TOKEN_ID:
        raise CorruptEntry(f"token id {max(tokens)} is not below 2**31")
    return tuple(tokens)
