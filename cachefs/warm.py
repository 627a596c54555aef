"""`cachefs warm`: fill the SSD tier ahead of training, inside the daemon.

Warming runs in the daemon because the SSD tier belongs to it (one process holds its lock and
index) and because reads through the mount would count as the trainer's reads and consume the
published order. A request names what to warm, in that order: the files of a list, the
current order (its first epoch's order, from the cursor on), or every file of the source.

`source_threads` workers take files in turn; for each block they skip what the tier already
holds for the file's current identity (so a warm that was interrupted resumes where it
stopped, at the cost of one stat per file already done), read the rest from the source and
admit it directly, bypassing RAM. Warming stops when the tier is full (cache-once: nothing
would be admitted any more), when admission is disabled (disk full), or when it is done.
Progress is a status dict the CLI polls through the stats snapshot.

Bytes read by warming are counted here, not in the per-epoch records, which describe what
readers saw.

A files list is named by path and read by the daemon, which only its owner or root may ask
(ctrl.py), so it reads nothing its requester could not. Still, the list is read only if it is
a regular file (opened non-blocking: a FIFO must not hold a worker thread, or the unmount),
of at most `LIST_MAX_BYTES`; and no error quotes a line of it, since the warm's status is in
`cachefs stats`, which every user of the mount may read.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import stat
import time
from pathlib import Path

import numpy as np
import trio

from cachefs import threads as threads_mod
from cachefs.cache.ram import block_count
from cachefs.cache.tiered import block_length
from cachefs.errors import CachefsError, OrderError
from cachefs.manifest import check_relpaths
from cachefs.source import Source

log = logging.getLogger(__name__)

LIST_MAX_BYTES = 256 * 2**20  # a files list: ten million paths of 25 bytes


class WarmError(CachefsError):
    """A warm request that cannot be carried out (a bad list of files)."""

    errno_value = errno.EINVAL


class Warmer:
    def __init__(self, source: Source, ssd, *, block_bytes: int, threads: int,
                 order_paths, all_paths):
        self.source = source
        self.ssd = ssd
        self.block_bytes = block_bytes
        self.threads = threads
        self._run_ssd = threads_mod.pool(threads)  # one admission per worker at most
        self._order_paths = order_paths  # () -> list[bytes] | None: current order from cursor
        self._all_paths = all_paths  # () -> list[bytes]: the source manifest (in a thread)
        self._status: dict = {"state": "idle"}
        self._requests_send, self._requests_recv = trio.open_memory_channel(1)

    def status(self) -> dict:
        status = dict(self._status)
        if status["state"] == "running":
            status["elapsed_s"] = round(time.monotonic() - self._started_s, 3)
        return status

    def request(self, value: bytes) -> dict:
        """Start a warm described by a JSON request; returns the status to show the caller.

        Idempotent by the request's `id`: the control getxattr that carries the request may
        reach us twice (the kernel asks again with a larger buffer), and the second time must
        report on the first, not start again.
        """
        try:
            request = json.loads(value)
            mode = request["mode"]
            request_id = request["id"]
        except (ValueError, KeyError, TypeError):
            return {"state": "rejected", "error": f"bad warm request: {value[:100]!r}"}
        if self._status.get("request_id") == request_id:
            return self.status()
        error = None
        if self.ssd is None:
            error = "this mount has no SSD tier (mount it with --ssd-cache and --ssd-size)"
        elif self._status["state"] in ("starting", "running"):
            error = "a warm is already running"
        elif mode not in ("files", "order", "all"):
            error = f"bad warm mode: {mode!r}"
        elif mode == "files" and not isinstance(request.get("files_path"), str):
            error = "a files warm needs files_path"
        if error is not None:
            self._status = {"state": "rejected", "error": error, "request_id": request_id}
        else:
            self._status = {"state": "starting", "mode": mode, "request_id": request_id}
            self._requests_send.send_nowait(request)
        return self.status()

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED):
        task_status.started()
        async for request in self._requests_recv:
            try:
                await self._warm(request)
            except CachefsError as exc:  # a bad request: the status and the log say why
                log.warning("warm failed: %s", exc)
                self._status.update(state="failed", error=str(exc))
            except Exception as exc:  # noqa: BLE001 - a failed warm must not end the mount
                log.exception("warm failed")
                self._status.update(state="failed", error=str(exc))

    async def _paths(self, request: dict) -> list[bytes]:
        mode = request["mode"]
        if mode == "files":
            return await threads_mod.run_one(_read_list, Path(request["files_path"]))
        if mode == "order":
            paths = self._order_paths()
            if paths is not None:
                return paths
            log.info("warm --order: no order published; warming every file")
        return await threads_mod.run_one(self._all_paths)

    async def _warm(self, request: dict) -> None:
        self._started_s = time.monotonic()
        paths = await self._paths(request)
        self._status.update(state="running", files_total=len(paths), files_done=0,
                            bytes_admitted=0, bytes_present=0, blocks_admitted=0, errors=0)
        queue = iter(paths)
        async with trio.open_nursery() as nursery:
            for _ in range(min(self.threads, max(1, len(paths)))):
                nursery.start_soon(self._worker, queue, nursery.cancel_scope)
        if self._status["state"] == "running":
            self._status["state"] = "done"
        self._status["elapsed_s"] = round(time.monotonic() - self._started_s, 3)
        log.info("warm %s: %s", self._status["state"], self._status)

    async def _worker(self, queue, cancel_scope: trio.CancelScope) -> None:
        for relpath in queue:
            try:
                if not await self._warm_file(relpath):
                    self._status["state"] = "full" if not self.ssd.stats()[
                        "admission_disabled"] else "disabled"
                    cancel_scope.cancel()
                    return
            except OSError as exc:
                self._status["errors"] += 1
                log.warning("warm: cannot read %r: %s", relpath, exc)
            self._status["files_done"] += 1

    async def _warm_file(self, relpath: bytes) -> bool:
        """Admit every block of one file; False once the tier takes nothing more."""
        identity = self.source.identity_of(
            await self.source.lstat(relpath, background=True))
        for block_index in range(block_count(identity.size, self.block_bytes)):
            key = (relpath, block_index)
            length = block_length(identity, block_index, self.block_bytes)
            if self.ssd.contains(key, identity):
                self._status["bytes_present"] += length
                continue
            if self.ssd.holds_other_version(key, identity):
                # the file changed since it was cached (a data set regenerated while
                # unmounted): its old blocks go first, or a full tier stayed full of them
                await self._run_ssd(self.ssd.drop_file, relpath, identity)
            if not self.ssd.has_room(length):
                return False
            block = await self.source.read_block(relpath, block_index, self.block_bytes,
                                                 background=True)
            if await self._run_ssd(self.ssd.admit, key, block.identity, block.data):
                self._status["bytes_admitted"] += len(block.data)
                self._status["blocks_admitted"] += 1
        return True


def _read_list(path: Path) -> list[bytes]:
    """Relative paths, one per line; the same path rules as an order's manifest. See the module
    docstring for what is refused; errors name the line, never its text."""
    data = _read_regular_file(path, LIST_MAX_BYTES)
    lines = [line.strip(b"\r\n") for line in data.split(b"\n")]
    paths = [line for line in lines if line.strip()]
    if paths:
        try:
            check_relpaths(np.array(paths, dtype=bytes))
        except OrderError:
            number = next((number for number, line in enumerate(lines, 1)
                           if line.strip() and _refused(line)), "?")
            raise WarmError(f"{path}: line {number} is not a path relative to the source "
                            f"(it is absolute or has a '..' component)") from None
    # `find . -type f` writes ./a/b, which the mount reads as a/b: an entry admitted under
    # another spelling of its path would never be found, nor its room given back
    return [os.path.normpath(relpath) for relpath in paths]


def _refused(relpath: bytes) -> bool:
    """What check_relpaths refuses in a non-empty path, for one path (to name its line)."""
    return relpath.startswith(b"/") or b".." in relpath.split(b"/")


def _read_regular_file(path: Path, max_bytes: int) -> bytes:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        raise WarmError(f"{path}: {exc.strerror}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise WarmError(f"{path} is not a regular file")
        chunks, size = [], 0
        while size <= max_bytes:  # st_size may lie (/proc): count what is read
            chunk = os.read(fd, min(1 << 20, max_bytes + 1 - size))
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
        if size > max_bytes:
            raise WarmError(f"{path} is larger than {max_bytes} bytes")
        return b"".join(chunks)
    except OSError as exc:
        raise WarmError(f"{path}: {exc.strerror}") from None
    finally:
        os.close(fd)
