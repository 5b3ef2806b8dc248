#!/usr/bin/env bash
# Regenerate the committed gRPC stubs from protos/ with the oldest grpcio-tools ckptd supports (scripts/floors.txt),
# from the floors' environment that scripts/check_floors.sh makes: stubs from newer tools would need newer grpcio and
# protobuf than the declared floors. tests/test_protos.py fails when the stubs are stale.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-.venv-floors/daemon/bin/python}
if [ ! -x "$PYTHON" ]; then
  echo "gen_protos: $PYTHON is missing: run scripts/check_floors.sh first (it installs the floor grpcio-tools)" >&2
  exit 2
fi
"$PYTHON" -m grpc_tools.protoc -Iprotos --python_out=client --pyi_out=client --grpc_python_out=client \
  protos/ckpt_core/wire/v1/ckptd.proto protos/ckpt_core/wire/v1/peer.proto protos/ckpt_core/wire/v1/cluster.proto
# The trimmed etcd v3 API of the etcd cluster view (daemon only, so generated into ckptd/).
"$PYTHON" -m grpc_tools.protoc -Iprotos --python_out=. --pyi_out=. --grpc_python_out=. \
  protos/ckptd/cluster/etcd_wire/kv.proto protos/ckptd/cluster/etcd_wire/watch.proto protos/ckptd/cluster/etcd_wire/lease.proto
