#!/usr/bin/env bash
# Regenerate the committed gRPC stubs from protos/ (tests/test_protos.py fails when they are stale).
set -euo pipefail
cd "$(dirname "$0")/.."
"${PYTHON:-.venv/bin/python}" -m grpc_tools.protoc -Iprotos --python_out=client --pyi_out=client --grpc_python_out=client \
  protos/ckpt/wire/v1/ckptd.proto protos/ckpt/wire/v1/peer.proto
