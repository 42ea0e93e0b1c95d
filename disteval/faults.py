"""Fault injection for failure drills: really kill, delay or perturb one rank of a real run.

The doctor's tests (and anyone rehearsing an incident) set the environment variable ``DISTEVAL_FAULTS`` to a
``;``-separated list of faults, each ``KIND@RANKS:key=value,...`` with RANKS a rank, ``a,b`` ranks or ``*``::

    DISTEVAL_FAULTS="kill@1:batch=2"               rank 1 sends itself SIGKILL after its 2nd batch
    DISTEVAL_FAULTS="delay@1:batch=1,seconds=10"   rank 1 sleeps 10 s after its 1st batch (a straggler)
    DISTEVAL_FAULTS="delay@0:sync=1,seconds=8"     rank 0 sleeps 8 s on reaching the final synchronisation
    DISTEVAL_FAULTS="noise@*:std=0.5"              every rank adds unseeded N(0, std^2) noise to its logits
                                                   (a nondeterministic model: repeated trials disagree)
    DISTEVAL_FAULTS="weights@2:std=0.5"            rank 2 perturbs its weights by N(0, std^2) (a node that
                                                   loaded a different checkpoint)
    DISTEVAL_FAULTS="stop@1:batch=2"               rank 1 stops itself (SIGSTOP) after its 2nd batch (a frozen
                                                   process: alive, holding its sockets, doing nothing)
    DISTEVAL_FAULTS="stop@0:sync=1"                rank 0 stops itself on reaching the final synchronisation
    DISTEVAL_FAULTS="error@1:batch=3"              rank 1 raises RuntimeError after its 3rd batch
    DISTEVAL_FAULTS="stall@1:batch=2"              rank 1's loader stops delivering after its 2nd batch: the
                                                   process collating its 3rd batch (a loader worker, or the rank
                                                   itself with data.num_workers=0) sleeps ``seconds`` (default
                                                   3600) there, as a worker stuck on a dead file system would
    DISTEVAL_FAULTS="diskfull@0:batch=2"           after its 2nd batch every record write of rank 0 fails with
                                                   ENOSPC, as on a full disk (until the run's reserve is freed)
    DISTEVAL_FAULTS="cpu@1:capability=default"    rank 1 computes with torch's DEFAULT CPU kernels
                                                   (ATEN_CPU_CAPABILITY, set before its first kernel): a node of
                                                   other hardware in the fleet (avx2, avx512, default)
    DISTEVAL_FAULTS="tf32@1"                       rank 1 computes float32 matmuls and convolutions in TF32 on
                                                   CUDA (set after the compute settings): a GPU of another
                                                   generation, or a node configured otherwise
    DISTEVAL_FAULTS="preempt@*:batch=3"            after its 3rd batch every rank receives the checkpoint signal
                                                   (DISTEVAL_PREEMPT_SIGNAL, USR2 by default) as a scheduler
                                                   sends it before a preemption: in a requeueing launcher's job
                                                   the rank's PreemptionGuard saves its checkpoint and hands the
                                                   signal on (the job is requeued); elsewhere the signal's default
                                                   action ends the process

Nothing happens when the variable is unset. A malformed value, or a rank outside the world size, raises
ValueError naming the variable (``python -m disteval`` checks it before any rank starts). A ``batch`` index
beyond a rank's last batch never fires: the rank writes a warning to its log. Faults act only in ranks of
``python -m disteval`` (and probes), never in library calls.
"""
from __future__ import annotations

import math
import os
import signal
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch.utils.data import default_collate, get_worker_info

from disteval.common import drills
from disteval.common.drills import simulate_full_disk
from disteval.common.kernels import ENV as CAPABILITY_ENV
from disteval.common.launch_env import preempt_signal

ENV = drills.ENV
KINDS = {"kill": {"batch"}, "delay": {"batch", "seconds", "sync"}, "noise": {"std"}, "weights": {"std"},
         "stop": {"batch", "sync"}, "error": {"batch"}, "diskfull": {"batch"}, "preempt": {"batch"},
         "cpu": {"capability"}, "tf32": set(), "stall": {"batch", "seconds"}}
_STRINGS = {"capability": ("default", "avx2", "avx512")}  # parameters that are names, not numbers
_BATCH_KINDS = ("kill", "delay", "stop", "error", "diskfull", "preempt")


@dataclass(frozen=True)
class Fault:
    """One injected fault: ``kind`` (kill | delay | noise | weights), the ``ranks`` it hits (None = all) and
    its parameters (batch: 1-based batch index after which it fires; seconds; std)."""

    kind: str
    ranks: frozenset[int] | None
    params: dict = field(default_factory=dict)

    def hits(self, rank: int) -> bool:
        return self.ranks is None or rank in self.ranks


def parse(text: str | None) -> list[Fault]:
    """Parse a ``DISTEVAL_FAULTS`` value (see the module docstring). Raises ValueError on malformed input."""
    faults = []
    for item in filter(None, (s.strip() for s in (text or "").split(";"))):
        head, _, args = item.partition(":")
        kind, _, ranks = head.partition("@")
        if kind not in KINDS:
            raise ValueError(f"{ENV}: unknown fault kind {kind!r} in {item!r}; kinds: {sorted(KINDS)}")
        try:
            chosen = None if ranks in ("", "*") else frozenset(int(r) for r in ranks.split(","))
            params = {k.strip(): v.strip() if k.strip() in _STRINGS else float(v)
                      for k, v in (a.split("=", 1) for a in args.split(",") if a.strip())}
        except ValueError:
            raise ValueError(f"{ENV}: cannot parse {item!r}; expected KIND@RANKS:key=value,...") from None
        unknown = set(params) - KINDS[kind]
        if unknown:
            raise ValueError(f"{ENV}: {kind} takes {sorted(KINDS[kind])}, not {sorted(unknown)} ({item!r})")
        if chosen is not None and any(r < 0 for r in chosen):
            raise ValueError(f"{ENV}: ranks must be >= 0 in {item!r}")
        for key, allowed in _STRINGS.items():
            if key in params and params[key] not in allowed:
                raise ValueError(f"{ENV}: {key} must be one of {list(allowed)} in {item!r}")
        batch = params.get("batch", 1.0)
        if batch != int(batch) or batch < 1:
            raise ValueError(f"{ENV}: batch must be a whole number >= 1 (the batch after which it fires) in {item!r}")
        for key in ("seconds", "std"):
            if key in params and not (math.isfinite(params[key]) and params[key] >= 0):
                raise ValueError(f"{ENV}: {key} must be a finite number >= 0 in {item!r}")
        faults.append(Fault(kind, chosen, params))
    return faults


def check_ranks(faults: list[Fault], world_size: int) -> None:
    """Raise ValueError naming a fault aimed at a rank that does not exist in a run of ``world_size`` ranks
    (it would never fire)."""
    for f in faults:
        missing = sorted(r for r in (f.ranks or ()) if r >= world_size)
        if missing:
            raise ValueError(f"{ENV}: {f.kind} aims at rank(s) {missing} but dist.world_size={world_size}; it would "
                             "never fire")


def apply_at_start(rank: int) -> str | None:
    """The ``cpu`` drill of ``rank``: set ``ATEN_CPU_CAPABILITY`` in this process's environment before its first
    kernel, as the rank's node would have it (call it first thing in the rank; torch reads the variable at the
    first kernel, and the fingerprint records the kernel set really used). Returns the value set, None without
    such a drill."""
    from_env = [f for f in parse(os.environ.get(ENV)) if f.kind == "cpu" and f.hits(rank)]
    if not from_env:
        return None
    os.environ[CAPABILITY_ENV] = str(from_env[-1].params["capability"])
    return os.environ[CAPABILITY_ENV]


class StalledCollate:
    """A loader's collate function that sleeps ``seconds`` before collating this rank's batch ``after + 1``
    (1-based), in whichever process collates it: loader worker ``w`` of ``n`` collates the rank's batches
    ``w, w + n, ...`` (0-based, torch's in-order dispatch), the rank itself with no workers."""

    def __init__(self, collate: Callable | None, after: int, seconds: float):
        self.collate, self.after, self.seconds = collate or default_collate, after, seconds
        self.calls = 0  # batches collated by this process (each worker has its own copy)

    def __call__(self, items: Any) -> Any:
        info = get_worker_info()
        index = self.calls if info is None else info.id + info.num_workers * self.calls
        self.calls += 1
        if index == self.after:
            time.sleep(self.seconds)
        return self.collate(items)


class FaultPlan:
    """The faults of this rank, applied at the engine's hooks (model built, outputs computed, batch done)."""

    def __init__(self, rank: int, text: str | None = None):
        self.rank = rank
        self.faults = [f for f in parse(os.environ.get(ENV) if text is None else text) if f.hits(rank)]
        self._rng = torch.Generator().manual_seed(int.from_bytes(os.urandom(8), "little") >> 1)
        self._fired: list[Fault] = []

    def __bool__(self) -> bool:
        return bool(self.faults)

    def on_model(self, model: torch.nn.Module) -> None:
        """``weights``: add N(0, std^2) noise to every floating parameter (fixed per run: seeded by the rank);
        ``tf32``: TF32 on for CUDA matmuls and convolutions."""
        gen = torch.Generator().manual_seed(1000 + self.rank)
        for f in self.faults:
            if f.kind == "tf32":
                torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
                torch.set_float32_matmul_precision("high")
            if f.kind == "weights":
                with torch.no_grad():
                    for p in model.parameters():
                        if p.is_floating_point():
                            p.add_(torch.randn(p.shape, generator=gen).to(p) * f.params.get("std", 0.5))

    def on_outputs(self, outputs):
        """``noise``: add unseeded noise to a logits tensor (fresh entropy every run and trial)."""
        for f in self.faults:
            if f.kind == "noise" and torch.is_tensor(outputs):
                outputs = outputs + torch.randn(outputs.shape, generator=self._rng).to(outputs) * f.params.get("std", 0.5)
        return outputs

    def loader_collate(self, collate: Callable | None) -> Callable | None:
        """``collate`` (the task's, None for torch's default), wrapped in ``StalledCollate`` by a ``stall``
        drill of this rank; unchanged without one."""
        for f in self.faults:
            if f.kind == "stall":
                return StalledCollate(collate, int(f.params.get("batch", 1)), f.params.get("seconds", 3600.0))
        return collate

    def unfired(self) -> list[Fault]:
        """kill/delay faults whose batch this rank never reached (its shard had fewer batches)."""
        return [f for f in self.faults if f.kind in _BATCH_KINDS and f not in self._fired]

    def on_batch(self, batches_done: int) -> None:
        """After batch ``batch``: ``kill`` SIGKILLs this process, ``stop`` SIGSTOPs it, ``delay`` sleeps
        ``seconds``, ``error`` raises RuntimeError, ``preempt`` sends this process the checkpoint signal
        (``disteval.common.launch_env.preempt_signal``; Python runs its handler right after, in this main thread)."""
        for f in self.faults:
            if f.kind not in _BATCH_KINDS or "sync" in f.params or int(f.params.get("batch", 1)) != batches_done:
                continue
            self._fired.append(f)
            if f.kind == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            elif f.kind == "stop":
                os.kill(os.getpid(), signal.SIGSTOP)
            elif f.kind == "delay":
                time.sleep(f.params.get("seconds", 10.0))
            elif f.kind == "diskfull":
                simulate_full_disk()
            elif f.kind == "preempt":
                os.kill(os.getpid(), preempt_signal())
            elif f.kind == "error":
                raise RuntimeError(f"{ENV}: injected error after batch {batches_done} on rank {self.rank}")

    def on_sync(self) -> None:
        """With ``sync=1``: ``stop`` SIGSTOPs this process on reaching the final synchronisation, ``delay``
        sleeps ``seconds`` there (its peers wait inside the synchronisation's first collective meanwhile)."""
        for f in self.faults:
            if f.kind == "stop" and f.params.get("sync"):
                self._fired.append(f)
                os.kill(os.getpid(), signal.SIGSTOP)
            elif f.kind == "delay" and f.params.get("sync"):
                self._fired.append(f)
                time.sleep(f.params.get("seconds", 10.0))
