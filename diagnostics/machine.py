"""The doctor's state machine: INIT -> SHARDS -> CONVERGENCE -> COMM -> RESULT.

Every check of every state runs (a check that raises is reported as ``crashed`` with its exception and the
others still run); the verdict is the first state, in flowchart order, with a failing check, else the first
with an ``unknown`` one (the records do not decide: the finding lists what they hold), and the remedy is that
check's. A run recorded as failed for which no check fails or is unknown gets an ``unknown`` verdict
(RESULT/undecided) listing what the records hold: never a guess. The culprit rank is the verdict's, else the
launcher's (earliest non-network error across ranks, ``launchers.culprit``).
"""
from __future__ import annotations

import traceback
from dataclasses import dataclass, field
from pathlib import Path

from diagnostics.checks import CHECKS, STATES, Finding
from diagnostics.evidence import Evidence, Run
from diagnostics.findings import what_was_found
from diagnostics.remedies import Remedy


@dataclass
class Diagnosis:
    """All findings in state order, the verdict (first failing finding, or None for a healthy run) and any
    checks that crashed."""

    run: Run
    findings: list[Finding] = field(default_factory=list)

    @property
    def verdict(self) -> Finding | None:
        """The first failing finding in state order, else the first ``unknown`` one, else None (healthy)."""
        for status in ("fail", "unknown"):
            for state in STATES:
                for f in self.findings:
                    if f.state == state and f.status == status:
                        return f
        return None

    @property
    def crashed(self) -> list[Finding]:
        return [f for f in self.findings if f.status == "crashed"]

    @property
    def remedy(self) -> Remedy | None:
        v = self.verdict
        return v.remedy if v else None

    @property
    def culprit(self) -> int | None:
        v = self.verdict
        if v and v.culprit is not None:
            return v.culprit
        if v and v.nodes:  # a link between nodes, not a rank, is the cause
            return None
        if self.run.launch and (self.run.launch.get("error") or {}).get("rank") is not None:
            return int(self.run.launch["error"]["rank"])
        return None

    def failure_key(self) -> tuple:
        """Identity of the failure for --apply's "never the same (failure, remedy) pair twice"."""
        v = self.verdict
        return (v.state, v.check, v.culprit) if v else ()

    @property
    def exit_code(self) -> int:
        """0 healthy, 1 problems found or a verdict the records do not decide (``unknown``), 2 the doctor could
        not finish (a check crashed and nothing failed)."""
        if self.verdict is not None:
            return 1
        return 2 if self.crashed else 0


def diagnose(run: Run, probes: dict | None = None, reference: str | Path | None = None) -> Diagnosis:
    """Run every check of every state on ``run`` (and the probe results) and return the Diagnosis.
    ``reference``: a run directory whose metrics ``run`` must reproduce (CONVERGENCE/reference)."""
    if reference is not None:
        run.derived["reference"] = Path(reference)
    diag = Diagnosis(run)
    for problem in run.problems:  # a record that exists but cannot be read: nothing can be concluded from it
        diag.findings.append(Finding("INIT", "records", "fail", problem + " (the doctor cannot judge what it held)",
                                     [Evidence(problem.split(" ", 1)[0], "unreadable")]))
    for state in STATES:
        for check in CHECKS[state]:
            name = check.__name__.split("_", 1)[-1]
            try:
                diag.findings.append(check(run, probes))
            except Exception as exc:  # noqa: BLE001 - a broken check must not hide the others
                frame = traceback.extract_tb(exc.__traceback__)[-1]
                diag.findings.append(Finding(state, name, "crashed", f"the check raised {type(exc).__name__}: {exc}",
                                             [Evidence(frame.filename, "raised here", line=frame.lineno)]))
    if probes:
        diag.findings.extend(probe_findings(probes))
    if run.failed and not any(f.status in ("fail", "unknown") for f in diag.findings):
        found, ev = what_was_found(run)
        diag.findings.append(Finding("RESULT", "undecided", "unknown", f"the run is recorded as failed but no check "
                                     f"could name why from its records. Found: {found}", ev))
    return diag


def probe_findings(probes: dict) -> list[Finding]:
    """Findings of the live probes (``diagnostics.probes``), placed in their states."""
    out = []
    src = probes.get("path", "probe.json")
    if probes.get("error"):
        out.append(Finding("INIT", "probe.rendezvous", "fail", f"the probe ranks failed: {probes['error'][:300]}",
                           [Evidence(src, probes["error"][:300], field="error")], culprit=probes.get("culprit")))
        return out
    bar = probes.get("rendezvous") or {}
    if bar.get("missing"):
        out.append(Finding("INIT", "probe.rendezvous", "fail", f"rank(s) {bar['missing']} did not arrive at the "
                           f"monitored barrier within {bar.get('timeout_s')} s", [Evidence(src, str(bar), field="rendezvous")],
                           culprit=bar["missing"][0]))
    else:
        out.append(Finding("INIT", "probe.rendezvous", "pass", f"all {probes.get('world_size')} ranks passed a monitored "
                           f"barrier in {bar.get('seconds', 0):.3f} s", [Evidence(src, str(bar), field="rendezvous")]))
    lat = probes.get("latency") or {}
    if lat:
        out.append(Finding("COMM", "probe.latency", "pass", f"all_reduce of 8 bytes: {lat['small_s'] * 1e3:.2f} ms; of "
                           f"{lat['payload_bytes']:,} bytes: {lat['payload_s'] * 1e3:.1f} ms; a timeout of at least "
                           f"{lat['suggested_timeout_s']:g} s fits", [Evidence(src, str(lat), field="latency")]))
    bal = probes.get("balance") or {}
    if bal.get("skipped"):
        out.append(Finding("SHARDS", "probe.balance", "pass", f"not measured: {bal['skipped']}",
                           [Evidence(src, str(bal), field="balance")]))
    elif bal:
        times = bal["projected_s"]
        slow = max(range(len(times)), key=lambda r: times[r])
        med = sorted(times)[len(times) // 2]
        status = "warn" if med > 0 and times[slow] > 2 * med else "pass"
        out.append(Finding("SHARDS", "probe.balance", status, f"projected forward time per rank "
                           f"{min(times):.2f}..{max(times):.2f} s (slowest rank {slow})",
                           [Evidence(src, str(bal), field="balance")], culprit=slow if status == "warn" else None))
    drift = probes.get("drift") or {}
    if drift:
        bad = [r for r, d in enumerate(drift["max_abs_logit_diff"]) if d > drift["tolerance"]]
        ev = [Evidence(src, str(drift), field="drift")]
        ref = drift.get("reference", "rank 0")
        if bad:
            majority = ref != "rank 0" and len(bad) < len(drift["max_abs_logit_diff"]) / 2
            out.append(Finding("RESULT", "probe.drift", "fail", f"on the same canary batch of {drift['batch']} samples, "
                               f"rank(s) {bad} differ from the {ref} by up to {max(drift['max_abs_logit_diff']):.3g} in "
                               f"the logits and disagree on {max(drift['argmax_disagreements'])} argmax(es): other weights "
                               "or hardware" + ("" if majority else " (no majority of ranks agrees)"), ev,
                               culprit=bad[0] if majority else None))
        else:
            out.append(Finding("RESULT", "probe.drift", "pass", f"the canary batch gives the same logits on every rank "
                               f"(max difference {max(drift['max_abs_logit_diff']):.3g})", ev))
    return out
