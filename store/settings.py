"""Settings of the draft store: one frozen dataclass, every field defaulted and documented."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import Literal
from urllib.parse import urlsplit, urlunsplit

__all__ = ["StoreSettings"]

_REDIS_SCHEMES = ("redis", "rediss")


@dataclass(frozen=True)
class StoreSettings:
    """Where drafts live and how long and how many of them are kept."""

    url: str = ""
    """Empty for the in-process memory store, else a ``redis://`` or ``rediss://`` (TLS) URL."""

    password: str = field(default="", repr=False)
    """Redis password (AUTH). Never logged; hidden from ``repr``. A password in ``url`` wins."""

    tls_ca_file: str = ""
    """PEM file of the CA that signed the server certificate (``rediss://`` only)."""

    tls_cert_file: str = ""
    """PEM client certificate for mutual TLS (``rediss://`` only)."""

    tls_key_file: str = ""
    """PEM private key of ``tls_cert_file``; empty if the key is inside the certificate file."""

    key_prefix: str = "bubblespec:"
    """Prefix of every Redis key; must not contain braces (they delimit cluster hash tags)."""

    max_entries_per_prompt: int = 8
    """Newest draft entries kept per prompt; older ones are dropped on write."""

    max_lengths_per_prompt: int = 16
    """Newest response lengths kept per prompt for length prediction."""

    max_entry_bytes: int = 2**20
    """Largest encoded draft entry (about 262,000 tokens at the default 1 MiB). A larger one is
    not written, and one read back (written by something else) is skipped: both are counted as
    ``StoreStats.oversized_entries``, never raised. Must be at least 1024."""

    ttl_seconds: int = 6 * 3600
    """Seconds a prompt's drafts and lengths live after its last write."""

    op_timeout_seconds: float = 0.5
    """Upper bound of one store operation (connect, send and receive), in seconds."""

    retry_after_seconds: float = 2.0
    """After a failure, the resilient wrapper leaves the backend alone for this long."""

    @property
    def backend(self) -> Literal["memory", "redis"]:
        """Which backend ``url`` selects."""
        return "memory" if not self.url else "redis"

    @property
    def uses_tls(self) -> bool:
        """Whether ``url`` asks for TLS (``rediss://``)."""
        return self.url.lower().startswith("rediss://")

    @property
    def redacted_url(self) -> str:
        """``url`` with any password in it replaced by ``***``, safe to log."""
        try:
            parts = urlsplit(self.url)
        except ValueError:
            return "<invalid url>"
        if parts.password is None:
            return self.url
        user = parts.username or ""
        host = parts.netloc.rpartition("@")[2]
        return urlunsplit(parts._replace(netloc=f"{user}:***@{host}"))

    def __repr__(self) -> str:
        shown = ", ".join(
            f"{f.name}={self.redacted_url if f.name == 'url' else getattr(self, f.name)!r}"
            for f in fields(self)
            if f.repr
        )
        return f"{type(self).__name__}({shown})"

    def validate(self) -> StoreSettings:
        """Return self if every field is usable, else raise ValueError naming the field."""
        self._validate_url()
        if "{" in self.key_prefix or "}" in self.key_prefix:
            raise ValueError(f"key_prefix must not contain braces, got {self.key_prefix!r}")
        for name in ("max_entries_per_prompt", "max_lengths_per_prompt", "ttl_seconds"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        cap = self.max_entry_bytes
        if isinstance(cap, bool) or not isinstance(cap, int) or cap < 1024:
            raise ValueError(f"max_entry_bytes must be an int >= 1024, got {cap!r}")
        _check_seconds("op_timeout_seconds", self.op_timeout_seconds, allow_zero=False)
        _check_seconds("retry_after_seconds", self.retry_after_seconds, allow_zero=True)
        return self

    def _validate_url(self) -> None:
        if not self.url:
            if self.password or self.tls_ca_file or self.tls_cert_file or self.tls_key_file:
                raise ValueError("url is empty (memory store) but password or tls_* is set")
            return
        try:
            scheme = urlsplit(self.url).scheme
        except ValueError as exc:
            raise ValueError(f"url is not a valid URL: {exc}") from None
        if scheme not in _REDIS_SCHEMES:
            raise ValueError(f"url must start with redis:// or rediss://, got scheme {scheme!r}")
        tls_files = {
            "tls_ca_file": self.tls_ca_file,
            "tls_cert_file": self.tls_cert_file,
            "tls_key_file": self.tls_key_file,
        }
        for name, value in tls_files.items():
            if value and scheme != "rediss":
                raise ValueError(f"{name} needs a rediss:// url")
        if self.tls_key_file and not self.tls_cert_file:
            raise ValueError("tls_key_file is set but tls_cert_file is empty")


def _check_seconds(name: str, value: float, *, allow_zero: bool) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    if value < 0 or (value == 0 and not allow_zero):
        bound = ">= 0" if allow_zero else "> 0"
        raise ValueError(f"{name} must be {bound}, got {value!r}")
