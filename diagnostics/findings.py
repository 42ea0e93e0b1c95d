"""A check's outcome (``Finding``) and the helpers every state's checks share: evidence from status records,
the ranks' errors, the culprit by the launchers' rule, what the records hold when nothing decides."""
from __future__ import annotations

from dataclasses import dataclass, field

from disteval.job.records import INTERRUPT_TYPES
from launchers.culprit import culprit_from_records

from diagnostics.evidence import Evidence, Run, traceback_frame
from diagnostics.phases import PHASES
from diagnostics.remedies import Remedy

STATUSES = ("pass", "warn", "fail", "unknown", "skipped", "crashed")


@dataclass
class Finding:
    """The outcome of one check. ``status``: pass | warn | fail | unknown (the records do not decide: the
    finding lists what they hold) | skipped | crashed (the check itself raised). ``phase``: where in the run
    the failure happened (a key of ``diagnostics.phases.PHASES``), None when the check is not about a
    failure or the records do not say."""

    state: str
    check: str
    status: str
    finding: str
    evidence: list[Evidence] = field(default_factory=list)
    remedy: Remedy | None = None
    culprit: int | None = None
    phase: str | None = None
    nodes: list[str] | None = None  # a cause that is a link, not a rank: the nodes it joins (no culprit rank)

    def __post_init__(self) -> None:
        assert self.status in STATUSES, self.status
        if self.phase not in PHASES:  # a recorded phase that is no failure phase (done) says nothing here
            self.phase = None

    def as_dict(self) -> dict:
        return {"state": self.state, "check": self.check, "status": self.status, "finding": self.finding,
                "phase": self.phase, "evidence": [e.as_dict() for e in self.evidence],
                "remedy": self.remedy.as_dict() if self.remedy else None, "culprit_rank": self.culprit,
                "culprit_nodes": self.nodes}


def status_ev(run: Run, r: int, fld: str) -> Evidence:
    s = run.statuses.get(r) or {}
    value = s
    for part in fld.split("."):
        value = value.get(part) if isinstance(value, dict) else None
    return Evidence(f"ranks/rank{r}/status.json", repr(value)[:300], field=fld)


def error_ev(run: Run, r: int) -> list[Evidence]:
    """The rank's error message, and the innermost traceback frame (file and line) when it has one."""
    err = (run.statuses.get(r) or {}).get("error") or {}
    out = [Evidence(f"ranks/rank{r}/status.json", f"{err.get('type')}: {str(err.get('message'))[:300]}",
                    field="error.message")]
    frame = traceback_frame(err.get("traceback", ""))
    if frame:
        out.append(Evidence(frame[0], "raised here", line=frame[1]))
    return out


def errors(run: Run) -> dict[int, dict]:
    return {r: s["error"] for r, s in run.statuses.items() if s and s.get("error")}


def interrupted(run: Run) -> bool:
    """The ranks were interrupted from outside (Ctrl-C, the driver killed): every recorded error is an interrupt."""
    if (run.launch or {}).get("outcome") == "interrupted":
        return True
    errs = list(errors(run).values())
    return bool(errs) and all(e.get("type") in INTERRUPT_TYPES for e in errs) and \
        (run.launch or {}).get("outcome") in (None, "running")


def culprit(run: Run):
    """The culprit rank by the launchers' rule, from the records the doctor read (computed once per run)."""
    if "culprit" not in run.derived:
        failed = run.failed and run.world_size and not interrupted(run)
        run.derived["culprit"] = culprit_from_records(
            {r: run.statuses.get(r) for r in range(run.world_size)}, run.deaths()) if failed else None
    return run.derived["culprit"]


def disk_full(err: dict | None) -> bool:
    """A recorded full disk: DiskFullError, or an error record with errno ENOSPC / EDQUOT."""
    return bool(err) and (err.get("type") == "DiskFullError" or err.get("errno") in ("ENOSPC", "EDQUOT"))


def what_was_found(run: Run, limit: int = 6) -> tuple[str, list[Evidence]]:
    """One line and the evidence of what the records hold, for a verdict the evidence does not decide."""
    parts, ev = [], []
    launch = run.launch
    if launch is None:
        parts.append("no launch.json")
    else:
        err = launch.get("error") or {}
        parts.append(f"launch.json outcome {launch.get('outcome')!r}"
                     + (f" ({err.get('type')}: {str(err.get('message'))[:120]})" if err else ""))
        ev.append(Evidence("launch.json", str(launch.get("outcome")), field="outcome"))
    if run.job is not None:
        parts.append(f"job.json state {run.job.get('state')!r}")
        ev.append(Evidence("job.json", str(run.job.get("state")), field="state"))
    records = {r: s for r, s in sorted(run.statuses.items()) if s}
    if not records:
        parts.append("no rank status record")
        ev.append(Evidence("ranks/", "no status.json"))
    for r, s in list(records.items())[:limit]:
        err = s.get("error") or {}
        parts.append(f"rank {r}: phase {s.get('phase')!r}" + (f", {err.get('type')}" if err else ", no error"))
        ev.append(Evidence(f"ranks/rank{r}/status.json", str(s.get("phase")), field="phase"))
    for r, how in sorted(run.deaths().items())[:limit]:
        parts.append(f"rank {r} {how} (launcher)")
        ev.append(Evidence("launch.json", how, field=f"error.deaths.{r}"))
    if run.config is not None:
        ev.append(Evidence(".hydra/config.yaml", str(run.cfg("dist.world_size")), field="dist.world_size"))
    log = run.path / "disteval.log"
    if log.exists():
        lines = log.read_text(errors="replace").splitlines()
        parts.append(f"disteval.log: {len(lines)} line(s)")
        last = max((n for n, line in enumerate(lines, 1) if line.strip()), default=0)
        if last:
            line = lines[last - 1]  # quoted whole (a long one marked where it is cut)
            ev.append(Evidence("disteval.log", line if len(line) <= 600 else line[:600] + " [...]", line=last))
    else:
        parts.append("no disteval.log")
    return "; ".join(parts), ev
