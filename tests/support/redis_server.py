"""A real, throwaway ``redis-server`` for integration tests.

with RedisServer(password="s3cret") as server:
    settings = StoreSettings(url=server.url, password="s3cret")
    ...
    server.kill()    # SIGKILL: the backend vanishes mid-use
    server.start()   # back on the same port, empty (no persistence)
"""

from __future__ import annotations

import shutil
import signal
import socket
import ssl
import subprocess
import tempfile
import time
from pathlib import Path
from types import TracebackType

from .tls import TlsFiles

__all__ = ["RedisServer", "redis_server_available"]

_HOST = "127.0.0.1"


def redis_server_available(executable: str = "redis-server") -> bool:
    """Whether a ``redis-server`` binary is on PATH."""
    return shutil.which(executable) is not None


class RedisServer:
    """A ``redis-server`` child process on a free local port, without persistence."""

    def __init__(
        self,
        *,
        password: str | None = None,
        tls: TlsFiles | None = None,
        require_client_cert: bool = False,
        executable: str = "redis-server",
        startup_timeout: float = 10.0,
    ) -> None:
        self.password = password
        self.tls = tls
        self.require_client_cert = require_client_cert
        self._executable = executable
        self._startup_timeout = startup_timeout
        self._tmp = tempfile.TemporaryDirectory(prefix="bubblespec-redis-")
        self._dir = Path(self._tmp.name)
        self._port: int | None = None
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def port(self) -> int:
        """The TCP port (TLS port with ``tls``); fixed once the server first started."""
        if self._port is None:
            raise RuntimeError("redis-server has not been started")
        return self._port

    @property
    def url(self) -> str:
        """URL of database 0, without the password."""
        if self.tls is not None:
            return f"rediss://localhost:{self.port}/0"
        return f"redis://{_HOST}:{self.port}/0"

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def start(self) -> RedisServer:
        """Start the server (again on the same port after ``stop``/``kill``); wait for PING."""
        if self.running:
            return self
        attempts = 3 if self._port is None else 1
        for attempt in range(attempts):
            port = self._port if self._port is not None else _free_port()
            try:
                self._spawn(port)
                self._port = port
                return self
            except RuntimeError:
                if attempt == attempts - 1:
                    raise
        return self

    def stop(self) -> None:
        """Stop gracefully (SIGTERM), falling back to SIGKILL after five seconds."""
        if self._proc is None:
            return
        if self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait(timeout=5)
        self._proc = None

    def kill(self) -> None:
        """Kill at once (SIGKILL), as a crash or a lost node would."""
        if self._proc is None:
            return
        if self._proc.poll() is None:
            self._proc.send_signal(signal.SIGKILL)
            self._proc.wait(timeout=5)
        self._proc = None

    def close(self) -> None:
        """Stop the server and delete its directory."""
        self.stop()
        self._tmp.cleanup()

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def _spawn(self, port: int) -> None:
        log_file = self._dir / "redis.log"
        self._proc = subprocess.Popen(
            self._command(port, log_file),
            cwd=self._dir,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + self._startup_timeout
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                self._proc = None
                raise RuntimeError(f"redis-server exited on port {port}:\n{_tail(log_file)}")
            if self._answers_ping(port):
                return
            time.sleep(0.02)
        self.kill()
        raise RuntimeError(f"redis-server did not answer PING on port {port}:\n{_tail(log_file)}")

    def _command(self, port: int, log_file: Path) -> list[str]:
        args = [
            self._executable,
            "--bind",
            _HOST,
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            str(self._dir),
            "--logfile",
            str(log_file),
            "--daemonize",
            "no",
        ]
        if self.tls is None:
            args += ["--port", str(port)]
        else:
            args += [
                "--port",
                "0",
                "--tls-port",
                str(port),
                "--tls-cert-file",
                str(self.tls.server_cert),
                "--tls-key-file",
                str(self.tls.server_key),
                "--tls-ca-cert-file",
                str(self.tls.ca_cert),
                "--tls-auth-clients",
                "yes" if self.require_client_cert else "optional",
            ]
        if self.password is not None:
            args += ["--requirepass", self.password]
        return args

    def _answers_ping(self, port: int) -> bool:
        try:
            conn = socket.create_connection((_HOST, port), timeout=0.5)
        except OSError:
            return False
        try:
            if self.tls is not None:
                conn = self._wrap_tls(conn)
            conn.sendall(b"PING\r\n")
            reply = conn.recv(64)
        except OSError:
            return False
        finally:
            conn.close()
        return reply.startswith((b"+PONG", b"-NOAUTH"))

    def _wrap_tls(self, raw: socket.socket) -> ssl.SSLSocket:
        assert self.tls is not None
        context = ssl.create_default_context(cafile=str(self.tls.ca_cert))
        context.load_cert_chain(str(self.tls.client_cert), str(self.tls.client_key))
        return context.wrap_socket(raw, server_hostname="localhost")


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((_HOST, 0))
        return int(sock.getsockname()[1])


def _tail(log_file: Path, lines: int = 20) -> str:
    try:
        return "\n".join(log_file.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"
