"""Across real network links: the network lab (disteval.testing.netlab) and multi-node runs on it.

One lab per module (4 nodes n1..n4, a second network on eth1), real processes in real namespaces: the same
job at W = 4 as 1 node x 4 ranks over loopback, 2 x 2 and 4 x 1 across the lab's bridge, through disteval's own
multi-node launcher (c10d and static rendezvous) and an external ``torchrun --nnodes``; results.json
``metrics`` compared with ``==``. Also: node-local run directories (no shared filesystem), the loopback-
hostname refusal, the interface chosen by route with two interfaces, containment and the link controls.
Needs root and namespaces (CI has both; elsewhere the module skips with the reason)."""
from __future__ import annotations

import itertools
import os
import json
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import REPO, SHARED, load_results, rank_status, run_disteval, wait_for
from disteval.testing.netlab import NetLab

pytestmark = [pytest.mark.slow, pytest.mark.netlab]

REASON = NetLab.available()
if REASON:
    pytest.skip(REASON, allow_module_level=True)

COCO = SHARED / "data" / "coco" / "fce_cocoapi"
GT = COCO / "instances_val2014_100.json"
DT = {"bbox": COCO / "instances_val2014_fakebbox100_results.json",
      "segm": COCO / "instances_val2014_fakesegm100_results.json"}
_ports = itertools.count(29411)


@pytest.fixture(scope="module")
def lab():
    with NetLab(nodes=4, name="tlab", second_net=True) as lab:
        yield lab


def _disteval(*overrides: str) -> list[str]:
    return [sys.executable, "-m", "disteval", *overrides]


def _torchrun(nnodes: int, per_node: int, endpoint: str, *overrides: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", f"--nnodes={nnodes}", f"--nproc-per-node={per_node}",
            "--rdzv-backend=c10d", f"--rdzv-endpoint={endpoint}", "--rdzv-id=lab", "-m", "disteval", *overrides]


def on_nodes(lab: NetLab, commands: dict[str, list[str]], timeout: float = 240) -> dict[str, subprocess.CompletedProcess]:
    """Run one command per node at once (as a person types the same command on each machine); wait for all."""
    procs = {n: lab.popen(n, cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for n, cmd in commands.items()}
    out = {}
    deadline = time.monotonic() + timeout
    for n, p in procs.items():
        try:
            stdout, stderr = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            for q in procs.values():
                q.kill()
            raise
        out[n] = subprocess.CompletedProcess(p.args, p.returncode, stdout, stderr)
    return out


def multi_node(lab: NetLab, nodes: list[str], run_dir: Path | str, *overrides: str, torchrun: bool = False,
               static: bool = False, extra: dict[str, list[str]] | None = None, world_size: int = 4) -> dict:
    """The job at W = ``world_size`` over ``nodes`` (W / len(nodes) ranks each), rendezvous on the first node;
    returns {node: process}."""
    endpoint = f"{lab.node(nodes[0]).addr}:{next(_ports)}"
    per_node = world_size // len(nodes)
    common = [f"hydra.run.dir={run_dir}", "communication.timeout_s=60", *overrides]
    commands = {}
    for k, n in enumerate(nodes):
        if torchrun:
            commands[n] = _torchrun(len(nodes), per_node, endpoint, *common)
        else:
            commands[n] = _disteval(f"dist.world_size={world_size}", f"dist.nnodes={len(nodes)}",
                                    f"dist.rdzv_endpoint={endpoint}",
                                    *([f"dist.node_rank={k}"] if static else []), *common, *(extra or {}).get(n, []))
    shared = Path(run_dir).is_relative_to(lab.shared)  # else each node's own disk (its private /tmp)
    fresh = shared and not Path(run_dir).exists()
    procs = on_nodes(lab, commands)
    failed = [f"{n}: exit {p.returncode}\n{p.stdout[-2000:]}\n{p.stderr[-4000:]}" for n, p in procs.items() if p.returncode]
    assert not failed, "\n".join(failed)
    if shared and not torchrun:  # each node's driver keeps its own Hydra records; the leader moved nothing of theirs aside
        for n in nodes[1:]:
            assert (Path(run_dir) / "nodes" / n / ".hydra" / "config.yaml").is_file(), n
            assert (Path(run_dir) / "nodes" / n / "disteval.log").stat().st_size > 0, n
        assert not fresh or not (Path(run_dir) / "previous").exists(), sorted((Path(run_dir) / "previous").rglob("*"))
    return procs


def rank_comm(run_dir: Path) -> dict[int, dict]:
    """Each rank's collectives, and bytes of the metric-state all_reduce, as its comm layer counted them
    (status.json ``comm``). The all_gather of the rows and the run-directory broadcast carry JSON with timings
    and start times, whose text length differs from run to run: their byte counts are not compared."""
    out = {}
    for r in range(4):
        status = json.loads((run_dir / "ranks" / f"rank{r}" / "status.json").read_text())
        out[r] = {"by_op": status["comm"]["by_op"], "all_reduce": status["comm"]["bytes_by_op"]["all_reduce"]}
    return out


@pytest.fixture(scope="module")
def reference(lab, tmp_path_factory):
    """The digits job at W = 1 in one process (the number every layout must give), and at W = 4 as 1 node x 4
    ranks over loopback (torchrun on n1, rendezvous on 127.0.0.1)."""
    one = tmp_path_factory.mktemp("ref") / "w1"
    proc = run_disteval("dist.world_size=1", run_dir=one)
    assert proc.returncode == 0, proc.stderr[-3000:]
    loop = lab.shared / "L1x4"
    procs = on_nodes(lab, {"n1": _torchrun(1, 4, f"127.0.0.1:{next(_ports)}", f"hydra.run.dir={loop}")})
    assert procs["n1"].returncode == 0, procs["n1"].stderr[-3000:]
    return load_results(one), load_results(loop), loop


@pytest.mark.parametrize("layout", ["2x2", "4x1", "2x2-torchrun", "4x1-static"])
def test_digits_bit_identical_across_node_layouts(lab, reference, layout):
    """W = 4 as 2 nodes x 2 ranks or 4 x 1, across the lab: metrics == the single process's and the 1 x 4
    loopback run's; every rank's collectives and wire bytes (counted by the comm layer) equal the loopback
    run's rank for rank (the sync plan does not depend on the layout); the ranks sit on the nodes asked for."""
    w1, loop, loop_dir = reference
    assert loop["metrics"] == w1["metrics"]
    nodes = ["n1", "n2"] if layout.startswith("2x2") else ["n1", "n2", "n3", "n4"]
    run_dir = lab.shared / {"2x2": "L2x2", "4x1": "L4x1", "2x2-torchrun": "T2x2", "4x1-static": "S4x1"}[layout]
    multi_node(lab, nodes, run_dir, torchrun=layout.endswith("torchrun"), static=layout.endswith("static"))
    res = load_results(run_dir)
    assert res["metrics"] == w1["metrics"]
    assert res["world_size"] == 4 and res["filesystem"] == "shared"
    hosts = [p["host"] for p in res["per_rank"]]
    assert sorted(hosts) == sorted(n for n in nodes for _ in range(4 // len(nodes)))
    for p in res["per_rank"]:
        i = int(p["host"][1:])
        assert (p["interface"], p["address"], p["ifname_source"]) == ("eth0", f"198.18.0.{i}", "route")
    if layout.endswith("static"):  # torchrun's --node-rank semantics: node k holds ranks k..
        assert hosts == ["n1", "n2", "n3", "n4"]
    # the run directories' names have the same length, so rank 0's broadcast of it has the same size
    assert len(run_dir.name) == len(loop_dir.name)
    assert rank_comm(run_dir) == rank_comm(loop_dir)
    # the same kernels on every node: one numeric class, no warning (different nodes are no false alarm)
    assert [c["ranks"] for c in res["numeric_classes"]] == [[0, 1, 2, 3]] and not res["warnings"]


@pytest.mark.skipif(not any(Path("/usr/share/datasets/fashion-mnist").glob("t10k-*")),
                    reason="Fashion-MNIST not found (apt-get install dataset-fashion-mnist)")
def test_nodes_with_different_kernels_warn_refuse_pin(lab, tmp_path):
    """n2 runs with ATEN_CPU_CAPABILITY=default (torch's unvectorised kernels), n1 with what its CPU offers, on
    Fashion-MNIST at W=4 (2 x 2). Through disteval's multi-node launcher, warn: per_rank fingerprints,
    numeric_classes [[0, 1], [2, 3]] differing in cpu_capability, the canary's classes by node (n1, n2) with their
    drift and a warning; refuse: both nodes exit 1 before the loop with an error naming n2 and the setting.
    Through torchrun, pin: every rank on DEFAULT, the canary agrees, metrics == one process on DEFAULT."""
    import torch

    here = torch.backends.cpu.get_cpu_capability()
    if here == "DEFAULT":
        pytest.skip("this CPU offers no vectorised kernel set beyond DEFAULT")
    job = ("+experiment=fashion_mnist", "communication.timeout_s=60")
    envs = {"n1": dict(os.environ), "n2": dict(os.environ, ATEN_CPU_CAPABILITY="default")}

    def both(cmds: dict) -> dict:
        procs = {n: lab.popen(n, cmd, cwd=REPO, env=envs[n], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for n, cmd in cmds.items()}
        return {n: p.communicate(timeout=240) + (p.returncode,) for n, p in procs.items()}

    def launcher(name: str, *extra: str) -> dict:
        cmd = _disteval("dist.world_size=4", "dist.nnodes=2", f"dist.rdzv_endpoint=198.18.0.1:{next(_ports)}",
                        f"hydra.run.dir={lab.shared / name}", *job, *extra)
        return both({"n1": cmd, "n2": cmd})

    outs = launcher("hetero")
    assert all(o[2] == 0 for o in outs.values()), outs["n1"][1][-3000:] + outs["n2"][1][-3000:]
    res = load_results(lab.shared / "hetero")
    caps = {p["rank"]: p["fingerprint"]["cpu_capability"] for p in res["per_rank"]}
    assert caps == {0: here, 1: here, 2: "DEFAULT", 3: "DEFAULT"}, caps
    classes = res["numeric_classes"]
    assert [c["ranks"] for c in classes] == [[0, 1], [2, 3]] and classes[1]["differs"] == ["cpu_capability"]
    canary = res["canary"]
    assert [(c["ranks"], c["hosts"]) for c in canary["classes"]] == [([0, 1], ["n1"]), ([2, 3], ["n2"])]
    assert canary["classes"][1]["differs"] == {"cpu_capability": [here, "DEFAULT"]}
    assert canary["classes"][1]["drift"]["max_abs_diff"] > 0
    assert any("the metrics depend on the placement of samples" in w for w in res["warnings"]), res["warnings"]
    assert "ranks [2, 3] on n2 (cpu_capability" in " ".join(outs["n1"][0].split() + outs["n1"][1].split())

    outs = launcher("hetero_refuse", "dist.heterogeneous=refuse")
    assert [o[2] for o in outs.values()] == [1, 1] and not (lab.shared / "hetero_refuse" / "results.json").exists()
    assert "NumericDriftError" in outs["n1"][1] and "ranks [2, 3] on n2" in " ".join(outs["n1"][1].split())

    pinned_dir = lab.shared / "hetero_pin"
    cmd = _torchrun(2, 2, f"198.18.0.1:{next(_ports)}", f"hydra.run.dir={pinned_dir}", "dist.heterogeneous=pin", *job)
    outs = both({"n1": cmd, "n2": cmd})
    assert all(o[2] == 0 for o in outs.values()), outs["n1"][1][-3000:] + outs["n2"][1][-3000:]
    pinned = load_results(pinned_dir)
    assert pinned["canary"]["homogeneous"] and pinned["canary"]["cpu_kernels"]["pinned"] == "DEFAULT"
    assert {p["fingerprint"]["cpu_capability"] for p in pinned["per_rank"]} == {"DEFAULT"}
    ref = run_disteval("+experiment=fashion_mnist", "dist.world_size=1", run_dir=tmp_path / "ref",
                       env={"ATEN_CPU_CAPABILITY": "default"})
    assert ref.returncode == 0, ref.stderr[-3000:]
    assert pinned["metrics"] == load_results(tmp_path / "ref")["metrics"]


@pytest.mark.parametrize("iou_type", ["bbox", "segm"])
def test_coco_replay_bit_identical_across_node_layouts(lab, tmp_path, iou_type):
    """The COCO replay (rank 0 parses the results file and broadcasts it) at W = 4: 2 x 2 and 4 x 1 on the lab
    through disteval's launcher and 2 x 2 through torchrun == 1 x 4 on loopback == one process, bbox and segm;
    collectives and all_reduce bytes per rank equal across layouts."""
    if not GT.exists():
        pytest.skip(f"COCO reference files not found under {COCO} (../shared/data)")
    job = ["+experiment=coco_replay", f"data.annotations={GT}", f"data.predictions={DT[iou_type]}",
           f"eval.detection.iou_type={iou_type}"]
    proc = run_disteval(*job, "dist.world_size=1", run_dir=tmp_path / "w1")
    assert proc.returncode == 0, proc.stderr[-3000:]
    want = load_results(tmp_path / "w1")["metrics"]
    loop = lab.shared / f"C{iou_type}1x4"
    procs = on_nodes(lab, {"n1": _torchrun(1, 4, f"127.0.0.1:{next(_ports)}", f"hydra.run.dir={loop}", *job)})
    assert procs["n1"].returncode == 0, procs["n1"].stderr[-3000:]
    assert load_results(loop)["metrics"] == want
    for nodes, name in ((["n1", "n2"], "2x2"), (["n1", "n2", "n3", "n4"], "4x1"), (["n1", "n2"], "2x2t")):
        run_dir = lab.shared / f"C{iou_type}{name}"
        multi_node(lab, nodes, run_dir, *job, torchrun=name.endswith("t"))
        assert load_results(run_dir)["metrics"] == want, name
        assert rank_comm(run_dir) == rank_comm(loop), name


def test_node_local_run_directories(lab):
    """No shared filesystem: hydra.run.dir under each node's private /tmp. Rank 0's results.json (on n1) holds
    every rank's row with its host; n2 keeps its own ranks' records; n1 holds relayed copies of n2's records
    (read from the rendezvous store); the doctor, given n1's run directory alone, finds the run finished."""
    multi_node(lab, ["n1", "n2"], "/tmp/nl_run")
    n1, n2 = lab.node("n1").tmp / "nl_run", lab.node("n2").tmp / "nl_run"
    res = load_results(n1)
    assert res["filesystem"] == "node-local"
    assert [p["host"] for p in res["per_rank"]] == ["n1", "n1", "n2", "n2"]
    assert sum(p["samples"] for p in res["per_rank"]) == res["dataset"]["num_samples"] == 540
    assert not (n2 / "results.json").exists()
    for r in (2, 3):
        own = json.loads((n2 / "ranks" / f"rank{r}" / "status.json").read_text())
        assert own["phase"] == "done" and own["host"] == "n2" and not own.get("relayed")
        copy = json.loads((n1 / "ranks" / f"rank{r}" / "status.json").read_text())
        assert copy["relayed"] is True and copy["host"] == "n2" and copy["pid"] == own["pid"]
        assert not (n1 / "ranks" / f"rank{r}" / "log.txt").exists()  # logs stay on their node
    doctor = subprocess.run([sys.executable, "-m", "diagnostics", "doctor", str(n1)], cwd=REPO, capture_output=True,
                            text=True, timeout=120)
    assert doctor.returncode == 0, doctor.stdout[-3000:] + doctor.stderr[-2000:]
    said = " ".join(doctor.stdout.split())
    assert "not seen from here: ranks 2, 3 on node n2: status as relayed through the rendezvous store" in said, said


def test_loopback_hostname_refused_before_the_rendezvous(lab):
    """A node whose hostname resolves to 127.0.1.1 (Debian's default) is stopped before its agent joins, with
    an error naming the node, the hostname, the loopback address and the settings that fix it; with
    dist.local_addr the same node passes that check."""
    hosts = lab.node("n4").root / "hosts"
    original = hosts.read_text()
    hosts.write_text(original.replace("198.18.0.4 n4\n", "") + "127.0.1.1 n4\n")  # same inode: the node sees it
    try:
        endpoint = f"198.18.0.1:{next(_ports)}"
        job = ["dist.world_size=4", "dist.nnodes=2", f"dist.rdzv_endpoint={endpoint}",
               f"hydra.run.dir={lab.shared / 'refused'}"]
        t0 = time.monotonic()
        proc = lab.run("n4", _disteval(*job), cwd=REPO, timeout=120)
        assert time.monotonic() - t0 < 60
        assert proc.returncode == 2, proc.stderr[-3000:]
        err = " ".join(proc.stderr.split())
        for part in ("dist.local_addr", "node n4", "'n4' resolves to 127.0.1.1", "dist.local_addr=198.18.0.4",
                     "eth0", "/etc/hosts"):
            assert part in err, (part, err)
        checked = lab.run("n4", _disteval(*job, "dist.local_addr=198.18.0.4", "--cfg", "job"), cwd=REPO, timeout=120)
        assert checked.returncode == 0 and "local_addr: 198.18.0.4" in checked.stdout
        from disteval.common import netif  # the check itself, in the node, with the address given

        probe = lab.run("n4", [sys.executable, "-c", "from disteval.common import netif; "
                               "print(netif.loopback_hostname_error('198.18.0.1', '198.18.0.4'))"], cwd=REPO)
        assert probe.stdout.strip() == "None", probe.stderr
        assert netif.loopback_hostname_error("198.18.0.1", "198.18.0.4") is None
    finally:
        hosts.write_text(original)


def test_interface_chosen_by_route_with_two_interfaces(lab, reference):
    """Every node has eth0 (198.18.0.x, what the hostnames resolve to) and eth1 (198.18.1.x). With eth0
    between n1 and n2 cut (blackhole routes) and the rendezvous on n1's eth1 address, the ranks must bind eth1:
    derived from the route (gloo would otherwise take the hostname's address on eth0 and hang). Recorded per
    rank; metrics == the single process's."""
    w1 = reference[0]
    lab.partition("n1", "n2", how="blackhole")
    try:
        endpoint = f"198.18.1.1:{next(_ports)}"
        run_dir = lab.shared / "twoif"
        commands = {n: _disteval("dist.world_size=4", "dist.nnodes=2", f"dist.rdzv_endpoint={endpoint}",
                                 f"dist.local_addr=198.18.1.{i}", f"hydra.run.dir={run_dir}", "communication.timeout_s=60")
                    for i, n in ((1, "n1"), (2, "n2"))}
        procs = on_nodes(lab, commands)
        for n, p in procs.items():
            assert p.returncode == 0, f"{n}: {p.stderr[-3000:]}"
        res = load_results(run_dir)
        assert res["metrics"] == w1["metrics"]
        for p in res["per_rank"]:
            assert p["interface"] == "eth1" and p["address"] == f"198.18.1.{p['host'][1:]}", p
    finally:
        lab.heal("n1")


# ---- the lab itself -------------------------------------------------------------------------------------------
SERVE = ("import socket,sys; s=socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); "
         "s.bind(('0.0.0.0', int(sys.argv[1]))); s.listen(); c,_=s.accept(); n=0\n"
         "while True:\n b=c.recv(1<<16)\n if not b: break\n n+=len(b)\nprint(n)")
SEND = ("import socket,sys,time; s=socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=float(sys.argv[4])); "
        "t=time.perf_counter(); s.sendall(b'x'*int(sys.argv[3])); s.shutdown(socket.SHUT_WR); s.recv(1); "
        "print(time.perf_counter()-t)")


def _transfer(lab, src: str, dst: str, nbytes: int, timeout: float = 10.0) -> tuple[float | None, str]:
    port = str(next(_ports))
    server = lab.popen(dst, [sys.executable, "-c", SERVE, port], stdout=subprocess.PIPE, text=True)
    time.sleep(0.3)
    client = lab.run(src, [sys.executable, "-c", SEND, lab.node(dst).addr, port, str(nbytes), str(timeout)],
                     timeout=timeout + 20)
    server.kill()
    server.wait()
    if client.returncode != 0:
        return None, client.stderr.strip().splitlines()[-1] if client.stderr.strip() else ""
    return float(client.stdout.strip()), ""


def test_containment(lab):
    """The machine's namespace has no lab address and blackholes the lab range; nodes have no default route,
    so a packet for the outside cannot even be sent (ENETUNREACH at once); the bridge namespace has no address."""
    lab.check_containment()
    outside = lab.run("n1", [sys.executable, "-c", "import socket; socket.create_connection(('192.0.2.1', 80), 2)"])
    assert outside.returncode != 0 and "Network is unreachable" in outside.stderr
    here = subprocess.run(["ip", "route", "get", "198.18.0.1"], capture_output=True, text=True)
    assert here.returncode != 0 or "blackhole" in here.stdout
    names = lab.run("n2", ["sh", "-c", "hostname; cat /proc/sys/net/ipv6/conf/all/disable_ipv6; stat -c %i /tmp"])
    assert names.stdout.split()[:2] == ["n2", "1"]
    assert int(names.stdout.split()[2]) == lab.node("n2").tmp.stat().st_ino  # its own /tmp


def test_rate_limit_partition_freeze_kill(lab):
    """tbf shaping slows a 2 MB transfer to about the set rate; a prohibit route refuses at once, a blackhole
    drops silently (timeout), heal restores; freeze stops every process of a node (state T), kill ends them."""
    fast, err = _transfer(lab, "n3", "n4", 2_000_000)
    assert fast is not None, err
    lab.rate("n3", 10)  # 10 Mbit/s: 2 MB takes about 1.6 s
    try:
        slow, err = _transfer(lab, "n3", "n4", 2_000_000)
    finally:
        lab.unrate("n3")
    assert slow is not None, err
    assert 1.2 < slow < 4.0 and slow > 5 * fast, (slow, fast)
    lab.partition("n3", "n4", how="prohibit")
    t0 = time.monotonic()
    failed, err = _transfer(lab, "n3", "n4", 1000, timeout=3)
    assert failed is None and time.monotonic() - t0 < 5 and ("Permission denied" in err or "unreachable" in err), err
    lab.heal("n3")
    lab.partition("n3", "n4", how="blackhole")
    failed, err = _transfer(lab, "n3", "n4", 1000, timeout=2)
    assert failed is None and "timed out" in err, err
    lab.heal("n3")
    assert _transfer(lab, "n3", "n4", 1000)[0] is not None
    sleeper = lab.popen("n4", ["sleep", "60"])
    time.sleep(0.2)
    assert sleeper.pid in lab.pids("n4") or any(_cmdline(p).startswith(b"sleep") for p in lab.pids("n4"))
    frozen = lab.freeze("n4")
    states = {Path(f"/proc/{p}/stat").read_text().split()[2] for p in frozen}
    assert states == {"T"}, states
    lab.thaw("n4")
    lab.kill("n4")
    assert sleeper.wait(timeout=10) == -9 or lab.pids("n4") == []
    assert lab.pids("n4") == []


@pytest.mark.parametrize("where", ["shared", "node-local"])
@pytest.mark.parametrize("fault", ["error@3:batch=2", "kill@3:batch=2"])
def test_failure_on_another_node_is_named(lab, where, fault):
    """Rank 3 (on n2) raises, or is SIGKILLed, after its 2nd batch. Every node's driver exits 1 within about
    one timeout; n1's (rank 0's) names rank 3 as the culprit, with its own error where it had one, from the
    shared run directory or, when the run directories are node-local, from what rank 3 published in the
    rendezvous store (relayed into n1's directory); no results.json anywhere; the doctor on n1's directory
    alone blames rank 3."""
    name = f"fail_{fault.split('@')[0]}_{where}"
    run_dir = lab.shared / name if where == "shared" else f"/tmp/{name}"
    endpoint = f"198.18.0.1:{next(_ports)}"
    env = dict(os.environ, DISTEVAL_FAULTS=fault)
    commands = {n: _disteval("dist.world_size=4", "dist.nnodes=2", f"dist.rdzv_endpoint={endpoint}",
                             f"hydra.run.dir={run_dir}", "communication.timeout_s=20", "data.batch_size=16")
                for n in ("n1", "n2")}
    t0 = time.monotonic()
    procs = {n: lab.popen(n, cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for n, cmd in commands.items()}
    outs = {n: p.communicate(timeout=180) for n, p in procs.items()}
    took = time.monotonic() - t0
    for n, p in procs.items():
        assert p.returncode == 1, f"{n}: exit {p.returncode}\n{outs[n][1][-3000:]}"
    assert took < 90, took
    n1_dir = Path(run_dir) if where == "shared" else lab.node("n1").tmp / name
    said = " ".join(outs["n1"][1].split())
    assert "rank 3" in said, said[-3000:]
    if fault.startswith("error"):
        assert "RuntimeError" in said, said[-3000:]
    else:
        assert "SIGKILL" in said or "heartbeat" in said or "stopped" in said, said[-3000:]
    assert not (n1_dir / "results.json").exists()
    if where == "node-local":
        assert not (lab.node("n2").tmp / name / "results.json").exists()
        assert json.loads((n1_dir / "ranks" / "rank3" / "status.json").read_text())["relayed"] is True
    doctor = subprocess.run([sys.executable, "-m", "diagnostics", "doctor", "--json", str(n1_dir)], cwd=REPO,
                            capture_output=True, text=True, timeout=120)
    report = json.loads(doctor.stdout)["runs"][0]
    assert doctor.returncode == 1 and report["culprit_rank"] == 3, doctor.stdout[-3000:]
    for n in ("n1", "n2"):  # nothing of the run survives on either node
        left = [p for p in lab.pids(n) if b"disteval" in _cmdline(p)]
        assert left == [], (n, left)


@pytest.mark.parametrize("how", ["prohibit", "blackhole"])
def test_node_cut_off_at_start(lab, how):
    """n2 cannot reach n1 (a prohibit route: refused at once; a blackhole: silent). Both nodes stop within about
    one timeout (communication.timeout_s=15, not torch's default 10 minutes), exit 1, and say what they saw:
    n2 that it could not reach the endpoint, n1 that the other node never joined; the doctor on the shared run
    directory (launch.json of n1, nodes/n2/launch.json of n2) names n2 as the node that never reached the
    rendezvous, says "check the network connection", and its remedy is one --apply will not run."""
    lab.partition("n2", how=how)
    try:
        endpoint = f"198.18.0.1:{next(_ports)}"
        run_dir = lab.shared / f"cut_{how}"
        commands = {n: _disteval("dist.world_size=4", "dist.nnodes=2", f"dist.rdzv_endpoint={endpoint}",
                                 f"hydra.run.dir={run_dir}", "communication.timeout_s=15") for n in ("n1", "n2")}
        t0 = time.monotonic()
        procs = on_nodes(lab, commands, timeout=120)
        took = time.monotonic() - t0
    finally:
        lab.heal("n2")
    assert took < 50, took
    for n, p in procs.items():
        assert p.returncode == 1, f"{n}: exit {p.returncode}\n{p.stderr[-3000:]}"
    n1_said, n2_said = (" ".join(procs[n].stderr.split()) for n in ("n1", "n2"))
    assert f"node n1: rendezvous at {endpoint} failed: the other node(s) did not join" in n1_said, n1_said[-2000:]
    assert f"node n2: rendezvous at {endpoint} failed: node n2 could not reach" in n2_said, n2_said[-2000:]
    assert "check the network connection" in n2_said
    assert json.loads((run_dir / "nodes" / "n2" / "launch.json").read_text())["error"]["reason"] == "unreachable"
    doctor = subprocess.run([sys.executable, "-m", "diagnostics", "doctor", "--json", str(run_dir)], cwd=REPO,
                            capture_output=True, text=True, timeout=120)
    report = json.loads(doctor.stdout)["runs"][0]
    verdict = report["verdict"]
    assert (verdict["state"], verdict["check"]) == ("INIT", "launch"), verdict
    assert "node(s) n2 never reached the rendezvous" in verdict["finding"], verdict["finding"]
    assert "check the network connection" in report["remedy"]["why"]
    assert report["remedy"]["changes_cause"] is False


def test_external_torchrun_with_loopback_master_refused(lab):
    """External ``torchrun --nnodes 2`` where n1's hostname resolves to 127.0.1.1 on n1: torchrun advertises
    MASTER_ADDR=n1, which n1's ranks resolve to loopback (gloo would bind lo and n2 could never connect). n1's
    ranks refuse before the process group, naming the node, MASTER_ADDR, what it resolves to and the fix; the
    job ends within about one timeout on both nodes."""
    hosts = lab.node("n1").root / "hosts"
    original = hosts.read_text()
    hosts.write_text(original.replace("198.18.0.1 n1\n", "") + "127.0.1.1 n1\n")
    try:
        # by name: with an address, torch's own c10d misses that n1 owns it (it compares the hostname's addresses)
        # and no node hosts the store: torchrun itself fails after its 2-minute connect timeout
        endpoint = f"n1:{next(_ports)}"
        run_dir = lab.shared / "loopmaster"
        t0 = time.monotonic()
        procs = on_nodes(lab, {n: _torchrun(2, 2, endpoint, f"hydra.run.dir={run_dir}", "communication.timeout_s=15")
                               for n in ("n1", "n2")}, timeout=150)
        took = time.monotonic() - t0
    finally:
        hosts.write_text(original)
    assert all(p.returncode != 0 for p in procs.values()), {n: p.returncode for n, p in procs.items()}
    assert took < 60, took
    said = " ".join((procs["n1"].stdout + procs["n1"].stderr).split())
    assert "the ranks span several nodes but MASTER_ADDR=n1 resolves to 127.0.1.1, a loopback address" in said, \
        said[-3000:]
    assert "--local-addr" in said and "dist.local_addr" in said




def _run_with_fault(lab, name: str, fault: str, during, *overrides: str, node_local: bool = False
                    ) -> tuple[dict, float, Path]:
    """W = 4 as 2 x 2 with DISTEVAL_FAULTS=``fault``; ``during(run_dir)`` acts on the lab while it runs; n2 is
    thawed once n1's driver ended; ``node_local``: run directories under each node's /tmp. Returns ({node:
    CompletedProcess}, seconds from the fault (``during`` returned) until n1's driver ended, n1's run directory as
    seen from here)."""
    endpoint = f"198.18.0.1:{next(_ports)}"
    run_dir = Path(f"/tmp/{name}") if node_local else lab.shared / name
    env = dict(os.environ, DISTEVAL_FAULTS=fault)
    commands = {n: _disteval("dist.world_size=4", "dist.nnodes=2", f"dist.rdzv_endpoint={endpoint}",
                             f"hydra.run.dir={run_dir}", "communication.timeout_s=12", *overrides)
                for n in ("n1", "n2")}
    procs = {n: lab.popen(n, cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for n, cmd in commands.items()}
    try:
        during(run_dir)
        t0 = time.monotonic()  # from the fault: imports and start-up on a loaded machine do not count
        outs = {"n1": procs["n1"].communicate(timeout=150)}
        took = time.monotonic() - t0  # n1 holds rank 0: the run's outcome is decided there
        lab.thaw("n2")  # a frozen node's processes end only once it runs again
        outs["n2"] = procs["n2"].communicate(timeout=150)
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
    return ({n: subprocess.CompletedProcess(p.args, p.returncode, *outs[n]) for n, p in procs.items()}, took,
            lab.node("n1").tmp / name if node_local else run_dir)


def _doctor(run_dir: Path) -> dict:
    proc = subprocess.run([sys.executable, "-m", "diagnostics", "doctor", "--json", str(run_dir)], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    return json.loads(proc.stdout)["runs"][0]


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:  # it ended between the listing and the read
        return b""


def _nothing_left(lab) -> None:
    for n in ("n1", "n2"):
        wait_for(lambda: not [p for p in lab.pids(n) if b"disteval" in _cmdline(p)], 30,
                 f"the run's processes on {n} to end")


@pytest.mark.parametrize("where", ["shared", "node-local"])
def test_partition_during_the_final_sync(lab, where):
    """Ranks 1-3 wait in the synchronisation's all_reduce while rank 0 is held back (a delay drill); then n2 is
    cut off silently (blackhole), with a shared or node-local run directory. The run ends within about one
    timeout (12 s; n2's driver, whose agent cannot leave the cut-off rendezvous, after timeout + 10 s more); the
    culprit is a rank of n2 (the
    node cut off), never rank 0 or 1 that only waited; no results.json; no process survives on either node."""
    def cut(run_dir):
        seen = lab.node("n2").tmp / run_dir.name if where == "node-local" else run_dir  # rank 2's own record
        wait_for(lambda: (rank_status(seen, 2).get("in_flight") or {}).get("op") == "all_reduce", 90,
                 "rank 2 to wait in the all_reduce")
        lab.partition("n2", how="blackhole")

    try:
        procs, took, run_dir = _run_with_fault(lab, f"sync_cut_{where}", "delay@0:sync=1,seconds=4", cut,
                                               node_local=where == "node-local")
    finally:
        lab.heal("n2")
    assert took < 45, took
    for n, p in procs.items():
        assert p.returncode == 1, f"{n}: {p.stderr[-3000:]}"
    said = " ".join(procs["n1"].stderr.split())
    assert "rank 2" in said or "rank 3" in said, said[-3000:]
    assert not (run_dir / "results.json").exists()
    report = _doctor(run_dir)
    assert report["culprit_rank"] in (2, 3), json.dumps(report["verdict"])[:3000]
    finding = report["verdict"]["finding"]
    assert (report["verdict"]["state"], report["verdict"]["check"]) == ("COMM", "timeout")
    if where == "node-local":  # n1 sees n2's ranks only as relayed before the cut: their heartbeats stopped
        assert report["remedy"]["changes_cause"] is False and "or node n2 was cut off from this one" in finding
        # n2's own directory holds its ranks' store_error: there the partition is named
        local = _doctor(lab.node("n2").tmp / run_dir.name)
        assert "the network between node(s) n2 and the other nodes failed (a partition)" in \
            local["verdict"]["finding"], local["verdict"]
        _nothing_left(lab)
        return
    assert "the network between node(s) n2 and n1 failed (a partition)" in finding, finding
    assert report["remedy"]["changes_cause"] is False and "check the network connection" in report["remedy"]["why"]
    _nothing_left(lab)


@pytest.mark.parametrize("action", ["freeze", "kill", "kill-local"])
def test_node_frozen_or_killed_mid_forward(lab, reference, action):
    """Every rank is held after its first batch (a delay drill); meanwhile n2 is frozen (SIGSTOP to every
    process in it) or killed (SIGKILL). n1's driver ends within about one timeout naming a rank of n2; the
    doctor blames that rank and says what happened: frozen (its heartbeat stopped: no timeout helps) or the
    node died (its launcher and its ranks stopped at once; with node-local run directories, ``kill-local``, from
    n2's ranks' records relayed through the store, its launcher's record being on n2's disk); after a thaw
    nothing of the run survives. The run recorded its progress after every batch (eval.journal): resumed at W = 2
    across two other lab nodes (n1 and n3, one rank each; through torchrun after the kill, through disteval's
    launcher after the freeze), and on this machine at W = 3 from n1's own disk for ``kill-local`` (n2's records
    are not there: their batches are evaluated again); its metrics == the one-process run's."""
    local = action == "kill-local"

    def strike(run_dir):
        seen = lab.node("n2").tmp / run_dir.name if local else run_dir  # n2's own disk, or the shared folder
        wait_for(lambda: rank_status(seen, 2).get("batches_done", 0) >= 1 and
                 rank_status(seen, 3).get("batches_done", 0) >= 1, 90, "ranks 2 and 3 to finish a batch")
        (lab.freeze if action == "freeze" else lab.kill)("n2")

    procs, took, run_dir = _run_with_fault(lab, f"node_{action.replace('-', '_')}", "delay@*:batch=1,seconds=6",
                                           strike, "eval.journal.every_batches=1", node_local=local)
    assert took < 60, took
    assert procs["n1"].returncode == 1, procs["n1"].stderr[-3000:]
    said = " ".join(procs["n1"].stderr.split())
    assert "rank 2" in said or "rank 3" in said, said[-3000:]
    assert not (run_dir / "results.json").exists()
    report = _doctor(run_dir)
    assert report["culprit_rank"] in (2, 3), json.dumps(report["verdict"])[:3000]
    finding = report["verdict"]["finding"]
    if action == "freeze":  # its peers saw its heartbeat stop (its late records after the thaw do not count)
        assert "stopped: its heartbeat stopped" in finding and "not slow" in finding, finding
    else:  # the node's launcher and ranks vanished together, with no error of their own
        assert "node n2 died or was killed" in finding, finding
        assert ("relayed through the rendezvous store" in finding) == local, finding
    assert report["remedy"]["changes_cause"] is False
    _nothing_left(lab)
    resumed = run_dir.parent / f"{run_dir.name}_resumed"
    if local:
        proc = run_disteval("dist.world_size=3", "eval.journal.every_batches=1", f"eval.resume={run_dir}",
                            run_dir=resumed)
        assert proc.returncode == 0, proc.stderr[-3000:]
    else:  # the resumed run itself spans nodes: rank 1 on n3 reads the records from the shared folder
        procs = multi_node(lab, ["n1", "n3"], resumed, "eval.journal.every_batches=1", f"eval.resume={run_dir}",
                           torchrun=action == "kill", world_size=2)
        rows = load_results(resumed)["per_rank"]
        assert sorted(r["host"] for r in rows) == ["n1", "n3"], rows
    res = load_results(resumed)
    assert res["metrics"] == reference[0]["metrics"] and res["coverage"]["ok"]
    assert res["journal"]["samples_resumed"] > 0, res["journal"]


def test_command_line_up_exec_status_down():
    """The lab's command line as a developer uses it: up (2 nodes), exec a command in a node (its hostname and
    address), status, down (nothing of the lab left: no holder, no bridge namespace)."""
    cli = [sys.executable, "-m", "disteval.testing.netlab", "--name", "clab"]
    try:
        up = subprocess.run([*cli, "up", "--nodes", "2"], capture_output=True, text=True, timeout=60)
        assert up.returncode == 0, up.stderr
        assert json.loads(up.stdout)["nodes"]["n2"]["addr"] == "198.18.0.2"
        inside = subprocess.run([*cli, "exec", "n2", "--", "sh", "-c", "hostname; hostname -i"], capture_output=True,
                                text=True, timeout=60)
        assert inside.returncode == 0 and inside.stdout.split() == ["n2", "198.18.0.2"], inside
        status = subprocess.run([*cli, "status"], capture_output=True, text=True, timeout=60)
        assert sorted(json.loads(status.stdout)["nodes"]) == ["n1", "n2"]
    finally:
        down = subprocess.run([*cli, "down"], capture_output=True, text=True, timeout=60)
    assert down.returncode == 0, down.stderr
    assert "clab-br" not in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    gone = subprocess.run([*cli, "status"], capture_output=True, text=True, timeout=60)
    assert gone.returncode != 0 and "no lab named 'clab' is running" in gone.stderr


FASHION = Path("/usr/share/datasets/fashion-mnist")
SLOW_JOB = ("+experiment=fashion_mnist", "eval.metrics=[classification,ranking]")


@pytest.mark.skipif(not any(FASHION.glob("t10k-*")), reason=f"Fashion-MNIST not found at {FASHION} "
                    "(apt-get install dataset-fashion-mnist)")
def test_slow_link_past_the_timeout(lab, tmp_path):
    """n2's link shaped to 1 Mbit/s both ways; 2 x 2 ranks gather the AUROC scores (10,000 x 10 float64: 200 kB per
    rank, 600 kB through each rank's link: about 4.8 s) under communication.sync_timeout_s=3 (room for ranks that
    reach the synchronisation up to 3 s apart on a loaded machine). The gather is still moving when
    the timeout runs out: every rank fails with CollectiveTimeout (the timeout bounds the whole collective, not
    each piece), no results.json. The doctor says a slow link, not a dead peer: the collective and its payload
    (ranking.scores, float64), the bytes, a throughput measured from the records within 2x of the shaped rate,
    the link's nodes (no culprit rank), and a sync timeout that suffices plus fp16 for the compressible scores;
    --apply refuses to rerun a run started by hand on two nodes and prints the command for every node. That
    command, run on both nodes, completes: results.json records fp16 for ranking.scores (and its measured error),
    the counts' metrics equal a 1-process run's exactly, AUROC and AP move by less than 1e-4 and 1e-3."""
    ref_dir = tmp_path / "w1"
    proc = run_disteval(*SLOW_JOB, "dist.world_size=1", run_dir=ref_dir)
    assert proc.returncode == 0, proc.stderr[-3000:]
    reference = load_results(ref_dir)["metrics"]
    lab.rate("n2", 1)
    try:
        procs, took, run_dir = _run_with_fault(lab, "slow_link", "", lambda run_dir: None, *SLOW_JOB,
                                               "communication.sync_timeout_s=3")
        assert procs["n1"].returncode == 1, procs["n1"].stderr[-3000:]
        assert "CollectiveTimeout: all_gather timed out" in " ".join(procs["n1"].stderr.split())
        assert not (run_dir / "results.json").exists()
        report = _doctor(run_dir)
        verdict, remedy = report["verdict"], report["remedy"]
        assert (verdict["state"], verdict["check"]) == ("COMM", "timeout"), verdict
        finding = verdict["finding"]
        assert finding.startswith("a slow link, not a dead peer: the all_gather of ranking.scores (float64)"), finding
        assert "of 204,800 bytes" in finding and "through the link between node(s) n1, n2" in finding, finding
        assert report["culprit_rank"] is None and verdict["culprit_nodes"] == ["n1", "n2"]
        measured = float(finding.split(" Mbit/s through")[0].rsplit(" ", 1)[1])
        assert 0.5 <= measured <= 2.0, finding  # shaped to 1 Mbit/s
        timeout = [o for o in remedy["overrides"] if o.startswith("communication.sync_timeout_s=")]
        assert timeout and float(timeout[0].split("=")[1]) > 3 and remedy["changes_cause"] is True, remedy
        assert "communication.compression=fp16" in remedy["overrides"], remedy
        apply = subprocess.run([sys.executable, "-m", "diagnostics", "doctor", "--apply", str(run_dir)], cwd=REPO,
                               capture_output=True, text=True, timeout=120)
        said = " ".join(apply.stdout.split())
        assert "the run spanned nodes n1, n2, each started by hand, and --apply reruns on this machine only" in said
        assert not (run_dir / "doctor").exists() or not list((run_dir / "doctor").glob("attempt*"))
        given = ("dist.world_size=", "dist.nnodes=", "dist.rdzv_endpoint=", "communication.timeout_s=")
        retry = [o for o in shlex.split(remedy["command"])[3:] if not o.startswith(given)]  # _run_with_fault's own
        procs, _, retry_dir = _run_with_fault(lab, "slow_link_retry", "", lambda run_dir: None, *retry)
    finally:
        lab.unrate("n2")
    for n, p in procs.items():
        assert p.returncode == 0, f"{n}: {p.stderr[-3000:]}"
    res = load_results(retry_dir)
    wire = res["comm"]["compression"]["ranking.scores"]
    assert wire["mode"] == "fp16" and wire["bytes_after"] * 4 == wire["bytes_before"] and wire["max_abs_error"] > 0
    exact = {k: v for k, v in reference.items() if not k.startswith(("auroc", "ap"))}  # not the ranking family's
    assert {k: res["metrics"][k] for k in exact} == exact and "top1" in exact
    assert abs(res["metrics"]["auroc_macro"] - reference["auroc_macro"]) < 1e-4
    assert abs(res["metrics"]["ap_macro"] - reference["ap_macro"]) < 1e-3
