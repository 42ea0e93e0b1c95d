"""The network links as the run's records measured them: a collective that timed out because its link was
slow (it was moving, at a measured rate) told apart from one whose peer was gone (nothing moved, a heartbeat
stopped), and the achieved throughput per node (COMM/links) that tells a slow link from a slow rank.

The rates come from ``disteval.common.links`` (status.json ``in_flight.bytes_done`` / ``t_done`` of the pieces
of a collective under way, ``collectives_done`` of the finished ones)."""
from __future__ import annotations

import math
import statistics

from disteval.common.links import flight_rate, mbit, node_throughput

from diagnostics.evidence import Evidence, Run
from diagnostics.findings import Finding, status_ev
from diagnostics.remedies import Remedy

SLOW_FACTOR = 4.0  # a node whose links ran this many times slower than the others' is named
MARGIN = 2.0  # a suggested timeout: this many times the seconds the payload needed at the measured rate


def sync_timeout(run: Run, phase: str | None) -> tuple[float, str]:
    """(seconds, config key) of the timeout that bounded a collective in ``phase``: communication.sync_timeout_s
    for the final synchronisation when set, else communication.timeout_s."""
    timeout = float(run.cfg("communication.timeout_s", 300.0) or 300.0)
    sync = run.cfg("communication.sync_timeout_s", None)
    if phase == "sync" and sync is not None:
        return float(sync), "communication.sync_timeout_s"
    return timeout, "communication.sync_timeout_s" if phase == "sync" else "communication.timeout_s"


def slow_link(run: Run, timed: dict[int, dict], phase: str | None) -> Finding | None:
    """A collective that timed out while it was still moving data: some rank's ``in_flight`` shows pieces that
    finished (``bytes_done`` > 0) at a rate too low to move the whole payload within the timeout, and no rank's
    heartbeat stopped (the caller checked). The finding names the collective, the payload (state name, dtype),
    its bytes, the measured throughput, the nodes the link joins and the timeout that would have sufficed; the
    remedy raises that timeout and, for a float payload its metric declares compressible, turns on fp16
    compression (never for counts or ids). None when no rank's records show such progress."""
    statuses = {r: s for r, s in run.statuses.items() if s}
    rates = {r: flight_rate(s.get("in_flight")) for r, s in statuses.items()}
    rates = {r: f for r, f in rates.items() if f is not None and f["bytes_done"] < f["bytes"]}
    if not rates:
        return None
    timeout, key = sync_timeout(run, phase)
    slowest = max(rates, key=lambda r: rates[r]["needed_s"])
    f = rates[slowest]
    if f["needed_s"] <= timeout:
        return None  # at the measured rate it would have finished in time: something else stopped it
    suggested = float(max(math.ceil(MARGIN * f["needed_s"]), math.ceil(1.5 * timeout)))
    hosts = sorted({str(statuses[r].get("host")) for r in statuses})
    across = f"the link between node(s) {', '.join(hosts)}" if len(hosts) > 1 else f"the links of node {hosts[0]}"
    payload = f.get("payload") or {}
    what = f"{f['op']} of {payload['name']} ({payload.get('dtype')})" if payload.get("name") else f["op"]
    overrides = [f"{key}={suggested:g}"]
    why = (f"at the measured {mbit(f['wire_bps']):.2f} Mbit/s the {what} needs about {f['needed_s']:.1f} s; "
           f"allow {suggested:g} s")
    compressible = bool(payload.get("compressible")) and str(payload.get("dtype", "")).startswith(("float", "bfloat"))
    if compressible and run.cfg("communication.compression", "none") in ("none", None):
        overrides.append("communication.compression=fp16")
        why += (f"; fp16 compression sends {payload['name']} in 2 bytes a value (its metric declares it "
                "compressible; counts and ids stay exact)")
    ev = [status_ev(run, slowest, "in_flight"), status_ev(run, slowest, "t_heartbeat")]
    ev += [status_ev(run, r, "error.message") for r in sorted(timed)[:2]]
    moved = f"{f['bytes_done']:,} of {f['bytes']:,} bytes" + (f" (rank {slowest})" if len(rates) > 1 else "")
    return Finding("COMM", "timeout", "fail",
                   f"a slow link, not a dead peer: the {what} was still moving when the {timeout:g} s timeout "
                   f"({key}) ran out: {moved} in {f['seconds']:.1f} s, {mbit(f['wire_bps']):.2f} Mbit/s through "
                   f"{across}; at that rate it needed about {f['needed_s']:.1f} s, so {key}={suggested:g} would "
                   "have sufficed; every rank's heartbeat kept beating", ev, Remedy(overrides, why),
                   culprit=None, phase=phase, nodes=hosts)


def peer_gone(run: Run, culprit: int, timed: dict[int, dict]) -> tuple[str, list[Evidence]]:
    """What a rank of another node that waited for the stopped ``culprit`` recorded of its collective (status.json
    ``in_flight``, which outlives the rank; those in ``timed`` first): "; rank q waited in OP with peers [...] for
    S s: B of N bytes had moved, then nothing (a peer gone, not a slow link)". ("", []) when none recorded one."""
    host = (run.statuses.get(culprit) or {}).get("host")
    others = [q for q, s in sorted(run.statuses.items()) if s and q != culprit and s.get("host") != host]
    for q in sorted(others, key=lambda q: (q not in timed, q)):  # a rank that timed out first
        s = run.statuses.get(q) or {}
        flight = s.get("in_flight") or {}
        if not flight.get("op"):
            continue
        end = (s.get("error") or {}).get("time") or s.get("t_update")
        waited = f" for at least {float(end) - float(flight['since']):.0f} s" if end and flight.get("since") else ""
        done, total = int(flight.get("bytes_done") or 0), int(flight.get("bytes") or 0)
        moved = (f"{done:,} of {total:,} bytes had moved, then nothing" if done else
                 f"none of its {total:,} bytes had moved")
        return (f"; rank {q} waited in {flight['op']} with peers {flight.get('peers')}{waited}: {moved} (a peer gone, "
                "not a slow link)", [status_ev(run, q, "in_flight")])
    return "", []


def comm_links(run: Run, probes: dict | None) -> Finding:
    """Achieved throughput per node, from the collectives large enough to measure it. Warn when a node's links
    ran ``SLOW_FACTOR`` times slower than the median node's (a slow link; a rank slow in its forward pass is
    COMM/stragglers' case, and its collectives are not slower)."""
    nodes = node_throughput({r: s for r, s in run.statuses.items() if s})
    if not nodes:
        return Finding("COMM", "links", "skipped", "no collective large enough to measure a link's throughput "
                       "(at least 64 KiB through a rank's link)")
    table = "; ".join(f"{h}: {mbit(n['bps']):,.1f} Mbit/s (ranks {n['ranks']})" for h, n in sorted(nodes.items()))
    ev = [Evidence(f"ranks/rank{n['ranks'][0]}/status.json", f"{mbit(n['bps']):,.1f} Mbit/s",
                   field="collectives_done") for _, n in sorted(nodes.items())]
    if len(nodes) < 2:
        return Finding("COMM", "links", "pass", f"measured link throughput: {table}", ev)
    median = statistics.median(n["bps"] for n in nodes.values())
    slow = {h: n for h, n in nodes.items() if n["bps"] * SLOW_FACTOR < median}
    if slow:
        h, n = min(slow.items(), key=lambda kv: kv[1]["bps"])
        return Finding("COMM", "links", "warn", f"node {h}'s link is slow: its ranks {n['ranks']} moved their "
                       f"collectives at {mbit(n['bps']):,.1f} Mbit/s, under 1/{SLOW_FACTOR:g} of the median node's "
                       f"{mbit(median):,.1f} Mbit/s ({table}): a slow link, not a slow rank (forward speed is "
                       "COMM/stragglers')", ev, culprit=n["ranks"][0])
    return Finding("COMM", "links", "pass", f"measured link throughput: {table}", ev)
