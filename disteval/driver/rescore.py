"""``python -m disteval.rescore STORE [OVERRIDES...]``: the metrics of a prediction store, without the model.

STORE is a run directory written with ``eval.save_predictions=true eval.predictions.logits=true`` (or its
``predictions/`` folder). A detection store (boxes) re-scores through the COCO replay against the annotation file
it was written with (``data.annotations=...`` to name it where it moved; its sha256 must match). The store is
evaluated as a normal run of ``python -m disteval`` (ranks, shards,
synchronisation, results.json in its own run directory) with ``data=predictions`` and an identity model, batched
as the run that wrote it (``data.batch_size`` and ``eval.mode`` from the manifest, and by default its metric families
and top-k): in bitwise mode its metrics are the writer's bits at any world size. OVERRIDES are the job's
(``eval.metrics=[classification,ranking]``,
``dist.world_size=3``, ``hydra.run.dir=...``); overrides that name data (``+experiment=...``, ``data=...``,
``data.*``) state which data the predictions must be of: the store's manifest must match them (name, split,
preprocessing), else exit 2 naming the difference. Exit codes are ``python -m disteval``'s.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

from disteval.data.prediction_store import MANIFEST

DATA_PREFIXES = ("data.", "data=", "+experiment=", "experiment=")
LOADER = ("data.batch_size=", "data.num_workers=")  # how the store is read, not which data it is of
DETECTION = ("detection", "replay")  # tasks whose stores re-score through the COCO replay
RESCORED = ("classification", *DETECTION)


def _store_dir(arg: str) -> Path:
    path = Path(arg).resolve()
    return path / "predictions" if (path / "predictions" / MANIFEST).is_file() else path


def _requested_data(overrides: list[str], store_data: str | None):
    """The data config the data overrides compose to (Hydra, disteval's schema), starting from the store's own
    data group (``data=<name>``) unless the overrides choose one (``data=``, ``+experiment=``)."""
    from hydra import compose, initialize_config_dir

    from disteval.config import conf_dir, register_schemas

    register_schemas()
    chooses = any(o.startswith(("data=", "+experiment=", "experiment=")) for o in overrides)
    base = [f"data={store_data}"] if store_data and not chooses and (Path(conf_dir()) / "data" /
                                                                      f"{store_data}.yaml").is_file() else []
    with initialize_config_dir(config_dir=conf_dir(), version_base="1.3"):
        return compose(config_name="config", overrides=base + overrides).data


def check_early(store: Path, manifest: dict) -> None:
    """What the manifest alone tells, before any rank starts: a classification store without logits, a rank
    file that is not there. Raises DataError naming the file."""
    from disteval.errors import DataError

    if manifest["task"] not in DETECTION and not manifest["settings"].get("logits"):
        raise DataError(f"{store / MANIFEST}: the store holds top-{manifest['settings'].get('topk')} classes only; "
                        "re-scoring needs the logits (write it with eval.predictions.logits=true)")
    for entry in manifest["files"]:
        if not (store / entry["path"]).is_file():
            raise DataError(f"{store / entry['path']}: rank {entry['rank']}'s prediction file is missing")


def command(store: Path, manifest: dict, overrides: list[str]) -> list[str]:
    """The ``python -m disteval`` command line that re-scores ``store``: the store as data, the identity model,
    the writer's batch size and mode, then the job's non-data ``overrides``."""
    settings = manifest["settings"]
    rest = [o for o in overrides if not o.startswith(DATA_PREFIXES) or o.startswith(LOADER)]
    if manifest["task"] in DETECTION:  # the COCO replay of the stored boxes against the writer's annotation file
        data = [o for o in overrides if o.startswith("data.annotations=")] or [
            f"data.annotations={manifest['data']['annotations']}"]
        return [sys.executable, "-m", "disteval", "+experiment=coco_replay", *data, f"data.predictions={store}",
                f"data.batch_size={int(settings['batch_size'])}", f"eval.mode={settings['mode']}", *rest]
    same = [f"eval.metrics=[{','.join(settings['metrics'])}]",
            f"eval.classification.topk=[{','.join(map(str, settings['eval_topk']))}]"]
    same = [o for o in same if not any(r.startswith(o.split("=")[0] + "=") for r in rest)]  # the job's own win
    return [sys.executable, "-m", "disteval", "data=predictions", f"data.root={store}",
            f"data.batch_size={int(settings['batch_size'])}", f"data.split={manifest['data'].get('split')}",
            "model=replay", f"eval.mode={settings['mode']}", *same, *rest]


def main(argv: list[str] | None = None) -> int:
    from disteval.data.prediction_store import check_identity, read_manifest
    from disteval.errors import DataError, DistevalError

    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0 if argv else 2
    store, overrides = _store_dir(argv[0]), argv[1:]
    try:
        if not (store / MANIFEST).is_file() and (store / "checkpoints").is_dir():
            names = sorted(p.name for p in (store / "checkpoints").iterdir() if (p / "predictions" / MANIFEST).is_file())
            raise DataError(f"{store}: a job of several checkpoints keeps one store per checkpoint: re-score "
                            f"{store}/checkpoints/<name> ({', '.join(names) or 'none has a store'})")
        manifest = read_manifest(store)
        if manifest["task"] not in RESCORED:
            raise DataError(f"{store / MANIFEST}: a {manifest['task']} store ({', '.join(manifest.get('columns') or [])})"
                            " is read with pandas/polars/DuckDB; re-scoring takes classification logits and "
                            "detection boxes (segmentation runs re-score from their results files)")
        check_early(store, manifest)
        data_overrides = [o for o in overrides if o.startswith(DATA_PREFIXES)
                          and not o.startswith(("data.annotations=", *LOADER))]
        if data_overrides and manifest["task"] not in DETECTION:
            check_identity(manifest, _requested_data(data_overrides, manifest["data"].get("name")), store)
    except DistevalError as exc:
        print(f"disteval.rescore: {exc}", file=sys.stderr)
        return 2
    cmd = command(store, manifest, overrides)
    sys.stdout.flush()
    os.execv(cmd[0], cmd)
    return 0  # not reached


if __name__ == "__main__":
    sys.exit(main())
