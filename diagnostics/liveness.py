"""Is a recorded process still alive? From a record's ``pid``, ``host``, ``boot_id``, ``t_start`` and
``t_heartbeat`` (launch.json for the driver, ranks/rank{r}/status.json for a rank), checked against this
machine. A pid means something only on the host and in the boot it was recorded in, and only for a process
that started before the record did (a pid is reused after its process dies). A heartbeat (rewritten every
``heartbeat_s`` seconds by a background thread while the process lives) is fresh when younger than
``stale_after(heartbeat_s)``; heartbeats compare clocks of two machines when the record comes from another
host, so there they can say "alive" but never "dead".
"""
from __future__ import annotations

import os
import shutil
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path

from disteval.common.liveness import stale_after
from disteval.common.netif import node_id
from disteval.common.liveness import process_state
from disteval.job.records import boot_id

from diagnostics.evidence import Evidence

ALMOST_FULL_BYTES = 8 << 20  # at most this little free space (and under 1 % of the filesystem) is "almost full"


def process_start(pid: int) -> float | None:
    """When process ``pid`` started (epoch seconds, from /proc), or None when /proc cannot say."""
    try:
        ticks = int(Path(f"/proc/{int(pid)}/stat").read_text().rsplit(") ", 1)[1].split()[19])
        btime = next(int(line.split()[1]) for line in Path("/proc/stat").read_text().splitlines()
                     if line.startswith("btime "))
        return btime + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError, StopIteration):
        return None


@dataclass
class ProcessView:
    """``state``: alive | stopped (SIGSTOP, a debugger) | dead | undecided; ``why`` one line; ``evidence``;
    ``heartbeat_age`` (seconds, None when not recorded) and ``fresh`` (the heartbeat is younger than
    ``stale_after``)."""

    state: str
    why: str
    evidence: list[Evidence] = field(default_factory=list)
    heartbeat_age: float | None = None
    fresh: bool = False


def heartbeat(record: dict, source: str, now: float, default_s: float) -> tuple[float | None, bool, list[Evidence]]:
    """(age of the record's ``t_heartbeat`` in seconds, whether it is fresh, the evidence)."""
    beat = record.get("t_heartbeat")
    if not isinstance(beat, (int, float)):
        return None, False, []
    age = now - float(beat)
    limit = stale_after(record.get("heartbeat_s"), default_s)
    return age, age <= limit, [Evidence(source, f"{age:.1f} s ago (stale after {limit:g} s)", field="t_heartbeat")]


def examine(record: dict, source: str, default_beat_s: float, now: float | None = None) -> ProcessView:
    """Whether the process that wrote ``record`` (at ``source``) is alive, by its pid on this machine (same
    host and boot, and same node identity where the record has one: ranks in network namespaces share the
    kernel and the boot id) or else by its heartbeat."""
    now = time.time() if now is None else now
    pid, host, boot = record.get("pid"), record.get("host"), record.get("boot_id")
    ev = [Evidence(source, str(host), field="host"), Evidence(source, str(pid), field="pid")]
    age, fresh, hb_ev = heartbeat(record, source, now, default_beat_s)
    ev += hb_ev
    here, mine = socket.gethostname(), boot_id()
    beat_text = f"its heartbeat is {age:.0f} s old" if age is not None else "it records no heartbeat"
    node = record.get("node")
    if node and node != node_id() and host == here:  # same hostname, another node (namespace or boot)
        here = f"{here} as node {node_id()}"
        host = f"{host} as node {node}"
    if node and node != node_id() and record.get("relayed"):
        ev.append(Evidence(source, "true", field="relayed"))
    if host == here and boot and mine and boot != mine:
        ev.append(Evidence(source, str(boot), field="boot_id"))
        return ProcessView("dead", f"{host} rebooted since (boot_id {boot} is not this boot's {mine})", ev, age, fresh)
    if host != here or not isinstance(pid, int):
        where = f"on host {host}, not this one ({here})" if host != here else "without a pid"
        if fresh:
            return ProcessView("alive", f"it ran {where} and {beat_text}", ev, age, fresh)
        return ProcessView("undecided", f"it ran {where}, so its pid {pid} cannot be checked from here, and {beat_text}"
                           + (" (the two hosts' clocks may differ)" if age is not None else ""), ev, age, fresh)
    state = process_state(pid)
    started = process_start(pid) if state else None
    t_start = record.get("t_start")
    if state is None or state == "Z":
        ev.append(Evidence(f"/proc/{pid}", "no such process" if state is None else "zombie"))
        return ProcessView("dead", f"pid {pid} is not alive on {host} and {beat_text}", ev, age, fresh)
    if started is not None and isinstance(t_start, (int, float)) and started > float(t_start) + 2.0:
        ev.append(Evidence(f"/proc/{pid}/stat", f"started {started - float(t_start):.0f} s after the record"))
        return ProcessView("dead", f"pid {pid} now belongs to another process, started after the record, and "
                           f"{beat_text}", ev, age, fresh)
    ev.append(Evidence(f"/proc/{pid}/stat", f"state {state}"))
    if state in ("T", "t"):
        return ProcessView("stopped", f"pid {pid} is stopped (state {state}: SIGSTOP or a debugger) and {beat_text}",
                           ev, age, fresh)
    return ProcessView("alive", f"pid {pid} is alive on {host} (state {state}) and {beat_text}", ev, age, fresh)


def disk_free(path: Path) -> tuple[int, int] | None:
    """(free bytes, total bytes) of the filesystem holding ``path``, or None."""
    try:
        usage = shutil.disk_usage(path)
    except OSError:
        return None
    return usage.free, usage.total


def almost_full(usage: tuple[int, int] | None) -> bool:
    """(free, total) of a filesystem that cannot take a run's next records: under ``ALMOST_FULL_BYTES`` and
    under 1 % of its size free."""
    return usage is not None and usage[0] < min(ALMOST_FULL_BYTES, usage[1] // 100)
