#!/usr/bin/env bash
# Install what cachefs needs on a fresh Debian machine (run as root): the FUSE 3 system
# packages, then this package with the extras named in $1 (e.g. "test" or "demo,test").
set -euo pipefail
cd "$(dirname "$0")/.."
export DEBIAN_FRONTEND=noninteractive
PYFUSE3_VERSION=3.5.0
# gcc: pyfuse3's build, and cachefs/_readpool.c (setup.py)
if ! command -v fusermount3 >/dev/null || ! pkg-config --exists fuse3 2>/dev/null \
    || ! command -v patch >/dev/null || ! command -v gcc >/dev/null; then
  apt-get update -q
  apt-get install -y -q --no-install-recommends fuse3 libfuse3-dev pkg-config patch gcc \
    >/dev/null
fi
extras=${1:-}
pip_install() { python3 -m pip install -q --disable-pip-version-check --root-user-action=ignore "$@"; }
# pyfuse3 built from its source distribution with the patches in scripts/patches/: read()
# gets the inode when the kernel sends no handle, which the zero-request data plane needs,
# invalidate_inode_range() drops a range of a file's pages (the daemon checks for each at
# start and falls back without it), the request loop reads a queued request before it
# waits for the FUSE fd (less of the trio thread's time per request; nothing depends on it),
# and the kernel is told it may send lookups of one directory at once (libfuse before 3.17
# leaves that out of its INIT reply, and they came one at a time; nothing depends on it).
if ! python3 -c "import pyfuse3, sys; sys.exit(not (getattr(pyfuse3, 'READ_FH_IS_INODE_WITHOUT_OPEN', 0) and hasattr(pyfuse3, 'invalidate_inode_range') and getattr(pyfuse3, 'READS_BEFORE_WAITING', 0) and getattr(pyfuse3, 'PARALLEL_DIROPS', 0)))" 2>/dev/null; then
  work=$(mktemp -d)
  python3 -m pip download -q --disable-pip-version-check --no-deps --no-binary pyfuse3 \
    -d "$work" "pyfuse3==$PYFUSE3_VERSION"
  tar xzf "$work/pyfuse3-$PYFUSE3_VERSION.tar.gz" -C "$work"
  for fix in read-inode-without-open invalidate-inode-range reads-before-waiting \
      parallel-dirops; do
    patch -s -d "$work/pyfuse3-$PYFUSE3_VERSION" -p1 < "scripts/patches/pyfuse3-$fix.patch"
  done
  pip_install "$work/pyfuse3-$PYFUSE3_VERSION"
  rm -rf "$work"
fi
# editable: setup.py builds cachefs/_readpool.c next to its source (cachefs/read_pool.py)
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
