#!/usr/bin/env bash
# The dependency floors, installed and run (scripts/floors.txt). Two environments beside .venv:
#   .venv-floors/daemon  ckptd (no torch) with every dependency at its floor, and grpcio-tools at
#                        the version that generated the committed stubs (gen_protos.sh uses it);
#   .venv-floors/client  ckptd-client with only its dependencies (floors) and the pinned torch.
# The client saves and loads through that daemon (scripts/floors_smoke.py); tests/test_protos.py
# then checks the committed stubs against what the floor grpcio-tools makes. Safe to run again.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
FLOORS=.venv-floors
pip_install() { "$1"/bin/python -m pip install -q --disable-pip-version-check "${@:2}"; }
[ -x $FLOORS/daemon/bin/python ] || "$PYTHON" -m venv $FLOORS/daemon
[ -x $FLOORS/client/bin/python ] || "$PYTHON" -m venv $FLOORS/client
pip_install $FLOORS/daemon -r scripts/floors.txt
pip_install $FLOORS/daemon --no-deps --force-reinstall .
$FLOORS/daemon/bin/python -m pip check
if $FLOORS/daemon/bin/python -c "import torch" 2>/dev/null; then
  echo "check_floors: torch is importable in the daemon's environment" >&2
  exit 1
fi
# torch first, pinned (see setup.sh); then the client's floors, and the client without further dependencies.
pip_install $FLOORS/client torch==2.13.0
pip_install $FLOORS/client $(grep -E '^(grpcio|protobuf|numpy|xxhash)==' scripts/floors.txt)
pip_install $FLOORS/client --no-deps --force-reinstall ./client
$FLOORS/client/bin/python -m pip check
$FLOORS/daemon/bin/python -c "import ckpt_core.format, ckpt_core.shard_io, ckpt_core.wire.v1.peer_pb2_grpc, ckptd.daemon, ckptd.cli"
$FLOORS/client/bin/python scripts/floors_smoke.py "$PWD/$FLOORS/daemon/bin/ckptd"
