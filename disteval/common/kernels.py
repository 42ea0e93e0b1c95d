"""torch's CPU kernel set (``ATEN_CPU_CAPABILITY``): which one a process would use, the lowest one common to a
fleet, and pinning a process to it.

ATen picks its vectorised kernels (DEFAULT / AVX2 / AVX512 on x86; VSX, ZVECTOR, SVE256 elsewhere) once, at
the first kernel dispatched in the process (``get_cpu_capability`` in ATen's DispatchStub.cpp: the
``ATEN_CPU_CAPABILITY`` environment variable if set, else what the CPU supports), and keeps it for the life of
the process. Two ranks on different kernel sets compute different last bits (measured: ``nll`` of the
fashion-mnist job 0.21570191937854832 at DEFAULT vs 0.21570192062797605 at AVX2). So a fleet can be pinned to
a common kernel set only before its first kernel: ``native_capability`` asks a forked child (which then exits)
so that this process stays free to choose, ``pin_capability`` sets the variable and checks that it took.
"""
from __future__ import annotations

import os

import torch

from disteval.errors import DistevalError

ENV = "ATEN_CPU_CAPABILITY"
# x86's kernel sets from the least to the most demanding; on other architectures only DEFAULT is common to a
# set of different capabilities
X86_ORDER = ("DEFAULT", "AVX2", "AVX512")


def native_capability() -> str:
    """The kernel set (upper case, as ``torch.backends.cpu.get_cpu_capability``) this process would use,
    without fixing it: a forked child reads it and exits. Call it before the process group and its threads
    exist (a fork copies only the calling thread)."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: read ATen's choice, report it, leave without running any atexit handler
        try:
            os.write(write, torch.backends.cpu.get_cpu_capability().encode())
        finally:
            os._exit(0)
    os.close(write)
    try:
        chunks = []
        while chunk := os.read(read, 64):
            chunks.append(chunk)
    finally:
        os.close(read)
        os.waitpid(pid, 0)
    return b"".join(chunks).decode() or "DEFAULT"


def lowest_common(capabilities: list[str]) -> str:
    """The most demanding kernel set every one of ``capabilities`` can run: their minimum on x86's order
    DEFAULT < AVX2 < AVX512, DEFAULT for any other mix, the value itself when all agree."""
    distinct = set(capabilities)
    if len(distinct) == 1:
        return capabilities[0]
    if distinct <= set(X86_ORDER):
        return min(distinct, key=X86_ORDER.index)
    return "DEFAULT"


def pin_capability(name: str) -> str:
    """Make this process use the kernel set ``name`` (``ATEN_CPU_CAPABILITY``, also inherited by the loader's
    worker processes). Returns the set in force. Raises DistevalError when a kernel already ran in this process,
    so that the set was fixed before and cannot change any more."""
    before = os.environ.get(ENV)
    os.environ[ENV] = name.lower()
    got = torch.backends.cpu.get_cpu_capability()
    if got != name.upper():
        if before is None:
            os.environ.pop(ENV)
        else:
            os.environ[ENV] = before
        raise DistevalError(f"cannot pin the CPU kernels to {name}: this process already uses {got} (torch fixes its "
                            f"kernel set at the first kernel it runs); start the ranks with {ENV}={name.lower()}")
    return got
