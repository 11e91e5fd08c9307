"""Throwaway TLS files for tests: a CA, a server certificate for localhost and a client pair.

Made with the ``openssl`` command line tool; ``make_tls_files`` returns None without it.
"""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

__all__ = ["TlsFiles", "make_tls_files"]

_SERVER_EXT = "subjectAltName=DNS:localhost,IP:127.0.0.1\n"


@dataclass(frozen=True)
class TlsFiles:
    """PEM files of a test CA and of certificates it signed."""

    ca_cert: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path


def make_tls_files(directory: Path) -> TlsFiles | None:
    """Write a CA, a server and a client certificate under ``directory``; None without openssl."""
    if shutil.which("openssl") is None:
        return None
    directory.mkdir(parents=True, exist_ok=True)
    ca_cert, ca_key = directory / "ca.crt", directory / "ca.key"
    _openssl(
        "req",
        "-x509",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-days",
        "2",
        "-subj",
        "/CN=bubblespec-test-ca",
        "-keyout",
        ca_key,
        "-out",
        ca_cert,
    )
    (directory / "server.ext").write_text(_SERVER_EXT)
    server_cert, server_key = _signed_pair(directory, "server", ca_cert, ca_key)
    client_cert, client_key = _signed_pair(directory, "client", ca_cert, ca_key)
    return TlsFiles(ca_cert, server_cert, server_key, client_cert, client_key)


def _signed_pair(directory: Path, name: str, ca_cert: Path, ca_key: Path) -> tuple[Path, Path]:
    cert, key, csr = (directory / f"{name}.{ext}" for ext in ("crt", "key", "csr"))
    _openssl(
        "req",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-subj",
        "/CN=localhost",
        "-keyout",
        key,
        "-out",
        csr,
    )
    extra = ["-extfile", directory / "server.ext"] if name == "server" else []
    _openssl(
        "x509",
        "-req",
        "-in",
        csr,
        "-CA",
        ca_cert,
        "-CAkey",
        ca_key,
        "-CAcreateserial",
        "-days",
        "2",
        "-out",
        cert,
        *extra,
    )
    return cert, key


def _openssl(*args: object) -> None:
    subprocess.run(["openssl", *map(str, args)], check=True, capture_output=True, timeout=60)
