"""A rank's numeric fingerprint: what decides which kernels compute its forward pass, and so the last bits of its
outputs. Two ranks with equal fingerprints run the same kernels on the same inputs; ranks that differ form
different numeric classes, and a metric then depends on which samples landed on which class.

Fields (``rank_fingerprint``): ``cpu_capability`` (torch's vectorised kernel set: DEFAULT / AVX2 / AVX512 /
..., chosen at import from the CPU or ``ATEN_CPU_CAPABILITY``), ``cpu_model`` and ``cpu_flags`` (the ISA
extensions among ``CPU_FLAGS`` that the CPU has, from /proc/cpuinfo), ``gpu`` {name, capability} of the rank's
CUDA device, ``torch``, ``cuda``, ``cudnn`` versions, ``blas`` (torch's BLAS_INFO), ``tf32`` {matmul, cudnn},
``matmul_precision`` (``torch.get_float32_matmul_precision``), ``deterministic``
(``torch.are_deterministic_algorithms_enabled``), ``cudnn`` {benchmark, deterministic}, ``threads``
(``torch.get_num_threads``), ``dtype`` (the model's compute dtype, from the caller) and ``allocator`` (the malloc
in force, from the caller). The digest (``fingerprint_digest``) covers every field but the allocator and the
CPU model (neither selects a kernel; a model name differs between steppings that run the same code), and
``numeric_classes`` groups ranks by it.
"""
from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

import torch

CPU_FLAGS = ("sse4_2", "avx", "avx2", "fma", "avx512f", "avx512_bf16", "avx512_vnni", "avx512_fp16", "amx_bf16",
             "amx_tile", "asimd", "sve")  # x86 and Arm extensions that select vectorised kernels
_NOT_NUMERIC = ("allocator", "cpu_model")  # recorded, but never decide a kernel


def _cpuinfo() -> tuple[str | None, list[str]]:
    """(model name, the CPU_FLAGS it has) from /proc/cpuinfo; (None, []) where it cannot be read."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return None, []
    model = re.search(r"^model name\s*:\s*(.+)$", text, re.M)
    flags = re.search(r"^(?:flags|Features)\s*:\s*(.+)$", text, re.M)
    have = set(flags.group(1).split()) if flags else set()
    return (model.group(1).strip() if model else None), [f for f in CPU_FLAGS if f in have]


def _blas() -> str | None:
    """torch's BLAS_INFO from its build configuration (e.g. ``mkl``, ``open``)."""
    found = re.search(r"BLAS_INFO=([^,\s]+)", torch.__config__.show())
    return found.group(1) if found else None


def rank_fingerprint(device: torch.device | str, dtype: str, allocator: str | None = None) -> dict:
    """This process's numeric fingerprint (see the module docstring) for a forward pass on ``device`` in
    ``dtype`` (a name such as ``float32``). Call it after the precision settings are applied (TF32, matmul
    precision, deterministic algorithms): it reads them as they are in force."""
    device = torch.device(device)
    model, flags = _cpuinfo()
    gpu = None
    if device.type == "cuda" and torch.cuda.is_available():
        index = device.index if device.index is not None else torch.cuda.current_device()
        major, minor = torch.cuda.get_device_capability(index)
        gpu = {"name": torch.cuda.get_device_name(index), "capability": f"{major}.{minor}"}
    cudnn = torch.backends.cudnn
    return {
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "cpu_model": model, "cpu_flags": flags, "gpu": gpu,
        "torch": torch.__version__, "cuda": torch.version.cuda,
        "cudnn": cudnn.version() if cudnn.is_available() else None,
        "blas": _blas(),
        "tf32": {"matmul": bool(torch.backends.cuda.matmul.allow_tf32), "cudnn": bool(cudnn.allow_tf32)},
        "matmul_precision": torch.get_float32_matmul_precision(),
        "deterministic": torch.are_deterministic_algorithms_enabled(),
        "cudnn_flags": {"benchmark": bool(cudnn.benchmark), "deterministic": bool(cudnn.deterministic)},
        "threads": torch.get_num_threads(), "dtype": str(dtype), "allocator": allocator,
    }


def fingerprint_digest(fp: dict) -> str:
    """16 hex digits of sha256 over the fingerprint's kernel-deciding fields (canonical JSON)."""
    numeric = {k: v for k, v in fp.items() if k not in _NOT_NUMERIC}
    return hashlib.sha256(json.dumps(numeric, sort_keys=True).encode()).hexdigest()[:16]


def numeric_classes(fingerprints: dict[int, dict]) -> list[dict]:
    """Ranks grouped by fingerprint digest, largest class first (ties: lowest rank first): [{digest, ranks,
    fingerprint}]; ``differs`` on each class after the first: the fields whose values differ from the first
    class's."""
    groups: dict[str, list[int]] = {}
    for r, fp in sorted(fingerprints.items()):
        groups.setdefault(fingerprint_digest(fp), []).append(r)
    ordered = sorted(groups.items(), key=lambda kv: (-len(kv[1]), kv[1][0]))
    out = []
    for digest, ranks in ordered:
        fp = fingerprints[ranks[0]]
        entry = {"digest": digest, "ranks": ranks, "fingerprint": fp}
        if out:
            first = out[0]["fingerprint"]
            entry["differs"] = sorted(k for k in fp if k not in _NOT_NUMERIC and fp.get(k) != first.get(k))
        out.append(entry)
    return out
