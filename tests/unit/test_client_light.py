"""The SDK stays light: importing it pulls in none of the heavy server-side stacks."""

import subprocess
import sys

import bubblespec.client as client


def test_client_import_pulls_no_heavy_modules():
    code = ("import sys, bubblespec.client; "
            "print(','.join(m for m in ('torch','vllm','redis','fastapi','prometheus_client','numpy') "
            "if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == "", f"bubblespec.client imported: {out}"


def test_all_is_exact():
    public = {n for n in dir(client) if not n.startswith("_") and n[0].isupper()}
    assert set(client.__all__) == public
