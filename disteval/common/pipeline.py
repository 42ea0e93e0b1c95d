"""The input pipeline stage by stage: a job's summary of its ranks' stage seconds (results.json ``pipeline``), the
console line, and whether the run was input-bound. Pure functions of results.json values (no torch), used by the
run's record, its console and HTML report, the sweep summary and the doctor.

A rank's record (``disteval.rank.loop.pipeline_record``) holds seconds: ``loop`` (the whole pass), ``wait_for_data``
(the loop blocked on the loader), ``forward`` (the model's step; CUDA events on a GPU), ``metric_update``, and
``host``: the loader's ``read``/``decode``/``transform`` seconds summed over its worker processes (worker-seconds),
``items`` and ``workers_active``, with ``num_workers``."""
from __future__ import annotations

from typing import Any

DECODERS = ("pil", "turbo")  # data.decode (disteval.data.pixels)
PIXEL_CACHE_MODES = ("none", "pixels", "rebuild")  # data.cache (disteval.data.pixel_cache)
HOST_STAGES = ("read", "decode", "transform", "collate")
LOOP_STAGES = ("wait_for_data", "forward", "metric_update")  # host_to_device too where recorded (CUDA)
INPUT_BOUND_WAIT = 0.25  # a rank that waited for data this share of its loop or more was input-bound


def _rate(images: float, seconds: float | None) -> float | None:
    return images / seconds if seconds and seconds > 0 else None


def summarize(records: list[dict | None], cpu_cores: int | None = None) -> dict | None:
    """The job's pipeline from its ranks' records (``None`` entries skipped; None when no rank has one).

    Rates are images/s of the job (the ranks' rates added: they run side by side): ``delivered`` (images over
    each rank's loop seconds), ``forward`` and ``metric_update`` (images over that stage's seconds: what the stage
    alone could take), and per host stage the loader's capacity (items per worker-second times the workers).
    ``wait_share``: the largest share of a rank's loop spent waiting for data; ``bound``: ``input`` when it is at
    least INPUT_BOUND_WAIT, else ``compute``; ``bound_stage``: the host stage with the most worker-seconds."""
    recs = [r for r in records if r and r.get("images") and r.get("loop")]
    if not recs:
        return None
    images = sum(int(r["images"]) for r in recs)
    out: dict[str, Any] = {"images": images, "ranks": len(recs),
                           "delivered_images_per_s": sum(r["images"] / r["loop"] for r in recs)}
    stages: dict[str, dict] = {}
    for name in (*LOOP_STAGES, "host_to_device"):
        secs = [r.get(name) for r in recs]
        if all(s is not None for s in secs):
            rates = [_rate(r["images"], s) for r, s in zip(recs, secs)]
            stages[name] = {"seconds": max(secs), "share_of_loop": max(s / r["loop"] for r, s in zip(recs, secs)),
                            # waiting is no stage that could take images: no rate for it
                            "images_per_s": sum(rates) if all(rates) and name != "wait_for_data" else None}
    hosts = [r.get("host") for r in recs]
    workers = sum(max(int(r.get("num_workers") or 0), 1) for r in recs)
    if all(h and h.get("items") for h in hosts):
        total = {s: sum(h.get(s) or 0.0 for h in hosts) for s in HOST_STAGES}
        items = sum(h["items"] for h in hosts)
        busy = sum(total.values())
        for s in HOST_STAGES:
            per_worker = _rate(items, total[s])
            stages[s] = {"worker_seconds": total[s], "share_of_worker_time": total[s] / busy if busy else None,
                         "images_per_s_per_worker": per_worker,
                         "images_per_s": per_worker * workers if per_worker else None}
        out["loader"] = {"workers": workers, "images_per_s_per_worker": _rate(items, busy),
                         "images_per_s": (_rate(items, busy) or 0) * workers or None}
        out["bound_stage"] = max(HOST_STAGES, key=lambda s: total[s])
    out["stages"] = stages
    wait = stages.get("wait_for_data", {}).get("share_of_loop")
    out["wait_share"] = wait
    out["bound"] = None if wait is None else ("input" if wait >= INPUT_BOUND_WAIT else "compute")
    out["num_workers"] = max(int(r.get("num_workers") or 0) for r in recs)
    if cpu_cores:
        out["cpu_cores"] = int(cpu_cores)
    return out


def remedies(summary: dict, data: Any) -> list[str]:
    """Overrides that fit an input-bound run, most effective first: the exact pixel cache (imagefolder data
    without one), more loader workers (up to the cores per rank), device decode. ``data``: the run's typed ``data``
    config (name, cache, num_workers, decode_on_device)."""
    if not summary or summary.get("bound") != "input":
        return []
    out = []
    files = data.name == "imagefolder" and str(data.cache) == "none" and not data.decode_on_device
    if files:
        out.append("data.cache=pixels")
    cores, ranks = summary.get("cpu_cores"), max(int(summary.get("ranks") or 1), 1)
    if cores and int(data.num_workers) < max(cores // ranks - 1, 1):
        out.append(f"data.num_workers={max(cores // ranks - 1, 1)}")
    if files:
        out.append("data.decode_on_device=true")
    return out


def _n(v: float | None) -> str:
    """images/s for a person: whole numbers from 100 up, three significant digits below (a CPU ViT's 0.358)."""
    if v is None:
        return "-"
    return f"{v:,.0f}" if v >= 100 else f"{v:.3g}"


def console_line(summary: dict | None) -> str | None:
    """One line: input- or compute-bound, the delivered rate against what the forward pass could take, and where
    the loader workers spent their time; None without a summary."""
    if not summary or summary.get("bound") is None:
        return None
    st = summary["stages"]
    fwd = st.get("forward", {}).get("images_per_s")
    where = ""
    if "loader" in summary:
        shares = {s: st[s]["share_of_worker_time"] for s in HOST_STAGES if st[s].get("share_of_worker_time") is not None}
        where = " (loader workers' time: " + ", ".join(f"{s} {v * 100:.0f} %" for s, v in
                                                       sorted(shares.items(), key=lambda kv: -kv[1])) + ")"
    if summary["bound"] == "input":
        return (f"input-bound: the loader delivered {_n(summary['delivered_images_per_s'])} images/s, the forward "
                f"pass could take {_n(fwd)}; the loop waited for data {summary['wait_share'] * 100:.0f} % of its "
                f"time{where}")
    return (f"compute-bound: {_n(summary['delivered_images_per_s'])} images/s, the forward pass "
            f"{st.get('forward', {}).get('share_of_loop', 0) * 100:.0f} % of the loop, waiting for data "
            f"{summary['wait_share'] * 100:.0f} %{where}")
