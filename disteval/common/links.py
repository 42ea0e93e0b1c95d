"""Link throughput measured from a run's own records (status.json ``collectives_done`` and ``in_flight``).

Every collective of disteval records its bytes and seconds on each rank (``disteval.comm.collectives``;
``wire_bytes``: what the collective moved through that rank's link, by the algorithm's standard cost). A
collective large enough to be limited by bandwidth rather than latency (``MIN_WIRE_BYTES``) gives an achieved
throughput; a collective that hung part-way gives one too, from the pieces that finished (``bytes_done`` by
``t_done``). Used by the doctor (COMM/links, and a slow link told from a dead peer) and the sweep summary.
"""
from __future__ import annotations

from typing import Iterable

MIN_WIRE_BYTES = 64 * 1024  # smaller collectives measure latency, not throughput


def mbit(bytes_per_s: float) -> float:
    """bytes/s -> Mbit/s (10^6 bits)."""
    return bytes_per_s * 8 / 1e6


def flight_rate(flight: dict | None) -> dict | None:
    """The progress of a collective under way (status.json ``in_flight``): {op, bytes, bytes_done, seconds,
    bps (payload bytes/s), wire_bps (link bytes/s), needed_s (seconds the whole payload takes at that rate,
    from ``since``)}; None when no piece finished (nothing measured) or the record lacks the fields."""
    if not flight or not flight.get("bytes_done") or not flight.get("t_done") or not flight.get("since"):
        return None
    seconds = float(flight["t_done"]) - float(flight["since"])
    total, done = int(flight.get("bytes") or 0), int(flight["bytes_done"])
    if seconds <= 0 or total <= 0:
        return None
    bps = done / seconds
    wire = int(flight.get("wire_bytes") or total)
    return {"op": flight.get("op"), "bytes": total, "bytes_done": done, "seconds": seconds, "bps": bps,
            "wire_bps": bps * wire / total, "needed_s": total / bps, "payload": flight.get("payload")}


def done_rates(done: Iterable[dict] | None) -> list[dict]:
    """Finished collectives (status.json ``collectives_done``) large enough to measure throughput:
    [{op, wire_bytes, seconds, wire_bps}]."""
    out = []
    for rec in done or []:
        wire, seconds = int(rec.get("wire_bytes") or 0), float(rec.get("seconds") or 0.0)
        if wire >= MIN_WIRE_BYTES and seconds > 0:
            out.append({"op": rec.get("op"), "wire_bytes": wire, "seconds": seconds, "wire_bps": wire / seconds})
    return out


def rank_throughput(status: dict) -> float | None:
    """The best link throughput (bytes/s) a rank's records show: its fastest large finished collective, or the
    one under way; None when nothing large enough was measured. The best, not the mean: a collective's seconds
    include waiting for a late peer, which only ever lowers the figure."""
    rates = [r["wire_bps"] for r in done_rates(status.get("collectives_done"))]
    flight = flight_rate(status.get("in_flight"))
    if flight is not None and flight["bytes_done"] * flight["wire_bps"] / max(flight["bps"], 1e-9) >= MIN_WIRE_BYTES:
        rates.append(flight["wire_bps"])
    return max(rates) if rates else None


def node_throughput(statuses: dict[int, dict]) -> dict[str, dict]:
    """Per node (status ``host``): {ranks, bps (the slowest of its ranks' ``rank_throughput``)} for the nodes with
    a measurement."""
    out: dict[str, dict] = {}
    for r, s in sorted(statuses.items()):
        bps = rank_throughput(s or {})
        if bps is None:
            continue
        node = out.setdefault(str((s or {}).get("host")), {"ranks": [], "bps": bps})
        node["ranks"].append(r)
        node["bps"] = min(node["bps"], bps)
    return out
