#!/usr/bin/env bash
# Regenerate shardserver/proto/sample_response_pb2.py from sample_response.proto.
#
# Needs grpcio-tools, which is the `dev` extra:  pip install -e '.[dev]'
# (it bundles protoc, so no system protoc is required). The generated module is
# committed; rerun this after any edit to the .proto and commit both files.
#
# The generated code checks the protobuf runtime version at import time: the
# runtime must be at least the gencode version printed in the module header
# ("Protobuf Python Version: X.Y.Z"), with the same major version.
#
# Usage: scripts/regen_proto.sh [python]   (default: .venv/bin/python if present, else python3)
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${1:-}"
if [[ -z "$PY" ]]; then
  if [[ -x .venv/bin/python ]]; then PY=.venv/bin/python; else PY=python3; fi
fi
"$PY" -m grpc_tools.protoc \
  --proto_path=shardserver/proto \
  --python_out=shardserver/proto \
  shardserver/proto/sample_response.proto
# Check that the module imports with the installed runtime.
"$PY" -c "import shardserver.proto.sample_response_pb2 as m; print('ok:', m.DESCRIPTOR.package, sorted(m.DESCRIPTOR.message_types_by_name))"
