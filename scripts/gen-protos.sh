#!/usr/bin/env bash
# Regenerates the gRPC stubs under proto/ from proto/bubblespec/api/v1/*.proto.
# CI runs this and fails when the committed stubs differ (see .ci/run).
set -euo pipefail
cd "$(dirname "$0")/.."
python -m grpc_tools.protoc -Iproto --python_out=proto --pyi_out=proto \
  --grpc_python_out=proto proto/bubblespec/api/v1/*.proto
