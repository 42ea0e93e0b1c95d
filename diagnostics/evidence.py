"""What the doctor reads: a run directory's records, loaded once and never modified.

A run directory (DESIGN.md "Run directory") holds ``.hydra/{config,overrides}.yaml`` (Hydra),
``launch.json`` (the driver), ``job.json`` (a scheduling launcher), ``ranks/rank{r}/status.json`` and
``results.json``. Any of them may be missing or unreadable: the run died early, or the records are from an
external launcher. ``Evidence`` points at the file and field (or line) a finding rests on.
"""
from __future__ import annotations

import json
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf



@dataclass
class Evidence:
    """One fact behind a finding: ``source`` (path relative to the run directory), ``field`` (dotted record
    field) or ``line`` (1-based line of a text file or traceback), and the ``value`` seen there."""

    source: str
    value: str
    field: str | None = None
    line: int | None = None

    def text(self) -> str:
        where = self.source + (f":{self.line}" if self.line else "") + (f" {self.field}" if self.field else "")
        return f"{where} = {self.value}"

    def as_dict(self) -> dict:
        return {"source": self.source, "field": self.field, "line": self.line, "value": self.value}


@dataclass
class Run:
    """The records of one run directory (``load_run``)."""

    path: Path
    config: Any = None                    # OmegaConf DictConfig of .hydra/config.yaml, or None
    hydra: Any = None                     # OmegaConf DictConfig of .hydra/hydra.yaml (launcher settings), or None
    overrides: list[str] = field(default_factory=list)
    launch: dict | None = None
    job: dict | None = None
    results: dict | None = None
    statuses: dict[int, dict | None] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)  # records that exist but could not be read
    unseen: list[str] = field(default_factory=list)  # what lies on other nodes' disks (node-local run directories)
    node_launches: dict[str, dict] = field(default_factory=dict)  # host -> nodes/<host>/launch.json (multi-node)
    derived: dict[str, Any] = field(default_factory=dict)  # values computed once from the records (the culprit)

    @property
    def world_size(self) -> int | None:
        """From launch.json, job.json, results.json, any status record or the config (the first that holds a
        positive integer)."""
        candidates = [(self.launch or {}).get("world_size"), (self.job or {}).get("world_size"),
                      (self.results or {}).get("world_size")]
        candidates += [s.get("world_size") for s in self.statuses.values() if s]
        candidates.append(self.cfg("dist.world_size"))
        for value in candidates:
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                return value
        return None

    def cfg(self, dotted: str, default: Any = None) -> Any:
        """A config value by dotted key, or ``default`` when the config or key is absent."""
        if self.config is None:
            return default
        value = OmegaConf.select(self.config, dotted, default=default)
        return OmegaConf.to_container(value) if OmegaConf.is_config(value) else value

    @property
    def failed(self) -> bool:
        """True when the launcher, the job record or any rank recorded a failure."""
        if self.launch and self.launch.get("outcome") not in (None, "ok", "running"):
            return True
        if self.job and str(self.job.get("state", "")).upper() not in ("", "COMPLETED", "FINISHED", "DONE"):
            return True
        return any(s and s.get("phase") == "failed" for s in self.statuses.values())

    def deaths(self) -> dict[int, str]:
        """Rank -> how the launcher saw it end, from launch.json's error.deaths."""
        err = (self.launch or {}).get("error") or {}
        return {int(k): str(v) for k, v in (err.get("deaths") or {}).items()}

    def rel(self, path: Path) -> str:
        try:
            return str(path.relative_to(self.path))
        except ValueError:
            return str(path)


def _read_json(path: Path, run: Run, required: dict[str, type] | None = None) -> dict | None:
    """The JSON object in ``path``; None (and a problem noted) when it is unreadable, not an object, or lacks a
    ``required`` field (dotted; a trailing ``?`` = may be absent or null) of the given type."""
    if not path.exists():
        return None
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        run.problems.append(f"{run.rel(path)} is unreadable: {exc}")
        return None
    if not isinstance(value, dict):
        run.problems.append(f"{run.rel(path)} is not a JSON object ({type(value).__name__})")
        return None
    for key, typ in (required or {}).items():
        optional = key.endswith("?")
        field_value: Any = value
        for part in key.rstrip("?").split("."):
            field_value = field_value.get(part) if isinstance(field_value, dict) else None
        if (field_value is None and optional) or (isinstance(field_value, typ) and not isinstance(field_value, bool)):
            continue
        run.problems.append(f"{run.rel(path)}: field {key.rstrip('?')!r} is missing or not a {typ.__name__}")
        return None
    return value


def is_run_dir(path: Path) -> bool:
    return any((path / p).exists() for p in (".hydra", "launch.json", "results.json", "ranks", "job.json")) \
        or any((path / "nodes").glob("*/launch.json"))


def load_run(path: str | Path) -> Run:
    """Read every record of the run directory ``path``. Raises FileNotFoundError when it is not a directory
    or holds none of a run's records."""
    path = Path(path).resolve()  # reruns start in the run's own working directory
    if not path.is_dir():
        raise FileNotFoundError(f"{path} is not a directory")
    if not is_run_dir(path):
        raise FileNotFoundError(f"{path} holds no run records (.hydra/, launch.json, ranks/, results.json)")
    run = Run(path)
    hydra_dir = path / ".hydra"
    if not hydra_dir.is_dir():  # a node that did not lead a multi-node launch keeps its Hydra records in nodes/<host>/
        hydra_dir = next(iter(sorted((path / "nodes").glob("*/.hydra"))), hydra_dir)
    if (hydra_dir / "config.yaml").exists():
        try:
            run.config = OmegaConf.load(hydra_dir / "config.yaml")
        except Exception as exc:  # noqa: BLE001 - a broken file is evidence, not a crash
            run.problems.append(f".hydra/config.yaml is unreadable: {exc}")
    if (hydra_dir / "hydra.yaml").exists():
        try:
            run.hydra = OmegaConf.load(hydra_dir / "hydra.yaml")
        except Exception as exc:  # noqa: BLE001
            run.problems.append(f".hydra/hydra.yaml is unreadable: {exc}")
    if (hydra_dir / "overrides.yaml").exists():
        try:
            run.overrides = [str(o) for o in OmegaConf.load(hydra_dir / "overrides.yaml")]
        except Exception as exc:  # noqa: BLE001
            run.problems.append(f".hydra/overrides.yaml is unreadable: {exc}")
    run.launch = _read_json(path / "launch.json", run, {"outcome": str, "world_size?": int})
    nodes = sorted((path / "nodes").glob("*/launch.json"))
    if run.launch is None and not (path / "launch.json").exists() and len(nodes) == 1:
        # one node's driver and no leader's record (e.g. a node of a multi-node launch on its own disk): its record
        run.launch = _read_json(nodes[0], run, {"outcome": str, "world_size?": int})
    if run.launch and not run.overrides:
        run.overrides = list(run.launch.get("overrides") or [])
    run.job = _read_json(path / "job.json", run, {"world_size?": int})
    run.results = _read_json(path / "results.json", run, {"metrics": dict, "per_rank": list, "world_size": int,
                                                           "dataset.num_samples": int, "coverage": dict})
    ranks = sorted(int(m.group(1)) for p in (path / "ranks").glob("rank*")
                   if (m := re.fullmatch(r"rank(\d+)", p.name)))
    size = run.world_size or 0
    for r in sorted(set(ranks) | set(range(size))):
        run.statuses[r] = _read_json(path / "ranks" / f"rank{r}" / "status.json", run,
                                     {"phase": str, "samples_done?": int, "samples_planned?": int})
    for p in sorted((path / "nodes").glob("*/launch.json")):
        record = _read_json(p, run, {"outcome": str})
        if record is not None:
            run.node_launches[p.parent.name] = record
    run.unseen = unseen_records(run)
    return run


def unseen_records(run: Run) -> list[str]:
    """What the doctor cannot see from this directory alone: ranks whose status record is a copy relayed
    through the rendezvous store (their own records, log.txt and batches.json are on their node's disk), and
    ranks with no record here at all. One line per node."""
    by_node: dict[str, list[int]] = {}
    for r, s in sorted(run.statuses.items()):
        if s and s.get("relayed"):
            by_node.setdefault(str(s.get("host")), []).append(r)
    lines = []
    for host, ranks in by_node.items():
        seen = max(float(run.statuses[r].get("t_update") or 0) for r in ranks)
        lines.append(f"ranks {', '.join(map(str, ranks))} on node {host}: status as relayed through the rendezvous "
                     f"store (last seen {time.strftime('%H:%M:%S', time.localtime(seen))}); their own records, "
                     f"log.txt and batches.json are on {host}'s disk under the same run directory")
    missing = [r for r, s in sorted(run.statuses.items()) if s is None]
    if missing and ((run.results or {}).get("filesystem") == "node-local" or by_node):
        lines.append(f"ranks {', '.join(map(str, missing))}: no record here (node-local run directories: look on "
                     "their nodes)")
    return lines


def find_runs(path: str | Path) -> list[Path]:
    """``[path]`` for a run directory; for a sweep directory (Hydra multirun) its job subdirectories in order.
    Raises FileNotFoundError when neither."""
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"{path} is not a directory")
    if is_run_dir(path):
        return [path]
    subs = sorted((p for p in path.iterdir() if p.is_dir() and is_run_dir(p)),
                  key=lambda p: (not p.name.isdigit(), int(p.name) if p.name.isdigit() else 0, p.name))
    if not subs:
        raise FileNotFoundError(f"{path} is neither a run directory nor a sweep directory with runs in it")
    return subs


def traceback_frame(tb: str) -> tuple[str, int] | None:
    """The innermost ``File "...", line N`` of a Python traceback text, or None."""
    frames = re.findall(r'File "([^"]+)", line (\d+)', tb or "")
    return (frames[-1][0], int(frames[-1][1])) if frames else None
