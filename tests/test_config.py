"""Hydra composition: groups, experiments, schema errors naming the key, and conf/ from an installed wheel."""
import json
import subprocess
import sys
import zipfile

import pytest
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException
from omegaconf.errors import ConfigKeyError, ValidationError

from conftest import REPO
from disteval.config import conf_dir, register_schemas

register_schemas()


def _compose(*overrides):
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        return compose(config_name="config", overrides=list(overrides), return_hydra_config=True)


def test_default_job_is_digits_on_two_ranks():
    cfg = _compose()
    assert cfg.model.name == "digits_cnn" and cfg.data.name == "digits" and cfg.dist.world_size == 2
    assert cfg.hydra.job.name == "disteval"
    assert cfg.precision.count_dtype == "int64" and cfg.precision.tf32 is False


@pytest.mark.parametrize("name,model,data", [("fashion_mnist", "fashion_cnn", "fashion_mnist"),
                                             ("imagenet_vit", "vit_b_16", "imagefolder"),
                                             ("digits", "digits_cnn", "digits"),
                                             ("coco_semseg_replay", "replay", "semseg_replay"),
                                             ("voc_deeplabv3", "deeplabv3_resnet50", "voc")])
def test_experiments_compose(name, model, data):
    cfg = _compose(f"+experiment={name}")
    assert (cfg.model.name, cfg.data.name) == (model, data)


def test_unknown_key_fails_naming_it():
    with pytest.raises(ConfigCompositionException) as info:
        _compose("model.foo=1")
    assert "model.foo" in str(info.value.__cause__) or "model.foo" in str(info.value)


def test_wrong_type_fails_naming_key():
    with pytest.raises(ConfigCompositionException) as info:
        _compose("data.batch_size=abc")
    text = f"{info.value} {info.value.__cause__}"
    assert "data.batch_size" in text and isinstance(info.value.__cause__, (ValidationError, ConfigKeyError))


def test_enum_value_checked():
    with pytest.raises(ConfigCompositionException) as info:
        _compose("precision.model_dtype=fp8")
    assert "precision.model_dtype" in f"{info.value} {info.value.__cause__}"


def test_unknown_experiment_lists_available(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "disteval", "+experiment=nope", f"hydra.run.dir={tmp_path}"],
                          capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert proc.returncode == 2
    for name in ("digits", "fashion_mnist", "imagenet_vit"):
        assert name in proc.stderr


def test_conf_found_from_installed_wheel(tmp_path):
    """Build the wheel, install it into a target outside the checkout, compose and run from there."""
    wheels, target = tmp_path / "wheels", tmp_path / "target"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                    str(wheels), str(REPO)], check=True, timeout=300)
    wheel = next(wheels.glob("disteval-*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    assert "disteval/conf/config.yaml" in names and "disteval/conf/experiment/fashion_mnist.yaml" in names
    assert "disteval/models/checkpoints/digits_cnn.pt" in names
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(target), str(wheel)],
                   check=True, timeout=300)
    env = {"PYTHONPATH": str(target), "PATH": "/usr/bin:/bin"}
    code = "import disteval, disteval.config as c; print(disteval.__file__); print(c.conf_dir())"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, env=env,
                         check=True).stdout.split()
    assert out[0].startswith(str(target)) and out[1] == "pkg://disteval.conf"
    proc = subprocess.run([sys.executable, "-m", "disteval", "+experiment=fashion_mnist", "--cfg", "job"],
                          capture_output=True, text=True, cwd=tmp_path, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "name: fashion_cnn" in proc.stdout and "/usr/share/datasets/fashion-mnist" in proc.stdout
    run_dir = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "disteval", "dist.world_size=1", f"hydra.run.dir={run_dir}"],
                          capture_output=True, text=True, cwd=tmp_path, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr
    results = json.loads((run_dir / "results.json").read_text())
    assert results["model"]["name"] == "digits_cnn" and results["metrics"]["num_samples"] == 540


def test_checkout_uses_its_conf_folder():
    assert conf_dir() == str(REPO / "conf")


@pytest.mark.parametrize("override,key", [
    ("eval.trials=0", "eval.trials"), ("eval.trial_aggregate=mode", "eval.trial_aggregate"),
    ("eval.clip_sigma=0", "eval.clip_sigma"), ("eval.outlier_z=-1", "eval.outlier_z"),
    ("data.sampler=shuffled", "data.sampler"),
    ("eval.exclude_outlier_ranks=true,data.sampler=padded", "eval.exclude_outlier_ranks"),
    ("eval.exclude_outlier_ranks=true,eval.metrics=[ranking]", "eval.exclude_outlier_ranks"),
    ("dist.master_port=70000", "dist.master_port"), ("dist.master_port=65536", "dist.master_port"),
    ("dist.master_port=-1", "dist.master_port"), ("communication.timeout_s=1e300", "communication.timeout_s"),
    ("communication.sync_timeout_s=1e300", "communication.sync_timeout_s"),
    ("eval.status_interval_s=0", "eval.status_interval_s"), ("eval.status_interval_s=nan", "eval.status_interval_s")])
def test_robust_aggregation_settings_refused_before_ranks(override, key):
    from disteval.errors import ConfigError
    from disteval.job.preflight import preflight

    cfg = _compose(*override.split(",") if "[" not in override else override.split(",", 1))
    with pytest.raises(ConfigError) as info:
        preflight(cfg)  # the schema's checks, then the task's (outlier ranks need its per-rank metric)
    assert info.value.key == key


@pytest.mark.parametrize("port", [0, 1, 29500, 65535])
def test_master_port_range_accepts_every_tcp_port_and_zero(port):
    from disteval.job.preflight import validate_config

    validate_config(_compose(f"dist.master_port={port}"))  # 0 = a free port picked by the rendezvous


def test_master_port_out_of_range_exits_2_before_any_rank(tmp_path):
    """A port no socket can have is refused by the driver's config check, naming the key and value, before any
    rank starts (torch's rendezvous used to fail on it only after the launch began)."""
    run_dir = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "disteval", "dist.master_port=70000", f"hydra.run.dir={run_dir}"],
                          capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert "dist.master_port" in proc.stderr and "70000" in proc.stderr
    assert not (run_dir / "ranks").exists()
    error = json.loads((run_dir / "launch.json").read_text())["error"]
    assert error["key"] == "dist.master_port" and "70000" in error["message"]


def test_fault_drill_refused_before_ranks(monkeypatch):
    from disteval.errors import ConfigError
    from disteval.job.preflight import preflight

    monkeypatch.setenv("DISTEVAL_FAULTS", "kill@2:batch=1")  # no rank 2 at dist.world_size=2
    with pytest.raises(ConfigError, match=r"DISTEVAL_FAULTS: kill aims at rank\(s\) \[2\]"):
        preflight(_compose())


def test_every_package_ships_in_the_wheel():
    """pyproject.toml lists the packages explicitly (conf/ is mapped): a new package folder must be listed."""
    import tomllib

    listed = set(tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {".".join(p.parent.relative_to(REPO).parts) for top in ("disteval", "launchers", "diagnostics",
                                                                    "hydra_plugins")
             for p in (REPO / top).rglob("__init__.py")}
    assert found - listed == set(), f"packages missing from pyproject.toml: {sorted(found - listed)}"
