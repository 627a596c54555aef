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
python3 -m pip install -q --disable-pip-version-check --root-user-action=ignore \
  -e ".${extras:+[$extras]}"
