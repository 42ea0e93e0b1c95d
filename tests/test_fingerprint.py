"""Numeric fingerprints (disteval/common/fingerprint.py): what they read from torch as it is in force, which fields
the digest covers, and how ranks are grouped into numeric classes."""
from __future__ import annotations

import torch

from disteval.common.fingerprint import fingerprint_digest, numeric_classes, rank_fingerprint


def test_fingerprint_reads_the_settings_in_force():
    threads, precision = torch.get_num_threads(), torch.get_float32_matmul_precision()
    try:
        torch.set_num_threads(1)
        torch.set_float32_matmul_precision("high")
        fp = rank_fingerprint("cpu", "bf16", "tcmalloc")
        assert (fp["threads"], fp["matmul_precision"], fp["dtype"], fp["allocator"]) == (1, "high", "bf16", "tcmalloc")
        assert fp["cpu_capability"] == torch.backends.cpu.get_cpu_capability() and fp["gpu"] is None
        assert fp["torch"] == torch.__version__
        torch.set_float32_matmul_precision("highest")
        assert fingerprint_digest(rank_fingerprint("cpu", "bf16")) != fingerprint_digest(fp)  # precision counts
    finally:
        torch.set_num_threads(threads)
        torch.set_float32_matmul_precision(precision)


def test_digest_ignores_what_selects_no_kernel_and_classes_group_ranks():
    base = rank_fingerprint("cpu", "fp32", "tcmalloc")
    other_malloc = dict(base, allocator="system", cpu_model="another stepping")
    assert fingerprint_digest(other_malloc) == fingerprint_digest(base)
    slow = dict(base, cpu_capability="DEFAULT")
    classes = numeric_classes({0: base, 1: slow, 2: other_malloc, 3: slow, 4: dict(slow, threads=7)})
    assert [c["ranks"] for c in classes] == [[0, 2], [1, 3], [4]]  # largest first, then by lowest rank
    assert "differs" not in classes[0]
    assert classes[1]["differs"] == ["cpu_capability"] and classes[2]["differs"] == ["cpu_capability", "threads"]
    assert [c["digest"] for c in classes] == [fingerprint_digest(f) for f in (base, slow, dict(slow, threads=7))]
    assert numeric_classes({0: base, 1: dict(base)})[0]["ranks"] == [0, 1]
