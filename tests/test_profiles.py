"""Hardware profiles: chosen from the table in conf/ by device name; explicit overrides win; recorded."""
import copy

import pytest
import yaml

from conftest import REPO, load_results
from disteval.comm.profiles import apply_profile, select_profile
from disteval.errors import ConfigError

TABLE = yaml.safe_load((REPO / "conf" / "communication" / "default.yaml").read_text())["profiles"]


@pytest.mark.parametrize("device,name", [("NVIDIA H200", "datacenter-gpu"), ("NVIDIA A100-SXM4-80GB", "datacenter-gpu"),
                                         ("NVIDIA GeForce RTX 4090", "other-gpu"), ("cpu", "cpu")])
def test_auto_picks_by_device_name(device, name):
    assert select_profile(TABLE, "auto", device)["name"] == name


def test_explicit_override_wins_and_is_recorded():
    container = {"communication": {"profile": "auto", "profiles": copy.deepcopy(TABLE), "timeout_s": 42.0,
                                   "compression": "none", "backend": "auto"}}
    record = apply_profile(container, {"communication.timeout_s"}, device="NVIDIA GeForce RTX 4090")
    assert container["communication"]["timeout_s"] == 42.0  # the user's value
    assert record == {"name": "other-gpu", "device": "NVIDIA GeForce RTX 4090", "applied": {"compression": "fp16"}}
    record = apply_profile(container, set(), device="NVIDIA GeForce RTX 4090")
    assert container["communication"]["timeout_s"] == 600.0 and record["applied"]["timeout_s"] == 600.0


def test_none_and_unknown():
    assert select_profile(TABLE, "none", "cpu") is None
    with pytest.raises(ConfigError, match="communication.profile"):
        select_profile(TABLE, "tpu-pod", "cpu")
    with pytest.raises(ConfigError, match="no profile .* matches"):
        select_profile([{"name": "x", "match": ["H100"]}], "auto", "cpu")


def test_profile_recorded_in_results(cli):
    proc, run_dir = cli("communication.profile=auto", "communication.timeout_s=120", "dist.world_size=1")
    assert proc.returncode == 0, proc.stderr
    prof = load_results(run_dir)["comm"]["profile"]
    assert prof["name"] == "cpu" and prof["device"] == "cpu" and "timeout_s" not in prof["applied"]
