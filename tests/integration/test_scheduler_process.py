"""The `bubblespec scheduler` process: gRPC health, reflection, HTTP probes, SIGTERM drain."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_health_reflection_probes_and_sigterm():
    grpc_port, http_port = free_port(), free_port()
    proc = subprocess.Popen([sys.executable, "-m", "bubblespec.cli.main", "scheduler", "--host", "127.0.0.1",
                             "--grpc-port", str(grpc_port), "--http-port", str(http_port)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        with grpc.insecure_channel(f"127.0.0.1:{grpc_port}") as channel:
            health = health_pb2_grpc.HealthStub(channel)
            for service in ("", "bubblespec.v1.Rollout", "bubblespec.v1.WorkerLink"):
                resp = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=30, wait_for_ready=True)
                assert resp.status == health_pb2.HealthCheckResponse.SERVING
            refl = reflection_pb2_grpc.ServerReflectionStub(channel)
            answer = next(refl.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]),
                                                    timeout=10))
            names = {s.name for s in answer.list_services_response.service}
            assert {"bubblespec.v1.Rollout", "bubblespec.v1.WorkerLink", "grpc.health.v1.Health"} <= names
        for _ in range(100):
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{http_port}/healthz", timeout=5) as r:
                    assert json.loads(r.read())["ok"] is True
                break
            except OSError:
                time.sleep(0.1)
        try:  # no worker yet: alive but not ready
            urllib.request.urlopen(f"http://127.0.0.1:{http_port}/readyz", timeout=5)
            raise AssertionError("/readyz should answer 503 without workers")
        except urllib.error.HTTPError as err:
            assert err.code == 503
        started = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
        assert time.monotonic() - started < 30
        assert b"shutting down" in proc.stdout.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
