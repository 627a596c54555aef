#!/usr/bin/env bash
# Set up (system packages and the package with its test extras), lint, and run the test suite.
# Needs root: the tests mount real FUSE file systems. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh test
# lint first, and a finding fails the script (the rule sets and why: pyproject.toml)
python3 -m ruff check cachefs scripts tests
python3 -m mypy cachefs
python3 -m pytest -q "$@"
