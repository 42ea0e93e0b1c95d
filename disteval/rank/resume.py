"""Preemption-safe evaluation: when the scheduler signals a job before a timeout or a preemption (the signal
its launcher announces in ``DISTEVAL_PREEMPT_SIGNAL``, ``disteval.common.launch_env``), every rank saves its metric
states, its sample-id coverage and how
many samples of its shard it has counted, atomically, to RUN_DIR/ranks/rank{r}/checkpoint.pt; the requeued
job loads them and continues after the last counted sample, so the final result equals an uninterrupted
run exactly (states are sums and concatenations of whole batches).

A signal arriving while a batch is being added to the metric (``PreemptionGuard.batch``) waits for it, so a
checkpoint always holds whole batches. A checkpoint is used only when its key (config digest, world size,
rank and shard) matches; it is deleted when the rank finishes.
"""
from __future__ import annotations

import contextlib
import logging
import os
import signal
import tempfile
from pathlib import Path
from typing import Any, Callable

import torch

from disteval.common import launch_env

log = logging.getLogger("disteval.rank")

CHECKPOINT = "checkpoint.pt"


def save_checkpoint(path: Path, state: dict, samples_done: int, key: dict) -> None:
    """Write the checkpoint atomically (temporary file + rename): ``state`` (``Evaluator.state_dict()``), the
    samples of the shard counted so far and the job ``key`` it belongs to."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix="tmp_checkpoint_", suffix=".pt")
    os.close(fd)
    try:
        torch.save({"key": key, "samples_done": int(samples_done), "state": state}, tmp)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def load_checkpoint(path: Path, key: dict) -> dict | None:
    """The checkpoint at ``path`` when it exists and its key equals ``key`` (else None, logged); loaded
    with ``torch.load(weights_only=True)``."""
    if not path.is_file():
        return None
    try:
        ckpt = torch.load(path, weights_only=True)
    except Exception as exc:  # noqa: BLE001 - a torn or foreign file: start over
        log.warning("ignoring unreadable checkpoint %s: %s", path, exc)
        return None
    if ckpt.get("key") != key:
        log.warning("ignoring checkpoint %s written for another job (%s != %s)", path, ckpt.get("key"), key)
        return None
    return ckpt


class PreemptionGuard:
    """Saves a checkpoint when the checkpoint signal arrives, then hands the signal to the previous handler
    (the launcher's, which requeues the job). Active only when the launcher requeues on a signal
    (``launch_env.preemption_requeues()``).

    ``save`` is called with no argument and must write the checkpoint of the current, consistent state.
    Python runs signal handlers in the main thread between any two bytecodes, whichever thread the kernel
    delivered the signal to, so a signal mask cannot protect a batch: a signal that arrives while a batch is
    being added (``batch()``) is only noted, and handled when the batch is complete. Processes forked from
    the rank (DataLoader workers) inherit the handler and ignore the signal."""

    def __init__(self, save: Callable[[], None]):
        self.save = save
        self.signum = launch_env.preempt_signal()
        self.active = launch_env.preemption_requeues()
        self._previous: Any = None
        self._pid = os.getpid()
        self._in_batch = False
        self._pending: tuple | None = None
        self.saved = False
        self.progress: Any = None  # the loop's LoopProgress (set by disteval.rank.loop.GuardHook)

    def __enter__(self) -> "PreemptionGuard":
        if self.active:
            self._pid = os.getpid()
            self._previous = signal.signal(self.signum, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        if self.active:
            signal.signal(self.signum, self._previous if self._previous is not None else signal.SIG_DFL)

    def _handle(self, signum, frame) -> None:
        if os.getpid() != self._pid:  # a forked DataLoader worker: its copy of the state is stale
            return
        if self._in_batch:
            self._pending = (signum, frame)
            return
        self._save_and_chain(signum, frame)

    def _save_and_chain(self, signum, frame) -> None:
        try:
            self.save()
            self.saved = True
            log.warning("signal %s: checkpoint saved; the requeued job resumes from it", signal.Signals(signum).name)
        except Exception:  # noqa: BLE001 - never lose the requeue because of the checkpoint
            log.exception("could not save the checkpoint")
        if callable(self._previous):
            self._previous(signum, frame)

    @contextlib.contextmanager
    def batch(self):
        """Add one batch to the state: a checkpoint signal arriving meanwhile waits until the batch is in."""
        if not self.active:
            yield
            return
        self._in_batch = True
        try:
            yield
        except BaseException:
            self._in_batch = False
            self._pending = None  # the batch is half in: no checkpoint of this state
            raise
        self._in_batch = False
        if self._pending is not None:
            signum, frame = self._pending
            self._pending = None
            self._save_and_chain(signum, frame)

