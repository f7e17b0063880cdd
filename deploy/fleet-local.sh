#!/usr/bin/env bash
# A pagedkv fleet behind NVIDIA Dynamo on this machine (no containers): see deploy/fleet_local.py --help.
set -euo pipefail
cd "$(dirname "$0")/.."
exec .venv/bin/python deploy/fleet_local.py "$@"
