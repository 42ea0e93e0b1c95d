"""dist.allocator (disteval.common.allocator): resolve() for each policy, merged with the user's LD_PRELOAD and
GLIBC_TUNABLES; a library asked for but not installed (a search pointed at an empty folder) refused with
dist.allocator and the Debian package named; in_force() of real processes started with each environment;
the local launcher's ranks exec'd with the allocator while the launching process keeps its own and its
environment comes back unchanged; real ``python -m disteval`` runs recording what is in force in
results.json; an unknown value refused before any rank starts.

Needs Debian's libjemalloc2 and libtcmalloc-minimal4 (.ci/run installs them)."""
from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import load_results, run_disteval
from disteval.common import allocator
from disteval.common.allocator import GLIBC_TUNED, AllocatorChoice, find_library, resolve
from disteval.errors import ConfigError

QUICK = ("eval.progress=false", "data.batch_size=16")
TUNED = ":".join(f"{k}={v}" for k, v in GLIBC_TUNED.items())
# tests that start processes with the real libraries skip without them (CI installs both and fails on a skip)
needs_libraries = pytest.mark.skipif(
    not (find_library("tcmalloc") and find_library("jemalloc")),
    reason="tcmalloc or jemalloc not installed: apt-get install -y libtcmalloc-minimal4 libjemalloc2")


@pytest.fixture
def libs(tmp_path):
    """A folder holding (empty) files named like both libraries, and an empty one."""
    full, empty = tmp_path / "full", tmp_path / "empty"
    full.mkdir()
    empty.mkdir()
    (full / "libtcmalloc_minimal.so.4").write_bytes(b"")
    (full / "libjemalloc.so.2").write_bytes(b"")
    return full, empty


def test_each_policy_resolves_to_its_environment(libs):
    full, empty = libs
    d = [str(full)]
    assert resolve("system", {}, d) == AllocatorChoice("system", "system")
    tc = resolve("tcmalloc", {}, d)
    assert (tc.name, tc.library, tc.env) == ("tcmalloc", f"{full}/libtcmalloc_minimal.so.4",
                                             {"LD_PRELOAD": f"{full}/libtcmalloc_minimal.so.4"})
    je = resolve("jemalloc", {}, d)
    assert (je.name, je.env) == ("jemalloc", {"LD_PRELOAD": f"{full}/libjemalloc.so.2", "MALLOC_CONF": "dirty_decay_ms:-1"})
    assert resolve("auto", {}, d).name == "tcmalloc"  # preferred over jemalloc
    (full / "libtcmalloc_minimal.so.4").unlink()
    assert resolve("auto", {}, d).name == "jemalloc"
    tuned = resolve("glibc-tuned", {}, d)
    assert (tuned.name, tuned.library, tuned.env) == ("glibc-tuned", None, {"GLIBC_TUNABLES": TUNED})
    auto = resolve("auto", {}, [str(empty)])
    assert (auto.name, auto.env) == ("glibc-tuned", {"GLIBC_TUNABLES": TUNED})
    assert "libtcmalloc-minimal4" in auto.note and "libjemalloc2" in auto.note
    assert all(c.launch_env()[allocator.APPLIED_VAR] == c.name for c in (tc, je, tuned))
    assert resolve("system", {}, d).launch_env() == {allocator.APPLIED_VAR: "system"}


def test_user_variables_are_merged_not_clobbered(libs):
    full, _ = libs
    user = {"LD_PRELOAD": "/opt/x/libfoo.so /opt/x/libbar.so",
            "GLIBC_TUNABLES": "glibc.malloc.trim_threshold=5:glibc.cpu.hwcaps=-AVX", "MALLOC_CONF": "narenas:2"}
    je = resolve("jemalloc", user, [str(full)])
    assert je.env == {"LD_PRELOAD": f"{full}/libjemalloc.so.2:/opt/x/libfoo.so:/opt/x/libbar.so",
                      "MALLOC_CONF": "narenas:2,dirty_decay_ms:-1"}
    # the user's value of the same option wins: MALLOC_CONF stays as it is
    assert "MALLOC_CONF" not in resolve("jemalloc", {"MALLOC_CONF": "dirty_decay_ms:5000"}, [str(full)]).env
    tuned = resolve("glibc-tuned", user, [str(full)])  # the user's trim_threshold wins, their other keys stay
    assert tuned.env == {"GLIBC_TUNABLES": "glibc.malloc.trim_threshold=5:glibc.cpu.hwcaps=-AVX:"
                                           "glibc.malloc.mmap_threshold=33554432"}
    both = {"GLIBC_TUNABLES": TUNED}  # already what glibc-tuned sets: nothing to change, no process needed
    assert resolve("glibc-tuned", both, [str(full)]).env == {} and not resolve("glibc-tuned", both).changes_env
    mine = {"LD_PRELOAD": "/usr/local/lib/libjemalloc.so.2"}  # the user preloads an allocator themselves
    kept = resolve("auto", mine, [str(full)])
    assert (kept.name, kept.library, kept.env) == ("jemalloc", "/usr/local/lib/libjemalloc.so.2", {})
    with pytest.raises(ConfigError, match="already preloads jemalloc") as exc:
        resolve("tcmalloc", mine, [str(full)])
    assert exc.value.key == "dist.allocator"


@pytest.mark.parametrize("policy,package", [("tcmalloc", "libtcmalloc-minimal4"), ("jemalloc", "libjemalloc2")])
def test_requested_library_not_installed_names_the_key_and_the_package(libs, policy, package):
    _, empty = libs
    assert find_library(policy, [str(empty)]) is None
    with pytest.raises(ConfigError) as exc:
        resolve(policy, {}, [str(empty)])
    assert exc.value.key == "dist.allocator" and f"apt-get install {package}" in str(exc.value)


def test_unknown_policy_is_refused():
    with pytest.raises(ConfigError, match="dist.allocator: 'hoard' is not one of"):
        resolve("hoard", {})


@needs_libraries
def test_libraries_are_found_on_this_machine():
    """The Debian packages .ci/run installs, found in the standard folders (or the loader's cache)."""
    assert find_library("tcmalloc") and find_library("jemalloc")
    assert Path(find_library("jemalloc")).name.startswith("libjemalloc.so")


def test_applied_restores_the_environment_even_on_error(monkeypatch):
    monkeypatch.setenv("LD_PRELOAD", "/opt/x/libfoo.so")
    monkeypatch.delenv("GLIBC_TUNABLES", raising=False)
    monkeypatch.delenv(allocator.APPLIED_VAR, raising=False)
    choice = AllocatorChoice("glibc-tuned", "glibc-tuned", None, {"GLIBC_TUNABLES": TUNED, "LD_PRELOAD": "/a.so"})
    before = dict(os.environ)
    with pytest.raises(RuntimeError):
        with choice.applied():
            assert os.environ["GLIBC_TUNABLES"] == TUNED and os.environ["LD_PRELOAD"] == "/a.so"
            assert os.environ[allocator.APPLIED_VAR] == "glibc-tuned"
            raise RuntimeError("boom")
    assert dict(os.environ) == before


def _in_force_of_process(env_changes: dict, code: str = "") -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "GLIBC_TUNABLES", "MALLOC_CONF")}
    env.update(env_changes)
    out = subprocess.run([sys.executable, "-c", f"{code}import json; from disteval.common.allocator import in_force; "
                          "print(json.dumps(in_force()))"], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


@needs_libraries
@pytest.mark.parametrize("policy", ["system", "glibc-tuned", "tcmalloc", "jemalloc"])
def test_in_force_reports_what_a_process_was_started_with(policy):
    choice = resolve(policy, {})
    seen = _in_force_of_process(choice.env)
    assert seen["in_force"] == policy
    assert (seen["library"] and os.path.realpath(seen["library"])) == (choice.library and os.path.realpath(choice.library))
    assert seen["glibc_tunables"] == (TUNED if policy == "glibc-tuned" else None)
    assert seen["malloc_conf"] == ("dirty_decay_ms:-1" if policy == "jemalloc" else None)


def test_in_force_ignores_variables_set_after_the_start():
    """GLIBC_TUNABLES set inside a running process changes nothing, and in_force says so: it reads the
    environment the process was exec'd with."""
    code = f"import os; os.environ['GLIBC_TUNABLES'] = {TUNED!r}; "
    assert _in_force_of_process({}, code) == {"in_force": "system", "library": None, "glibc_tunables": None,
                                              "malloc_conf": None}


@needs_libraries
def test_local_ranks_run_with_the_allocator_and_the_launcher_keeps_its_own(tmp_path):
    """launchers.local.launch with jemalloc: both ranks report jemalloc mapped (their own /proc/self/maps), this
    process (the launching driver) has none mapped and its environment is as before."""
    from launchers.local import Placement, launch

    assert "jemalloc" not in allocator.mapped_allocators()
    before = dict(os.environ)
    out = launch(allocator.rank_record, ("jemalloc",), 2, str(tmp_path), Placement(allocator=resolve("jemalloc")))
    assert sorted(out) == [0, 1]
    for rec in out.values():
        assert (rec["requested"], rec["applied"], rec["in_force"]) == ("jemalloc", "jemalloc", "jemalloc")
        assert Path(rec["library"]).name == "libjemalloc.so.2"
    assert "jemalloc" not in allocator.mapped_allocators()
    ours = ("LD_PRELOAD", "GLIBC_TUNABLES", allocator.APPLIED_VAR)  # (elastic adds TORCHELASTIC_* of its own)
    assert {k: os.environ.get(k) for k in ours} == {k: before.get(k) for k in ours}


@needs_libraries
def test_run_with_jemalloc_records_it_on_every_rank(tmp_path):
    run = tmp_path / "run"
    proc = run_disteval(*QUICK, "dist.world_size=2", "dist.allocator=jemalloc", run_dir=run)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rec = load_results(run)["allocator"]
    assert (rec["requested"], rec["applied"], rec["in_force"], rec["ranks_agree"]) == \
        ("jemalloc", "jemalloc", "jemalloc", True)
    assert "per_rank" not in rec and rec["library"].endswith("libjemalloc.so.2")
    assert "jemalloc" not in allocator.mapped_allocators()


def test_submitit_jobs_export_the_allocator_to_their_ranks(tmp_path):
    """The submitit launchers (hydra/launcher=submitit_local here; submitit_slurm renders the same setup lines
    into its sbatch script): each job's tasks are exec'd with the allocator; a missing explicit library or an
    unknown value would refuse the job before submission."""
    run = tmp_path / "run"
    proc = run_disteval(*QUICK, "hydra/launcher=submitit_local", "hydra.launcher.timeout_min=5", "dist.world_size=2",
                        "dist.allocator=glibc-tuned", run_dir=run, env={"GLIBC_TUNABLES": "glibc.malloc.trim_threshold=7"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    rec = load_results(run)["allocator"]
    assert (rec["applied"], rec["in_force"], rec["ranks_agree"]) == ("glibc-tuned", "glibc-tuned", True)
    assert rec["glibc_tunables"] == "glibc.malloc.trim_threshold=7:glibc.malloc.mmap_threshold=33554432"
    # the rendezvous port: one the kernel found free when the job started (launchers.submitit.free_port_line),
    # not submitit's draw from the job id, which another program may hold
    ports = {json.loads(p.read_text())["rendezvous"]["master_port"] for p in run.glob("ranks/rank*/status.json")}
    (job_id,) = [p.name for p in (run / ".submitit").iterdir() if p.name.isdigit()]
    low, high = (int(x) for x in Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    assert len(ports) == 1 and low <= min(ports) <= high and ports != {random.Random(job_id).randint(20000, 60000)}


@needs_libraries
def test_world_size_1_starts_a_rank_process_only_when_the_allocator_needs_one(tmp_path):
    """W=1 with tcmalloc: one rank process (pid other than the driver's) with tcmalloc in force; W=1 with
    system, and with auto (no second process for the allocator alone): evaluated in the driver, recorded as
    system."""
    pids = {}
    for policy in ("tcmalloc", "system", "auto"):
        run = tmp_path / policy
        proc = run_disteval(*QUICK, "dist.world_size=1", f"dist.allocator={policy}", "data.limit=64", run_dir=run,
                            env={"LD_PRELOAD": "", "GLIBC_TUNABLES": ""})
        assert proc.returncode == 0, proc.stderr[-3000:]
        rec = load_results(run)["allocator"]
        assert (rec["requested"], rec["in_force"]) == (policy, "system" if policy == "auto" else policy)
        assert rec["applied"] == ("tcmalloc" if policy == "tcmalloc" else None)
        driver = json.loads((run / "launch.json").read_text())["pid"]
        rank = json.loads((run / "ranks" / "rank0" / "status.json").read_text())["pid"]
        pids[policy] = driver == rank
    assert pids == {"tcmalloc": False, "system": True, "auto": True}


def test_unknown_allocator_is_a_config_error_before_launch(tmp_path):
    run = tmp_path / "run"
    proc = run_disteval(*QUICK, "dist.allocator=hoard", run_dir=run)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "dist.allocator" in proc.stderr and "'hoard' is not one of" in proc.stderr
    assert not (run / "ranks").exists()
