"""Train the reference CNNs shipped in disteval/models/checkpoints/ (seeded, CPU, a few minutes).

    python scripts/train_reference_cnns.py [--only digits|fashion] [--fashion-root /usr/share/datasets/fashion-mnist]
                                           [--out DIR]   (default: ./reference-cnns; the shipped ones are
                                                          disteval/models/checkpoints, replaced only when named)

digits_cnn: scikit-learn digits' train split (70 %, stratified, random_state=0), evaluated on the held-out
30 %. fashion_cnn: the 60,000-image Fashion-MNIST train set, evaluated on the 10,000-image test set.
Writes plain state dicts (torch.save(model.state_dict())) and provenance.json (torch version, CPU kernel set,
accuracies) and prints the test accuracy reached.

Bit-identity with the shipped files holds for what it is: the same torch and the same CPU kernel set
(``torch.backends.cpu.get_cpu_capability()``) as recorded in the shipped provenance.json; on another kernel set
(AVX2 instead of AVX512, say) training rounds differently and the weights differ (the accuracy need not). The
script says which case it is in.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader

from disteval.data.datasets import _digits, _fashion_mnist
from disteval.models.reference_cnn import DigitsCNN, FashionCNN

SHIPPED = Path(__file__).resolve().parent.parent / "disteval" / "models" / "checkpoints"


def provenance() -> dict:
    """What decides the trained bits: torch's version and the CPU kernel set it dispatched to."""
    return {"torch": torch.__version__.split("+")[0], "cpu_capability": torch.backends.cpu.get_cpu_capability()}


def same_bits_expected() -> str:
    """One line: whether this machine should reproduce the shipped checkpoints bit for bit, and why."""
    try:
        shipped = json.loads((SHIPPED / "provenance.json").read_text())
    except (OSError, ValueError):
        return "the shipped checkpoints have no provenance.json: bit-identity not claimed"
    here = provenance()
    if all(shipped.get(k) == v for k, v in here.items()):
        return (f"bit-identical to the shipped checkpoints expected: torch {here['torch']}, {here['cpu_capability']} "
                "kernels, as they were trained")
    return (f"not bit-identical to the shipped checkpoints: trained here with torch {here['torch']} and "
            f"{here['cpu_capability']} kernels, they with torch {shipped.get('torch')} and {shipped.get('cpu_capability')} "
            "(other rounding; the accuracy may still match)")


def train(model: nn.Module, train_set, test_set, epochs: int, lr: float, batch_size: int, seed: int) -> float:
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    loader = DataLoader(train_set, batch_size=batch_size, shuffle=True, generator=gen)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=1e-4)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=epochs * len(loader))
    for epoch in range(epochs):
        model.train()
        for x, y in loader:
            opt.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
            sched.step()
        acc = evaluate(model, test_set)
        print(f"  epoch {epoch + 1}/{epochs}: test top-1 {acc:.4f}", flush=True)
    return acc


@torch.no_grad()
def evaluate(model: nn.Module, test_set) -> float:
    model.eval()
    correct = sum(int((model(x).argmax(1) == y).sum()) for x, y in DataLoader(test_set, batch_size=1000))
    return correct / len(test_set)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", choices=["digits", "fashion"])
    ap.add_argument("--fashion-root", default="/usr/share/datasets/fashion-mnist")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=Path("reference-cnns"),
                    help="where the state dicts go (default: ./reference-cnns; disteval/models/checkpoints replaces "
                         "the shipped ones)")
    args = ap.parse_args()
    torch.use_deterministic_algorithms(True)
    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    print(same_bits_expected())
    record = dict(provenance(), seed=args.seed)
    if args.only in (None, "digits"):
        torch.manual_seed(args.seed)
        model = DigitsCNN()
        print("digits_cnn on scikit-learn digits")
        acc = train(model, _digits("train"), _digits("test"), epochs=30, lr=3e-3, batch_size=32, seed=args.seed)
        torch.save(model.state_dict(), out / "digits_cnn.pt")
        print(f"digits_cnn: held-out top-1 {acc:.4f} -> {out / 'digits_cnn.pt'}")
        record["digits_cnn_top1"] = acc
    if args.only in (None, "fashion"):
        torch.manual_seed(args.seed)
        model = FashionCNN()
        print("fashion_cnn on Fashion-MNIST")
        tr = _fashion_mnist(args.fashion_root, "train")
        te = _fashion_mnist(args.fashion_root, "test")
        acc = train(model, tr, te, epochs=4, lr=3e-3, batch_size=128, seed=args.seed)
        torch.save(model.state_dict(), out / "fashion_cnn.pt")
        print(f"fashion_cnn: test top-1 {acc:.4f} -> {out / 'fashion_cnn.pt'}")
        record["fashion_cnn_top1"] = acc
    (out / "provenance.json").write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
