"""Unit tests of the draft store's pure parts: codec, prompt keys, settings, package surface."""

from __future__ import annotations

import ast
import contextlib
import dataclasses
import hashlib
import inspect
import itertools
import struct
import subprocess
import sys
import textwrap

import bubblespec.store as store_pkg
import pytest
from bubblespec.store import (
    CorruptEntry,
    DraftEntry,
    DraftSource,
    StoreSettings,
    decode_entry,
    encode_entry,
    prompt_key,
)
from bubblespec.store.codec import FORMAT_VERSION, MAGIC, MAX_STEP_ID_BYTES, MAX_TOKEN_ID
from hypothesis import given, settings
from hypothesis import strategies as st

ENTRY = DraftEntry(
    tokens=(1, 2, 3, MAX_TOKEN_ID),
    policy_version=7,
    step_id="step-42",
    source=DraftSource.HISTORY,
    created_at=1_700_000_000.25,
)

entries = st.builds(
    DraftEntry,
    tokens=st.lists(st.integers(0, MAX_TOKEN_ID), max_size=64).map(tuple),
    policy_version=st.integers(-(2**63), 2**63 - 1),
    step_id=st.text(max_size=64),
    source=st.sampled_from(DraftSource),
    created_at=st.floats(allow_nan=False, allow_infinity=False),
)


def _valid_step_id(step_id: str) -> bool:
    try:
        return len(step_id.encode("utf-8")) <= MAX_STEP_ID_BYTES
    except UnicodeEncodeError:
        return False


# --- codec: examples ------------------------------------------------------------------------


def test_round_trip() -> None:
    assert decode_entry(encode_entry(ENTRY)) == ENTRY


def test_encoding_is_compact_binary() -> None:
    data = encode_entry(ENTRY)
    header = 4 + 1 + 1 + 8 + 8 + 2 + len(b"step-42") + 4
    assert data.startswith(MAGIC)
    assert data[4] == FORMAT_VERSION
    assert len(data) == header + 4 * len(ENTRY.tokens)
    assert data[-4:] == struct.pack("<I", MAX_TOKEN_ID)


def test_decoded_source_is_the_enum() -> None:
    for source in DraftSource:
        entry = DraftEntry((5,), 1, "s", source, 0.0)
        assert decode_entry(encode_entry(entry)).source is source


def test_empty_tokens_and_unicode_step_id_round_trip() -> None:
    entry = DraftEntry((), 0, "épreuve-é" * 10, DraftSource.FUTURE, -3.5)
    assert decode_entry(encode_entry(entry)) == entry


def test_decode_accepts_bytearray_and_memoryview() -> None:
    data = encode_entry(ENTRY)
    assert decode_entry(bytearray(data)) == ENTRY
    assert decode_entry(memoryview(data)) == ENTRY


@pytest.mark.parametrize(
    "bad, field",
    [
        (DraftEntry((2**31,), 1, "s", DraftSource.FUTURE, 0.0), "token"),
        (DraftEntry((-1,), 1, "s", DraftSource.FUTURE, 0.0), "token"),
        (DraftEntry((1,), 2**63, "s", DraftSource.FUTURE, 0.0), "policy_version"),
        (DraftEntry((1,), 1, "x" * 257, DraftSource.FUTURE, 0.0), "step_id"),
        (DraftEntry((1,), 1, "\ud800", DraftSource.FUTURE, 0.0), "step_id"),
        (DraftEntry((1,), 1, "s", DraftSource.FUTURE, float("nan")), "created_at"),
    ],
)
def test_encode_rejects_unrepresentable_entries(bad: DraftEntry, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        encode_entry(bad)


def _corrupt(data: bytes, offset: int, value: bytes) -> bytes:
    return data[:offset] + value + data[offset + len(value) :]


@pytest.mark.parametrize(
    "mangle, message",
    [
        (lambda d: b"", "shorter than"),
        (lambda d: d[:10], "shorter than"),
        (lambda d: _corrupt(d, 0, b"XXXX"), "magic"),
        (lambda d: _corrupt(d, 4, b"\x09"), "format version"),
        (lambda d: _corrupt(d, 5, b"\x00"), "source"),
        (lambda d: _corrupt(d, 14, struct.pack("<d", float("inf"))), "created_at"),
        (lambda d: _corrupt(d, 22, struct.pack("<H", 300)), "step_id length"),
        (lambda d: _corrupt(d, 22, struct.pack("<H", 200)), "truncated step_id"),
        (lambda d: _corrupt(d, 24, b"\xff"), "UTF-8"),
        (lambda d: d[:-1], "token count"),
        (lambda d: d + b"\x00", "token count"),
        (lambda d: d[:33], "token count is missing"),
        (lambda d: _corrupt(d, len(d) - 4, struct.pack("<I", 2**31)), "below 2\\*\\*31"),
    ],
)
def test_decode_names_the_problem(mangle, message: str) -> None:
    with pytest.raises(CorruptEntry, match=message):
        decode_entry(mangle(encode_entry(ENTRY)))


def test_decode_rejects_non_bytes() -> None:
    with pytest.raises(CorruptEntry, match="expected bytes"):
        decode_entry("BSD1")  # type: ignore[arg-type]


# --- codec: properties ----------------------------------------------------------------------


@given(st.binary(max_size=512))
@settings(max_examples=500)
def test_decode_of_arbitrary_bytes_raises_only_corrupt_entry(data: bytes) -> None:
    try:
        decoded = decode_entry(data)
    except CorruptEntry:
        return
    assert encode_entry(decoded) == data


@given(st.binary(max_size=128), st.integers(0, 64))
def test_decode_of_mangled_valid_prefix_raises_only_corrupt_entry(tail: bytes, cut: int) -> None:
    data = encode_entry(ENTRY)[:cut] + tail
    with contextlib.suppress(CorruptEntry):
        decode_entry(data)


@given(entries.filter(lambda e: _valid_step_id(e.step_id)))
def test_round_trip_of_arbitrary_valid_entries(entry: DraftEntry) -> None:
    assert decode_entry(encode_entry(entry)) == entry


# --- prompt keys ----------------------------------------------------------------------------


def test_prompt_key_is_blake2b_96_of_little_endian_uint32() -> None:
    expected = hashlib.blake2b(struct.pack("<3I", 1, 2, 3), digest_size=12).hexdigest()
    assert prompt_key([1, 2, 3]) == expected
    assert len(expected) == 24


def test_prompt_key_depends_on_order_and_accepts_any_sequence() -> None:
    assert prompt_key((1, 2)) == prompt_key([1, 2])
    assert prompt_key([1, 2]) != prompt_key([2, 1])
    assert prompt_key([]) != prompt_key([0])


def test_prompt_key_rejects_negative_ids() -> None:
    with pytest.raises(ValueError):
        prompt_key([-1])


# --- settings -------------------------------------------------------------------------------


def test_default_settings_are_valid_and_select_memory() -> None:
    assert StoreSettings().validate().backend == "memory"


def test_repr_hides_passwords() -> None:
    text = repr(StoreSettings(url="redis://user:hunter2@redis:6379/0", password="s3cret"))
    assert "hunter2" not in text and "s3cret" not in text
    assert "redis://user:***@redis:6379/0" in text


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"url": "http://redis:6379"}, "url"),
        ({"password": "x"}, "url"),
        ({"url": "redis://r", "tls_ca_file": "/ca.pem"}, "tls_ca_file"),
        ({"url": "rediss://r", "tls_key_file": "/k.pem"}, "tls_key_file"),
        ({"key_prefix": "a{b"}, "key_prefix"),
        ({"max_entries_per_prompt": 0}, "max_entries_per_prompt"),
        ({"max_lengths_per_prompt": -1}, "max_lengths_per_prompt"),
        ({"ttl_seconds": 0}, "ttl_seconds"),
        ({"ttl_seconds": 1.5}, "ttl_seconds"),
        ({"op_timeout_seconds": 0}, "op_timeout_seconds"),
        ({"op_timeout_seconds": float("inf")}, "op_timeout_seconds"),
        ({"retry_after_seconds": -1}, "retry_after_seconds"),
    ],
)
def test_validate_names_the_bad_field(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        StoreSettings(**kwargs).validate()


def test_every_settings_field_has_a_default_and_a_docstring() -> None:
    tree = ast.parse(textwrap.dedent(inspect.getsource(StoreSettings))).body[0]
    assert isinstance(tree, ast.ClassDef)
    body = tree.body
    documented = {
        node.target.id
        for node, following in itertools.pairwise(body)
        if isinstance(node, ast.AnnAssign)
        and isinstance(node.target, ast.Name)
        and isinstance(following, ast.Expr)
        and isinstance(following.value, ast.Constant)
        and isinstance(following.value.value, str)
    }
    for f in dataclasses.fields(StoreSettings):
        assert f.default is not dataclasses.MISSING, f.name
        assert f.name in documented, f.name


# --- package surface ------------------------------------------------------------------------


def test_all_names_resolve() -> None:
    for name in store_pkg.__all__:
        assert getattr(store_pkg, name) is not None, name


def test_importing_the_package_does_not_import_redis() -> None:
    code = "import sys, bubblespec.store; assert 'redis' not in sys.modules, 'redis imported'"
    subprocess.run([sys.executable, "-c", code], check=True)
