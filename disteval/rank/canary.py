"""The canary: before the loop every rank forwards the same probe batch (the dataset's first
``dist.canary_samples`` samples) and the ranks exchange a 16-byte digest of the outputs in one small all_gather.
Equal digests: the fleet computes the same bits for this model and dtype. Different digests: the ranks form
numeric classes, and a float metric then depends on which samples landed on which class; the ranks exchange
their probe outputs once more and measure the drift (largest absolute and relative difference, arg-max flips).

``dist.heterogeneous`` decides what follows (``enforce``): ``warn`` records it (results.json ``canary``),
``refuse`` raises NumericDriftError before the loop, ``pin`` switches the CUDA settings that change bits
(TF32, matmul precision, deterministic algorithms, cuDNN benchmark) and checks again; the CPU kernel set is
pinned earlier, before the first kernel (``pin_cpu_kernels``), since torch cannot change it afterwards.
"""
from __future__ import annotations

import hashlib
import json
import time
from typing import Any, Callable

import torch
from torch.utils.data import default_collate

from disteval.common.fingerprint import fingerprint_digest
from disteval.common.kernels import lowest_common, native_capability, pin_capability
from disteval.common.fingerprint import rank_fingerprint
from disteval.config import heterogeneous_policy as policy
from disteval.errors import DataError, NumericDriftError
from disteval.rank.bootstrap import say
from disteval.rank.sync import in_collective

NO_PROBE = bytes(16)  # the digest slot of a rank that could not load the probe (a real digest is never all zero)
__all__ = ["Canary", "digest", "drift", "output_tensors", "pin_cpu_kernels", "pin_cuda", "probe_inputs"]


def probe_inputs(dataset: Any, collate: Callable | None, samples: int) -> Any:
    """The inputs of the probe batch: the dataset's items 0 .. samples-1 (fewer when it is smaller), collated
    as the loader collates them (``collate`` None: torch's default). Items are ``(input, target, sample_id)``."""
    items = [dataset[i] for i in range(min(samples, len(dataset)))]
    return (collate or default_collate)(items)[0]


def output_tensors(outputs: Any) -> list[torch.Tensor]:
    """The tensors of a forward's outputs in a fixed order (a tensor; lists and tuples in order; dicts by
    sorted key; Python numbers as 0-d tensors; None and strings dropped), detached, on the CPU, contiguous."""
    if isinstance(outputs, torch.Tensor):
        return [outputs.detach().cpu().contiguous()]
    if isinstance(outputs, dict):
        return [t for k in sorted(outputs, key=str) for t in output_tensors(outputs[k])]
    if isinstance(outputs, (list, tuple)):
        return [t for item in outputs for t in output_tensors(item)]
    if isinstance(outputs, (int, float, bool)):
        return [torch.tensor(outputs)]
    return []


def digest(tensors: list[torch.Tensor]) -> bytes:
    """16 bytes of BLAKE2b over every tensor's dtype, shape and raw bytes: equal exactly when the outputs are
    bit-identical."""
    h = hashlib.blake2b(digest_size=16)
    for t in tensors:
        h.update(f"{t.dtype}{tuple(t.shape)};".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.digest()


def drift(reference: list[torch.Tensor], other: list[torch.Tensor]) -> dict:
    """How ``other``'s probe outputs differ from ``reference``'s: ``max_abs_diff``, ``max_rel_diff`` (relative to
    |reference|, float64), ``argmax_flips`` (rows of the 2-D and higher float outputs whose arg-max over the last
    dimension differs: a changed top-1), ``order_changes`` (1-D float outputs, e.g. a detector's scores, whose
    descending order differs). ``comparable`` False (and no numbers) when the shapes differ."""
    if [t.shape for t in reference] != [t.shape for t in other]:
        return {"comparable": False, "shapes": [[list(t.shape) for t in reference], [list(t.shape) for t in other]]}
    max_abs = max_rel = 0.0
    flips = order = 0
    for a, b in zip(reference, other):
        if a.numel() == 0:
            continue
        a64, b64 = a.double(), b.double()
        diff = (a64 - b64).abs()
        max_abs = max(max_abs, float(diff.max()))
        max_rel = max(max_rel, float((diff / a64.abs().clamp_min(torch.finfo(torch.float64).tiny)).max()))
        if a.is_floating_point() and a.dim() >= 2:
            flips += int((a.argmax(-1) != b.argmax(-1)).sum())
        elif a.is_floating_point() and a.dim() == 1 and a.numel() > 1:
            order += int(not torch.equal(a.argsort(descending=True, stable=True),
                                         b.argsort(descending=True, stable=True)))
    return {"comparable": True, "max_abs_diff": max_abs, "max_rel_diff": max_rel, "argmax_flips": flips,
            "order_changes": order}


def pin_cpu_kernels(agree: Callable[[str, str], list[str]]) -> dict:
    """``dist.heterogeneous=pin`` on the CPU, first thing in a rank (before its first kernel): every rank's native
    kernel set (``agree(name, value)``: every rank's value, e.g. ``StoreBoard.agree``), then this process pinned
    to the lowest common one. Returns {capabilities: [per rank], pinned: the common set}. Raises DistevalError
    when a kernel already ran in this process."""
    capabilities = agree("cpu_capability", native_capability())
    common = lowest_common(capabilities)
    if len(set(capabilities)) > 1:
        pin_capability(common)
    return {"capabilities": capabilities, "pinned": common}


def pin_cuda() -> dict:
    """``dist.heterogeneous=pin`` on CUDA: the settings that make GPUs of different generations agree where they
    can (TF32 off for matmul and cuDNN, ``highest`` float32 matmul precision, deterministic algorithms, cuDNN
    benchmark off and deterministic). Returns what was set."""
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.backends.cudnn.benchmark = False
    torch.backends.cudnn.deterministic = True
    return {"tf32": False, "matmul_precision": "highest", "deterministic": True, "cudnn_benchmark": False}


class Canary:
    """One rank's canary. ``forward``: ``() -> outputs`` of the probe batch (run under inference mode);
    ``samples``: its size; ``comm``: the Communicator (None for a single process); ``identity``: ``() -> dict``
    of this rank's {fingerprint, host, node} as they are at the time of the check (pinning changes them)."""

    def __init__(self, forward: Callable[[], Any], samples: int, comm: Any, identity: Callable[[], dict]):
        self.forward, self.samples, self.comm, self.identity = forward, samples, comm, identity

    def check(self) -> dict:
        """Forward the probe, exchange the digests (one all_gather of 24 bytes per rank: the outputs' digest and
        the fingerprint's), and on a difference the outputs. Returns the record: samples, digest (this rank's),
        homogeneous, classes [{ranks, digest, hosts, fingerprint_digest, differs, drift}], seconds."""
        t0 = time.perf_counter()
        try:
            with torch.inference_mode():
                tensors = output_tensors(self.forward())
            mine = digest(tensors)
        except DataError as exc:  # a probe sample that cannot be loaded: the loop names it in its owner's shard
            tensors, mine, failed = [], NO_PROBE, str(exc)
        record: dict = {"samples": self.samples, "digest": mine.hex()}
        world = self.comm.world_size if self.comm is not None else 1
        rows = [mine]
        if world > 1:  # every rank exchanges, also one without a probe: no rank waits alone
            fp = bytes.fromhex(fingerprint_digest(self.identity()["fingerprint"]))
            row = torch.frombuffer(bytearray(mine + fp), dtype=torch.uint8).reshape(1, -1)
            rows = [bytes(t.reshape(-1).tolist()) for t in self.comm.all_gather_sized(row, [1] * world)]
        without = [r for r, b in enumerate(rows) if b[:16] == NO_PROBE]
        if without:
            return {"skipped": f"rank(s) {without} could not load the probe samples" +
                    (f" ({failed[:300]})" if mine == NO_PROBE else ""), "seconds": time.perf_counter() - t0}
        if world == 1:
            record.update(homogeneous=True, classes=[{"ranks": [0], "digest": mine.hex()}])
        else:
            groups: dict[bytes, list[int]] = {}
            for r, b in enumerate(rows):
                groups.setdefault(b[:16], []).append(r)
            classes = [{"ranks": ranks, "digest": d.hex(), "fingerprint_digest": rows[ranks[0]][16:].hex()}
                       for d, ranks in groups.items()]  # rank 0's class first: the reference
            record.update(homogeneous=len(classes) == 1, classes=classes)
            if len(classes) > 1:
                self._measure(tensors, classes)
        record["seconds"] = time.perf_counter() - t0
        return record

    def _measure(self, tensors: list[torch.Tensor], classes: list[dict]) -> None:
        """Exchange every rank's identity and probe outputs and add to each class its hosts, the fingerprint
        fields that differ from rank 0's class, and its drift from rank 0's outputs."""
        header = json.dumps({**self.identity(), "shapes": [list(t.shape) for t in tensors],
                             "dtypes": [str(t.dtype).removeprefix("torch.") for t in tensors]}, default=str)
        heads = [json.loads(bytes(h.tolist()).decode()) for h in
                 self.comm.all_gather_variable(torch.frombuffer(bytearray(header.encode()), dtype=torch.uint8))]
        flat = torch.cat([t.double().reshape(-1) for t in tensors]) if tensors else torch.zeros(0, dtype=torch.float64)
        values = self.comm.all_gather_variable(flat)
        outputs = [_unflatten(v, h["shapes"], h["dtypes"]) for v, h in zip(values, heads)]
        first = heads[classes[0]["ranks"][0]]["fingerprint"]
        for c in classes:
            r = c["ranks"][0]
            c["hosts"] = sorted({str(heads[q].get("host") or heads[q].get("node")) for q in c["ranks"]})
            fp = heads[r]["fingerprint"]
            c["fingerprint"] = {k: fp.get(k) for k in ("cpu_capability", "gpu", "tf32", "matmul_precision",
                                                       "deterministic", "dtype")}
            c["differs"] = {k: [first.get(k), fp.get(k)] for k in sorted(fp) if k not in ("allocator", "cpu_model")
                            and fp.get(k) != first.get(k)}
            if c is not classes[0]:
                c["drift"] = drift(outputs[classes[0]["ranks"][0]], outputs[r])


def _unflatten(values: torch.Tensor, shapes: list, dtypes: list) -> list[torch.Tensor]:
    out, at = [], 0
    for shape, dtype in zip(shapes, dtypes):
        n = int(torch.Size(shape).numel())
        out.append(values[at:at + n].reshape(shape).to(getattr(torch, dtype)))
        at += n
    return out


def describe(record: dict) -> str:
    """One line on a canary that found numeric classes: each class's ranks and nodes, what differs, the drift."""
    parts = []
    for c in record["classes"]:
        where = f"ranks {c['ranks']} on {', '.join(c.get('hosts') or ['?'])}"
        if c.get("differs"):
            where += " (" + "; ".join(f"{k} {a} vs {b}" for k, (a, b) in c["differs"].items()) + ")"
        elif c is not record["classes"][0]:
            where += " (same fingerprint: different weights, or a model that is not deterministic)"
        d = c.get("drift")
        if d and d.get("comparable"):
            where += (f": largest difference {d['max_abs_diff']:.3g} (relative {d['max_rel_diff']:.3g}), "
                      f"{d['argmax_flips']} arg-max flip(s)" + (f", {d['order_changes']} score order change(s)"
                                                               if d.get("order_changes") else ""))
        elif d:
            where += ": outputs of different shapes"
        parts.append(where)
    return (f"the ranks compute different bits on the canary's probe batch ({record['samples']} samples), "
            f"{len(record['classes'])} numeric classes: " + "; ".join(parts))


def settle(canary: Canary, policy: str, device: torch.device) -> dict:
    """Run ``canary`` and apply ``dist.heterogeneous`` (``policy``): a homogeneous fleet or ``warn`` returns the
    record (``policy`` added); ``refuse`` raises NumericDriftError; ``pin`` on CUDA pins (``pin_cuda``), checks
    again and returns the new record with ``before_pin``, or raises NumericDriftError when the ranks still differ
    (on the CPU the kernel set was pinned at start: a difference left is one pinning cannot remove). Every rank
    holds the same digests, so every rank takes the same decision."""
    record = canary.check()
    record["policy"] = policy
    if record.get("skipped") or record["homogeneous"] or policy == "warn":
        return record
    if policy == "refuse":
        raise NumericDriftError(describe(record) + "; dist.heterogeneous=refuse stops the run before the loop "
                                "(=pin runs every rank on the common kernels, =warn runs and records the drift)",
                                record)
    if device.type == "cuda":
        pinned = pin_cuda()
        again = canary.check()
        again.update(policy=policy, before_pin=record, pinned_cuda=pinned)
        if again["homogeneous"]:
            return again
        record = again
    raise NumericDriftError(describe(record) + "; dist.heterogeneous=pin could not make the ranks agree (the "
                            "difference is not one of the settings pinning controls)", record)


def run_canary(run: Any) -> dict:
    """The canary of a rank's run (``run``: its ``disteval.rank.engine.RankRun``) before the loop: the dataset's
    first ``dist.canary_samples`` samples (one whole batch under ``eval.compile``: the loop's shape) through the
    model on every rank, digests compared in one all_gather, ``dist.heterogeneous`` applied. Returns the record for results.json
    ``canary`` ({skipped: why} without a model, on streamed data, under a device mesh, or when off). Raises
    NumericDriftError (refuse, or pin that cannot make the ranks agree)."""
    ctx, cfg = run.ctx, run.ctx.cfg
    samples = int(cfg.data.batch_size) if cfg.eval.compile else int(cfg.dist.canary_samples)
    skip = ("dist.canary_samples=0" if samples == 0 else "no model (replayed predictions)" if run.model is None
            else "streamed data (no sample every rank can read)" if run.streamed
            else "a device mesh (its ranks compute one forward together)" if run.mesh else
            "an empty dataset" if len(run.dataset) == 0 else None)
    if skip:
        run.canary = {"skipped": skip}
        return run.canary
    step, collate = run._step(), run.task.collate_fn()
    canary = Canary(lambda: step(run.model, probe_inputs(run.dataset, collate, samples)),
                    min(samples, len(run.dataset)),
                    ctx.comm if ctx.world_size > 1 else None,
                    lambda: {"fingerprint": run.fingerprint, "host": ctx.status.record.get("host"),
                             "node": (ctx.net or {}).get("node")})
    try:
        with in_collective(ctx.status, "canary"):
            run.canary = settle(canary, policy(cfg), ctx.device)
    except NumericDriftError as exc:  # the doctor reads the classes from the record of the run that stopped
        ctx.status.update(canary=dict(exc.record, policy=policy(cfg)), force=True)
        raise
    if run.canary.get("pinned_cuda"):  # the CUDA settings changed: record them as now in force
        run.fingerprint = rank_fingerprint(ctx.device, str(cfg.precision.model_dtype), run.allocator.get("in_force"))
    if ctx.cpu_kernels:
        run.canary["cpu_kernels"] = ctx.cpu_kernels
    if not run.canary.get("homogeneous", True):
        say(ctx, f"warning: {describe(run.canary)} (dist.heterogeneous={run.canary['policy']})")
    return run.canary
