"""The daemon's garbage collector: what it scans, and how often.

CPython's cyclic collector runs a young collection every 700 net allocations of container
objects, and now and then a full one that walks every tracked object in the process. The
daemon allocates a few small containers for each file it serves (a close's tuple, a
consumption's lists, a fetch's task and coroutine frames), so a pass over 10,000 cached
files ran hundreds of young collections; and each full collection walked the hundreds of
thousands of objects that the imports (numpy, trio, pyfuse3, click) and the wiring made,
none of which ever becomes garbage. Measured on the trio thread (`gc.callbacks`, thread
CPU) over a mount's life of seven hot passes (70,000 closes, the order published): 0.36 s
in the collector, about 5 us a close, a quarter of the daemon's work per close in that pass.

`settle()` is called once, when the mount is built and before it serves:
- `gc.collect()` then `gc.freeze()`: everything alive at that point (modules, classes, the
  wiring, an SSD tier's index) moves to the permanent generation, which no collection walks
  again. These objects live as long as the process, and refcounting still frees any of them
  that is dropped; what would never be freed is a reference cycle through one of them that
  becomes unreachable whole (none is known: they are modules, classes and the mount's own
  objects).
- a young generation of `YOUNG_OBJECTS` net allocations instead of 700: the collections that
  still run find as much garbage, a tenth as often. The older generations keep their ratios.
The collector stays on: a cycle made while the mount serves is collected as before, after at
most `YOUNG_OBJECTS` more allocations. With both, the same seven passes spent 0.06 s in the
collector.
"""

from __future__ import annotations

import gc
import logging

log = logging.getLogger(__name__)

# net allocations of container objects between two young collections (CPython's default: 700)
YOUNG_OBJECTS = 10_000


def settle() -> None:
    """Freeze what exists now and make young collections rarer (module docstring)."""
    gc.collect()
    gc.freeze()
    _, middle, old = gc.get_threshold()
    gc.set_threshold(YOUNG_OBJECTS, middle, old)
    log.debug("garbage collector: %d objects frozen, thresholds %s", gc.get_freeze_count(),
              gc.get_threshold())
