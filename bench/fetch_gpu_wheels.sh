#!/usr/bin/env bash
# Run on the host (which has network access to the package index) before a device call: downloads the wheels
# the services need and the device image lacks (structlog, grpcio-health-checking, grpcio-reflection; grpcio and
# protobuf at the versions our generated stubs were made with) into .whl/ at the repository root, ignored by
# git. Then call the device with carry [".whl"] and `bash bench/gpu_check.sh`, which installs them offline.
set -euo pipefail
cd "$(dirname "$0")/.."
exclude="$(git rev-parse --git-path info/exclude)"
grep -qx '/.whl/' "$exclude" 2>/dev/null || echo '/.whl/' >> "$exclude"
python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl \
  structlog==26.1.0 grpcio==1.85.3 grpcio-health-checking==1.85.1 grpcio-reflection==1.85.1 protobuf==7.36.2
ls -la .whl
