"""Issue 29 point 4: the ranks receive the validated, typed config (``disteval.config.JobConfig``), and no code
restates a schema default with ``node.get("key", default)`` or ``OmegaConf.select(cfg, "key", default=...)``."""
from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest

from disteval import config as schema
from disteval.config import Heterogeneous, JobConfig, ModelDtype, job_config
from disteval.errors import ConfigError

REPO = Path(__file__).resolve().parent.parent
# what reads a job's config: the package and its launchers (the HTML report and diagnostics read records, JSON of
# any version, where a missing key is a fact to report; the doctor's probe ranks are checked as ranks)
SOURCES = [*(p for p in (REPO / "disteval").rglob("*.py") if "htmlreport" not in p.parts),
           *(REPO / "launchers").rglob("*.py"), REPO / "diagnostics" / "probes.py"]
CONFIG_NAMES = {"cfg", "config", "job", "data", "model", "dist", "comm", "node", "options", "opt"}


def _schema_keys() -> set[str]:
    keys, todo = set(), [JobConfig]
    while todo:
        cls = todo.pop()
        for f in dataclasses.fields(cls):
            keys.add(f.name)
            nested = f.default_factory if f.default_factory is not dataclasses.MISSING else None
            if dataclasses.is_dataclass(nested):
                todo.append(nested)
    return keys


def _root(node: ast.AST) -> tuple[str | None, list[str]]:
    """The root name of an attribute chain and the attributes on the way (``self.cfg.data`` -> self, [cfg, data])."""
    attrs = []
    while isinstance(node, ast.Attribute):
        attrs.append(node.attr)
        node = node.value
    return (node.id if isinstance(node, ast.Name) else None), attrs


def _config_reads(path: Path, keys: set[str]) -> list[str]:
    """``X.get("key"...)`` on a config node (a chain rooted at a config-like name or through ``.cfg``) and
    ``OmegaConf.select(..., "a.key", default=...)`` with a schema key, as 'file:line: code'."""
    tree, found = ast.parse(path.read_text(), str(path)), []
    for call in (n for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)):
        args = [a.value for a in call.args if isinstance(a, ast.Constant) and isinstance(a.value, str)]
        if call.func.attr == "get" and args and args[0] in keys and call.args[0] is not None:
            root, attrs = _root(call.func.value)
            if root in CONFIG_NAMES or "cfg" in attrs or (root or "").endswith("_cfg"):
                found.append(f"{path.relative_to(REPO)}:{call.lineno}: {ast.unparse(call)}")
        if call.func.attr == "select" and _root(call.func.value)[0] == "OmegaConf" and len(args) >= 1 and \
                args[0].split(".")[-1] in keys and any(k.arg == "default" for k in call.keywords):
            found.append(f"{path.relative_to(REPO)}:{call.lineno}: {ast.unparse(call)}")
    return sorted(found, key=lambda hit: int(hit.split(":")[1]))


def test_no_code_restates_a_schema_default_with_get():
    keys = _schema_keys()
    assert {"num_classes", "nnodes", "save_predictions", "preflight_notes", "tp"} <= keys  # the walk reaches nodes
    found = [hit for path in SOURCES for hit in _config_reads(path, keys)]
    assert not found, "read the typed config's attribute instead (JobConfig holds every key with its default):\n" + \
        "\n".join(found)


def test_the_check_finds_what_it_forbids(tmp_path):
    """The grep is not vacuous: each forbidden form in a scratch file is found."""
    bad = tmp_path / "bad.py"
    bad.write_text('a = cfg.dist.get("nnodes") or 1\nb = self.cfg.eval.get("save_predictions")\n'
                   'c = data_cfg.get("root")\nd = OmegaConf.select(cfg, "eval.overwrite", default=False)\n'
                   'e = record.get("nnodes")\n')
    found = [line.split(": ", 1)[1] for line in _config_reads_anywhere(bad)]
    assert found == ["cfg.dist.get('nnodes')", "self.cfg.eval.get('save_predictions')", "data_cfg.get('root')",
                     "OmegaConf.select(cfg, 'eval.overwrite', default=False)"]


def _config_reads_anywhere(path: Path) -> list[str]:
    global REPO
    saved, REPO = REPO, path.parent
    try:
        return _config_reads(path, _schema_keys())
    finally:
        REPO = saved


def _composed(*overrides: str):
    from hydra import compose, initialize_config_dir

    schema.register_schemas()
    with initialize_config_dir(config_dir=schema.conf_dir(), version_base="1.3"):
        return compose("config", list(overrides))


@pytest.mark.parametrize("experiment", sorted(p.stem for p in (REPO / "conf" / "experiment").glob("*.yaml")))
def test_every_experiment_becomes_a_typed_job(experiment):
    """Each experiment's composed config, as the driver hands it to the ranks, is a JobConfig of dataclasses and
    enum members (not a DictConfig)."""
    from omegaconf import OmegaConf

    container = OmegaConf.to_container(_composed(f"+experiment={experiment}"), resolve=True, enum_to_str=True)
    container.update(experiment_name=experiment, communication_profile=None, preflight_notes=["a note"])
    job = job_config(container)
    assert type(job) is JobConfig and type(job.eval) is schema.EvalConfig and type(job.dist.parallel) is \
        schema.ParallelConfig
    assert isinstance(job.precision.model_dtype, ModelDtype) and isinstance(job.dist.heterogeneous, Heterogeneous)
    assert (job.experiment_name, job.preflight_notes) == (experiment, ["a note"])
    assert job_config(job) is job


def test_job_config_validates_naming_the_key():
    from omegaconf import OmegaConf

    container = OmegaConf.to_container(_composed("dist.world_size=4", "dist.parallel.tp=3"), resolve=True,
                                       enum_to_str=True)
    with pytest.raises(ConfigError, match=r"^dist.parallel: dp_replicate=1 x dp_shard=1 x tp=3"):
        job_config(container)


def test_driver_keys_cannot_be_set_on_the_command_line(tmp_path):
    """experiment_name, communication_profile and preflight_notes are the driver's findings: the Hydra schema
    (DistevalConfig) does not hold them, so an override is refused before any rank starts."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "disteval", "+preflight_notes=[x]", f"hydra.run.dir={tmp_path}/r"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out.stderr
    assert "preflight_notes" in out.stderr and not (tmp_path / "r" / "results.json").exists()
