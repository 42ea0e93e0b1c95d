"""Checkpoints for tests and benchmarks of several checkpoints in one job (``model.checkpoints``): a shipped
state dict and seeded perturbations of it."""
from __future__ import annotations

from pathlib import Path

import torch


def perturbed_checkpoints(source: Path, folder: Path, stds: tuple[float, ...], stem: str, seed: int = 0) -> list[Path]:
    """``folder/<stem>_<i>.pt`` for each ``stds[i]``: ``source``'s plain state dict with N(0, (std * s)^2) noise
    added to every floating tensor of rank >= 1 except BatchNorm running statistics (s: the tensor's own std;
    std 0 keeps the weights), one seeded generator for all. Returns the paths in order."""
    state = torch.load(source, weights_only=True)
    gen = torch.Generator().manual_seed(seed)
    out = []
    for i, std in enumerate(stds):
        noisy = {k: v + torch.randn(v.shape, generator=gen) * std * v.float().std() if v.is_floating_point()
                 and v.dim() > 0 and "running" not in k else v for k, v in state.items()}
        out.append(Path(folder) / f"{stem}_{i}.pt")
        torch.save(noisy, out[-1])
    return out
