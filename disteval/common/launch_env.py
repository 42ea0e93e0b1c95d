"""What a launcher tells each rank, through its environment: the rank side of the launcher protocol
(``launchers/protocol.py``). Rank code reads these names only, never a scheduler's own variables, so a new
launcher (Kubernetes, Ray, ...) exports them and touches no rank module.

``DISTEVAL_JOB_ID``          the scheduler's id of the job (a requeued job keeps it), unset outside a scheduler
``DISTEVAL_NODE_RANK``       the index of this rank's node (0-based); torchrun's ``GROUP_RANK`` when unset
``DISTEVAL_PREEMPT_SIGNAL``  the signal's name without ``SIG`` (e.g. ``USR2``) that the scheduler sends before a
                             preemption or time limit and after which it requeues the job; set only by launchers
                             that requeue, so a rank checkpoints on that signal only then
"""
from __future__ import annotations

import os
import signal

JOB_ID = "DISTEVAL_JOB_ID"
NODE_RANK = "DISTEVAL_NODE_RANK"
PREEMPT_SIGNAL = "DISTEVAL_PREEMPT_SIGNAL"
DEFAULT_PREEMPT_SIGNAL = "USR2"


def job_id() -> str | None:
    """The scheduler's job id this rank runs in (``DISTEVAL_JOB_ID``), None outside a scheduler."""
    return os.environ.get(JOB_ID) or None


def node_rank() -> int:
    """This rank's node index: ``DISTEVAL_NODE_RANK``, else torch elastic's ``GROUP_RANK``, else 0.
    Raises ValueError naming the variable when it is not an integer."""
    for name in (NODE_RANK, "GROUP_RANK"):
        value = os.environ.get(name)
        if value not in (None, ""):
            try:
                return int(value)
            except ValueError:
                raise ValueError(f"{name}={value!r} is not a node index (an integer)") from None
    return 0


def preemption_requeues() -> bool:
    """True when the launcher announced a preemption signal after which the job is requeued
    (``DISTEVAL_PREEMPT_SIGNAL`` set): a rank then checkpoints on it."""
    return bool(os.environ.get(PREEMPT_SIGNAL))


def preempt_signal() -> int:
    """The signal number of ``DISTEVAL_PREEMPT_SIGNAL`` (SIGUSR2 when unset or unknown)."""
    name = os.environ.get(PREEMPT_SIGNAL) or DEFAULT_PREEMPT_SIGNAL
    return getattr(signal, f"SIG{name.upper().removeprefix('SIG')}", signal.SIGUSR2)
