"""The launcher protocol (launchers/protocol.py): every registered launcher implements it; the rank side of it
is the environment of ``disteval.common.launch_env``, which the submitit launcher exports from SLURM's; and no
module outside launchers/ names a scheduler (the end-to-end paths: tests/test_slurm.py, tests/test_doctor.py)."""
from __future__ import annotations

import inspect
import re
import signal
from pathlib import Path

import pytest

from disteval.common import launch_env
from launchers.protocol import Launcher, ProbeRequest
from launchers.registry import LAUNCHERS, launcher_for, rank_launcher

REPO = Path(__file__).resolve().parent.parent
SCHEDULER_WORDS = re.compile(r"slurm|submitit", re.I)
# SLURM's variables in one task of a 2-node x 2-task job, as srun sets them (submitit reads them)
SLURM_TASK_ENV = {"SUBMITIT_EXECUTOR": "slurm", "SLURM_JOB_ID": "77", "SLURM_NODEID": "1", "SLURM_PROCID": "3",
                  "SLURM_LOCALID": "1", "SLURM_NTASKS": "4", "SLURM_JOB_NUM_NODES": "2", "SLURM_NNODES": "2",
                  "SLURM_JOB_NODELIST": "n[1-2]", "SLURM_STEP_NODELIST": "n[1-2]", "SLURM_NTASKS_PER_NODE": "2",
                  "SLURM_STEP_TASKS_PER_NODE": "2(x2)", "SLURM_TASKS_PER_NODE": "2(x2)"}


def scheduler_mentions(root: Path, folders: tuple[str, ...]) -> list[str]:
    """``path:line`` of every mention of SLURM or submitit (code, strings, comments) in the .py files of
    ``folders`` under ``root``."""
    found = []
    for folder in folders:
        for path in sorted((root / folder).rglob("*.py")):
            for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
                if SCHEDULER_WORDS.search(line):
                    found.append(f"{path.relative_to(root)}:{n}: {line.strip()[:100]}")
    return found


def test_no_module_outside_launchers_names_a_scheduler():
    """The entry point, the ranks (bootstrap, resume, engine), the job's records and the doctor speak to
    launchers through the protocol and the rank environment only: a scheduler's name anywhere in disteval/ or
    diagnostics/ fails (launchers/ and hydra_plugins/, the launchers' Hydra registration, are where they live)."""
    found = scheduler_mentions(REPO, ("disteval", "diagnostics"))
    assert not found, "name the launcher through launchers.protocol, not here:\n" + "\n".join(found)


def test_the_check_finds_a_planted_mention(tmp_path):
    (tmp_path / "disteval" / "rank").mkdir(parents=True)
    (tmp_path / "disteval" / "rank" / "x.py").write_text('import os\nJOB = os.environ.get("SLURM_JOB_ID")\n')
    assert scheduler_mentions(tmp_path, ("disteval",)) == ['disteval/rank/x.py:2: JOB = os.environ.get("SLURM_JOB_ID")']


@pytest.mark.parametrize("choice", sorted(LAUNCHERS))
def test_every_registered_launcher_implements_the_protocol(choice):
    launcher = launcher_for(choice)
    assert isinstance(launcher, Launcher) and not inspect.isabstract(type(launcher))
    assert launcher.name and choice in launcher.hydra_choices
    assert (REPO / "conf" / "hydra" / "launcher" / f"{choice}.yaml").is_file() or choice == "basic"
    nodes, per_node = launcher.world_shape(8, 4, None)
    assert (nodes, per_node) == (2, 4)
    # a launcher that hands a run over or requeues has a scheduler, and the doctor's --apply reruns through it
    if launcher.hands_over_run_mode or launcher.preempt_signal():
        assert launcher.schedules


def test_the_choice_picks_the_launcher():
    assert launcher_for(None).name == launcher_for("basic").name == launcher_for("joblib").name == "local"
    assert launcher_for("submitit_slurm").name == "submitit_slurm" and launcher_for("submitit_slurm").schedules
    assert rank_launcher("submitit_slurm", external=True).name == "external"
    assert not launcher_for("basic").schedules and launcher_for("basic").preempt_signal() is None
    with pytest.raises(NotImplementedError):
        launcher_for("basic").run_job(lambda: None)
    with pytest.raises(ValueError, match="not a multiple"):  # the scheduler's jobs fill whole nodes
        launcher_for("submitit_slurm").world_shape(6, 4, None)


def test_the_submitit_launcher_exports_the_rank_environment_from_slurm_s():
    """Inside a task (SLURM's variables as srun sets them), export_rank_env gives torch's env:// variables and
    the protocol's: the job id, the node index and submitit's checkpoint signal. The environment is restored
    whole afterwards (export_rank_env writes os.environ directly: a RANK left behind would make every later run
    of this test worker join a rendezvous that does not exist)."""
    import os

    saved = dict(os.environ)
    try:
        for key in [k for k in os.environ if k.startswith(("SLURM_", "DISTEVAL_", "SUBMITIT_"))] + [
                "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "GROUP_RANK"]:
            os.environ.pop(key, None)
        os.environ.update({**SLURM_TASK_ENV, "SUBMITIT_PREEMPT_SIGNAL": "USR1"})
        launcher_for("submitit_slurm").export_rank_env()
        assert (os.environ["RANK"], os.environ["WORLD_SIZE"], os.environ["LOCAL_RANK"]) == ("3", "4", "1")
        assert (launch_env.job_id(), launch_env.node_rank(), launch_env.preemption_requeues()) == ("77", 1, True)
        assert launch_env.preempt_signal() == signal.SIGUSR1
    finally:
        os.environ.clear()
        os.environ.update(saved)
    assert "RANK" not in os.environ or os.environ.get("RANK") == saved.get("RANK")


def test_the_rank_environment_without_a_scheduler(monkeypatch):
    for key in (launch_env.JOB_ID, launch_env.NODE_RANK, launch_env.PREEMPT_SIGNAL, "GROUP_RANK"):
        monkeypatch.delenv(key, raising=False)
    assert (launch_env.job_id(), launch_env.node_rank(), launch_env.preemption_requeues()) == (None, 0, False)
    assert launch_env.preempt_signal() == signal.SIGUSR2  # what the preempt drill sends outside a job
    monkeypatch.setenv("GROUP_RANK", "2")  # torchrun's node index
    assert launch_env.node_rank() == 2
    monkeypatch.setenv(launch_env.NODE_RANK, "x")
    with pytest.raises(ValueError, match="DISTEVAL_NODE_RANK='x'"):
        launch_env.node_rank()


def test_a_local_probe_runs_through_the_protocol(tmp_path):
    """The local launcher's run_probe starts real rank processes with the probe's entry."""
    launcher = launcher_for("basic")
    container = {"dist": {"master_addr": "127.0.0.1"}}
    launcher.run_probe(ProbeRequest(_write_rank, container, tmp_path, 3, 2))
    assert sorted(p.name for p in tmp_path.glob("rank*.txt")) == ["rank0.txt", "rank1.txt"]
    assert {p.read_text() for p in tmp_path.glob("rank*.txt")} == {"3 2"}


def _write_rank(container: dict, out_dir: str, payload: int) -> None:
    import os

    Path(out_dir, f"rank{os.environ['RANK']}.txt").write_text(f"{payload} {os.environ['WORLD_SIZE']}")


def test_the_launcher_that_wrote_a_job_record_reads_it(tmp_path):
    """job.json names its launcher; a record of an older version (no name) is the SLURM launcher's, the only
    one that wrote job.json then. Its scheduler view of a time limit proposes twice the run's limit."""
    from omegaconf import OmegaConf

    from launchers.registry import launcher_of_job

    assert launcher_of_job({"launcher": "submitit_local"}, None).name == "submitit_local"
    assert launcher_of_job({}, "basic").name == "submitit_slurm"
    assert launcher_of_job({}, "submitit_local").name == "submitit_local"
    hydra = OmegaConf.create({"hydra": {"launcher": {"timeout_min": 45}}})
    note = launcher_of_job({}, None).scheduler_view(tmp_path, {"job_id": "9", "state": "TIMEOUT"}, hydra)
    assert (note.kind, note.overrides) == ("time_limit", ("hydra.launcher.timeout_min=90",))
    assert launcher_of_job({}, None).scheduler_view(tmp_path, {"job_id": "9", "state": "FAILED"}, hydra) is None
