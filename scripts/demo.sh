#!/usr/bin/env bash
# Set up (system packages, and this package with matplotlib for the plot), then run the demo:
# a generated slow data set read for a few epochs, directly and through cachefs, side by side.
# Needs root (FUSE). Arguments go to `cachefs demo` (see man/cachefs-demo.1), e.g. --files 500.
# The table is printed; cachefs-demo.json and cachefs-demo.png go to the current directory
# (or --output DIR).
set -euo pipefail
"$(dirname "$0")/setup.sh" demo
exec python3 -m cachefs demo "$@"
