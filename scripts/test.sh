#!/usr/bin/env bash
# Set up (system packages and the package with its test extras) and run the test suite.
# Needs root: the tests mount real FUSE file systems. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh test
python3 -m pytest -q "$@"
