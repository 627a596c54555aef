"""`cachefs stats`'s table: a stats snapshot (the daemon's JSON, man/cachefs-stats.1) as text.

The order in force, the tiers, one line per epoch record and, with an order, one per storage
target. Client side only: it formats a snapshot the CLI has read, and reads nothing itself.
"""

from __future__ import annotations


def format_stats(snapshot: dict) -> str:
    lines = []
    order = snapshot.get("order")
    if order:
        lines.append(f"order: epoch {order.get('epoch')}, {order.get('consumed', 0)}/"
                     f"{order.get('length')} consumed, cursor {order.get('cursor', 0)}, "
                     f"next {'known' if order.get('has_next') else 'unknown'}"
                     f"{merged_ranks(order)}")
    else:
        lines.append("order: none published (plain caching)")
    rejection = snapshot.get("last_rejection")
    if rejection:
        lines.append(f"last rejected order: {rejection['reason']}")
    ram = snapshot["ram"]
    lines.append(f"ram: {ram['bytes'] / 2**20:.1f} / {ram['budget'] / 2**20:.1f} MiB, "
                 f"{ram['blocks']} blocks")
    ssd = snapshot.get("ssd")
    if ssd:
        lines.append(f"ssd: {ssd['bytes'] / 2**20:.1f} / {ssd['budget'] / 2**20:.1f} MiB, "
                     f"{ssd['entries']} entries, {ssd['rejected_checksum']} corrupt, "
                     f"{ssd['dropped_stale']} stale")
    header = (f"{'epoch':>6} {'reads':>8} {'ram':>8} {'ssd':>8} {'prefetch':>8} {'miss':>8} "
              f"{'backend MB':>11} {'stall s':>8}")
    lines.append(header)
    for record in snapshot["epochs"]:
        epoch = "-" if record["epoch"] is None else record["epoch"]
        lines.append(f"{epoch:>6} {record['reads']:>8} {record['hits_ram']:>8} "
                     f"{record['hits_ssd']:>8} {record['prefetched']:>8} {record['misses']:>8} "
                     f"{record['backend_bytes'] / 1e6:>11.1f} {record['stall_s']:>8.2f}")
    lines += format_targets(snapshot.get("targets") or [])
    return "\n".join(lines)


def format_targets(targets: list[dict]) -> list[str]:
    """The storage targets' table of `cachefs stats` (none without an order)."""
    if not targets:
        return []

    def ms(seconds) -> str:
        return "-" if seconds is None else f"{seconds * 1e3:.2f}"

    lines = [f"{'target':>8} {'by':>6} {'items':>8} {'slots':>5} {'depth':>5} {'requests':>9} "
             f"{'MB':>9} {'mean ms':>8} {'p99 ms':>8} {'flight':>6} {'miss':>7} {'stall s':>8}"]
    for target in targets:
        lines.append(f"{target['target']:>8} {target['by']:>6} {target['items']:>8} "
                     f"{target['slots']:>5} {target['depth']:>5} {target['requests']:>9} "
                     f"{target['bytes'] / 1e6:>9.1f} {ms(target['mean_latency_s']):>8} "
                     f"{ms(target['p99_latency_s']):>8} {target['in_flight']:>6} "
                     f"{target['misses']:>7} {target['stall_s']:>8.2f}")
    return lines


def merged_ranks(order_status: dict) -> str:
    """', ranks 0, 1 of 8 merged' for an order merged from several ranks' files, else ''."""
    ranks = order_status.get("ranks") or ()
    if len(ranks) < 2:
        return ""
    return f", ranks {', '.join(map(str, ranks))} of {order_status.get('world_size')} merged"
