#!/usr/bin/env bash
# Install what cachefs needs on a fresh Debian machine (run as root): the FUSE 3 system
# packages, then this package with the extras named in $1 (e.g. "test" or "demo,test").
set -euo pipefail
cd "$(dirname "$0")/.."
export DEBIAN_FRONTEND=noninteractive
if ! command -v fusermount3 >/dev/null || ! pkg-config --exists fuse3 2>/dev/null; then
  apt-get update -q
  apt-get install -y -q --no-install-recommends fuse3 libfuse3-dev pkg-config >/dev/null
fi
extras=${1:-}
pip_install() { python3 -m pip install -q --disable-pip-version-check --root-user-action=ignore "$@"; }
pip_install -e ".${extras:+[$extras]}"
if [[ ",$extras," == *",test,"* ]]; then
  # The PyTorch tests need torch's CPU build, which these machines keep as a local wheel.
  # Install it only from there (--no-index): PyPI's torch would pull gigabytes of CUDA.
  # Without it the PyTorch tests skip.
  if pip_install --no-index --no-deps "torch==2.13.0" 2>/dev/null; then
    pip_install "torch==2.13.0" pillow
  else
    echo "setup: no local CPU wheel of torch 2.13.0; the PyTorch tests will be skipped" >&2
  fi
fi
