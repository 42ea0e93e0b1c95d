"""A real multi-node SLURM cluster on the network lab (disteval/testing/netlab.py): one slurmd per lab node, each
inside its node's network, UTS and mount namespaces, so that a job's tasks on n1 and n2 talk over the lab's links
(real TCP through the lab's bridge, with its rate limits and partitions), exactly as on separate machines.

Layout (for a lab ``NAME`` with nodes n1..nK; the controller node is n1 unless told otherwise)::

    every node    munged                 its own daemon, socket /tmp/slurm-lab/munge.socket in the node's
                                         private /tmp, the key shared (ROOT/etc/munge.key): like machines
                                         that share one munge key
                  slurmd                 NodeName=nI NodeAddr=198.18.0.I (its hostname is nI); PID file and
                                         spool in the node's /tmp, TmpFS=/tmp (the node's)
    controller    mariadbd, slurmdbd     accounting (submitit learns failed/cancelled/timed-out job states only
                                         from sacct): MariaDB on 127.0.0.1 of the node, slurmdbd on its lab
                                         address so that sacct works from every node
                  slurmctld              SlurmctldHost=n1(198.18.0.1)

Everything shared (configs, the munge key, controller state, the database, every daemon's log, info.json)
lives under ROOT = LAB_DIR/slurm (default /var/tmp/disteval-netlab/NAME/slurm: outside /tmp, so every node
sees it at the same path). The cluster is separate from the single-node one of start_cluster.sh: its own root,
config, key, database and daemons, its ports inside the lab's network namespaces only (the machine's own
namespace routes the lab range to a blackhole), no /etc/slurm link, so both run side by side and neither
notices the other. Containment is netlab's and unchanged: nothing here adds an address or a route.

Clients (sbatch, srun, squeue, sacct, scancel, and so ``python -m disteval hydra/launcher=submitit_slurm``) must
run INSIDE a lab node (the controller's address is not reachable from the machine's namespace) with
``SLURM_CONF`` naming this cluster's config: ``lab.run("n1", ["sinfo"], env=cluster.env())``. A job's working
directory must be one every node sees: the lab's ``shared`` folder, or any path outside /tmp (each node has
its own /tmp).

Python::

    from disteval.testing.netlab import NetLab
    lab = NetLab(nodes=2, name="slab").start()
    cluster = start_lab_cluster(lab)          # idempotent: daemons already up are kept
    lab.run("n1", ["srun", "-N2", "--ntasks-per-node=2", "hostname"], cwd=lab.shared, env=cluster.env())
    stop_lab_cluster(cluster)                 # idempotent; also takes ROOT (a path) instead
    lab.stop()

Command line (as root)::

    python scripts/slurm/lab_cluster.py start --name slab [--nodes 2]   # starts the lab too unless it runs
    python -m disteval.testing.netlab --name slab exec n1 -- env SLURM_CONF=ROOT/etc/slurm.conf sinfo
    python scripts/slurm/lab_cluster.py stop --name slab [--lab-down]

Needs what start_cluster.sh installs (slurm-wlm 22.05 from Debian: slurmctld, slurmd, slurm-client, slurmdbd,
munge, mariadb-server); ``available()`` says what is missing. State (job ids, accounting) is kept across
stop/start while ROOT is; NetLab.start empties the lab's folder, so with the default ROOT every new lab gets a
fresh cluster (job ids from 1, an empty database: about 5 s to start, 3 s of which MariaDB and slurmdbd).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from disteval.testing.netlab import send_signal

NODE_DIR = "/tmp/slurm-lab"  # in each node's private /tmp: munge socket, PID files, slurmd spool, MariaDB socket
# Inside the lab's network namespaces only, so the usual ports cannot clash with the machine's (or the
# single-node cluster's 1681x ports in the machine's namespace).
CTLD_PORT, SLURMD_PORT, DBD_PORT, DB_PORT = 6817, 6818, 6819, 3306
COMMANDS = ("slurmctld", "slurmd", "slurmdbd", "munged", "mariadbd", "mariadb-install-db", "sbatch", "srun",
           "sinfo", "sacct", "sacctmgr", "scontrol", "scancel", "squeue", "munge", "unmunge", "mariadb",
           "mariadb-admin", "nsenter")
ACCOUNTING_ONLY = ("slurmdbd", "mariadbd", "mariadb-install-db", "mariadb", "mariadb-admin", "sacctmgr")


class LabClusterError(RuntimeError):
    """The cluster did not start; the message holds the failing step and the tail of the daemons' logs."""


@dataclass
class LabCluster:
    """What ``start_lab_cluster`` started (also written to ROOT/info.json, which ``stop_lab_cluster`` reads)."""

    lab: str                    # the lab's name
    root: str                   # ROOT (see the module docstring)
    conf: str                   # ROOT/etc/slurm.conf
    controller: str             # the node running slurmctld (and slurmdbd, mariadbd)
    nodes: dict[str, str]       # node -> lab address
    node_tmp: dict[str, str]    # node -> its /tmp as seen from the machine
    holders: dict[str, int]     # node -> pid of its namespace holder (nsenter target)
    cluster_name: str
    partition: str
    cpus: int                   # CPUs declared per node
    mem_mb: int                 # RealMemory per node
    accounting: bool
    startup_s: float = 0.0
    started: list[str] = field(default_factory=list)  # "daemon@node" started by the last start (not kept)

    def env(self, base: dict | None = None) -> dict:
        """``base`` (default os.environ) with SLURM_CONF naming this cluster and no other SLURM_* variable (a
        job's SLURM_JOB_ID etc. inherited from an outer cluster would mislead clients): for clients in a node."""
        env = {k: v for k, v in (os.environ if base is None else base).items() if not k.startswith("SLURM_")}
        env["SLURM_CONF"] = self.conf
        return env

    def log(self, name: str) -> Path:
        """ROOT/log/NAME (slurmctld.log, slurmd-n1.log, munged-n2.log, slurmdbd.log, mariadbd.err)."""
        return Path(self.root) / "log" / name

    def logs_tail(self, lines: int = 15) -> str:
        """The end of every daemon log, for error messages."""
        out = []
        for f in sorted((Path(self.root) / "log").glob("*")):
            try:
                text = f.read_text(errors="replace").splitlines()[-lines:]
            except OSError:
                continue
            if text:
                out.append(f"---- tail of {f}\n" + "\n".join(text))
        return "\n".join(out)


# ------------------------------------------------------------------------------------------------ helpers
def available(accounting: bool = True) -> str | None:
    """None when a lab cluster can be started here, else the reason (no root, no namespaces, a missing
    command: scripts/slurm/start_cluster.sh installs them)."""
    _importable()
    from disteval.testing.netlab import NetLab

    missing = [c for c in COMMANDS if (accounting or c not in ACCOUNTING_ONLY) and shutil.which(c) is None]
    if missing:
        return (f"no SLURM/munge{'/MariaDB' if accounting else ''} commands ({', '.join(missing)}): "
                "scripts/slurm/start_cluster.sh installs them")
    return NetLab.available()


def _importable() -> None:
    """disteval (for disteval.testing.netlab) importable when this file is run as a script from anywhere."""
    repo = str(Path(__file__).resolve().parents[2])
    if repo not in sys.path:
        sys.path.insert(0, repo)


def _enter(holder: int, cwd: str = "/") -> list[str]:
    return ["nsenter", "--target", str(holder), "--net", "--uts", "--mount", f"--wd={cwd}"]


def _netns(pid: int) -> int | None:
    try:
        return os.stat(f"/proc/{pid}/ns/net").st_ino
    except OSError:
        return None


def _comm(pid: int) -> str | None:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return None


def _pid_from(pidfile: Path) -> int | None:
    try:
        text = pidfile.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def _alive(pidfile: Path, comm: str, holder: int | None = None) -> int | None:
    """The pid in ``pidfile`` when it is a live ``comm`` process (in the namespace of ``holder`` when given)."""
    pid = _pid_from(pidfile)
    if pid is None or _comm(pid) != comm:
        return None
    if holder is not None and (_netns(pid) is None or _netns(pid) != _netns(holder)):
        return None
    return pid


def _stop_pids(named: list[tuple[str, int]], timeout: float = 30.0) -> None:
    """SIGTERM each (name, pid) still alive under that name, wait for all (up to ``timeout``), then SIGKILL."""
    live = [(n, p) for n, p in named if _comm(p) == n]
    for _, pid in live:
        send_signal(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while live and time.monotonic() < deadline:
        live = [(n, p) for n, p in live if _comm(p) == n and not _zombie(p)]
        time.sleep(0.05)
    for _, pid in live:
        send_signal(pid, signal.SIGKILL)


def _zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except (OSError, IndexError):
        return True


# ------------------------------------------------------------------------------------------------ configs
def _slurm_conf(c: LabCluster) -> str:
    r = c.root
    nodes = "".join(f"NodeName={n} NodeAddr={a} NodeHostname={n} CPUs={c.cpus} RealMemory={c.mem_mb} State=UNKNOWN\n"
                    for n, a in c.nodes.items())
    acct = (f"""AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost={c.controller}
AccountingStoragePort={DBD_PORT}
# for the connection to slurmdbd AuthInfo is not used: this names the munge socket for it
AccountingStoragePass={NODE_DIR}/munge.socket
JobAcctGatherType=jobacct_gather/linux
""" if c.accounting else "AccountingStorageType=accounting_storage/none\nJobAcctGatherType=jobacct_gather/none\n")
    return f"""# Written by disteval scripts/slurm/lab_cluster.py for the network lab {c.lab!r} (ROOT={r}).
# Do not edit: stop the cluster and start it again with other settings instead.
ClusterName={c.cluster_name}
SlurmctldHost={c.controller}({c.nodes[c.controller]})
SlurmctldPort={CTLD_PORT}
SlurmdPort={SLURMD_PORT}
SlurmUser=root
SlurmdUser=root

# every node runs its own munged on this socket (each node has its own /tmp); all share ROOT/etc/munge.key
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={NODE_DIR}/munge.socket

# shared: controller state and logs; per node (its private /tmp): PID files, spool, TmpFS
StateSaveLocation={r}/ctld
SlurmctldPidFile={NODE_DIR}/slurmctld.pid
SlurmctldLogFile={r}/log/slurmctld.log
SlurmdPidFile={NODE_DIR}/slurmd.pid
SlurmdSpoolDir={NODE_DIR}/spool
SlurmdLogFile={r}/log/slurmd-%n.log
TmpFS=/tmp
MailProg=/bin/true

# no cgroups in these containers: processes tracked through /proc, no binding, no memory enforcement
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none

{acct}JobCompType=jobcomp/none

MpiDefault=none
SchedulerType=sched/backfill
SchedulerParameters=batch_sched_delay=0
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
DefMemPerCPU={c.mem_mb // c.cpus}
EnforcePartLimits=ALL
# nodes declare more CPUs than the machine has (4 ranks per node on 2 cores)
SlurmdParameters=config_overrides
ReturnToService=2
SlurmctldTimeout=30
SlurmdTimeout=30
InactiveLimit=0
KillWait=5
MinJobAge=300
Waittime=0

{nodes}PartitionName={c.partition} Nodes={','.join(c.nodes)} Default=YES MaxTime=INFINITE MaxCPUsPerNode={c.cpus} \
State=UP
"""


def _slurmdbd_conf(c: LabCluster, db_pass: str) -> str:
    return f"""# Written by disteval scripts/slurm/lab_cluster.py for the network lab {c.lab!r}.
AuthType=auth/munge
AuthInfo=socket={NODE_DIR}/munge.socket
DbdHost={c.controller}
DbdAddr={c.nodes[c.controller]}
DbdPort={DBD_PORT}
SlurmUser=root
PidFile={NODE_DIR}/slurmdbd.pid
LogFile={c.root}/log/slurmdbd.log
StorageType=accounting_storage/mysql
StorageHost=127.0.0.1
StoragePort={DB_PORT}
StorageUser=slurm
StoragePass={db_pass}
StorageLoc=slurm_acct_db
"""


def _my_cnf(c: LabCluster) -> str:
    return f"""# Written by disteval scripts/slurm/lab_cluster.py: MariaDB for the slurmdbd of the lab cluster.
[mysqld]
datadir={c.root}/mysql
socket={NODE_DIR}/mysqld.sock
pid-file={NODE_DIR}/mysqld.pid
log-error={c.root}/log/mariadbd.err
port={DB_PORT}
bind-address=127.0.0.1
skip-name-resolve
user=root
skip-log-bin
innodb_use_native_aio=0
# small: a test cluster (slurmdbd logs that it recommends 512M; it works)
innodb_buffer_pool_size=128M
innodb_log_file_size=64M
innodb_lock_wait_timeout=900
[client]
socket={NODE_DIR}/mysqld.sock
"""


# ------------------------------------------------------------------------------------------------ start
class _Starter:
    def __init__(self, c: LabCluster, wait_s: float):
        self.c, self.wait_s = c, wait_s
        self.env = c.env()

    def run(self, node: str, args: list[str], check: bool = True, timeout: float = 60, **kw):
        kw.setdefault("capture_output", True)
        proc = subprocess.run(_enter(self.c.holders[node]) + args, env=self.env, text=True, timeout=timeout,
                              stdin=subprocess.DEVNULL, **kw)
        if check and proc.returncode != 0:
            self.die(f"in {node}: {' '.join(args)} failed ({proc.returncode}): "
                     f"{(proc.stderr or '').strip() or (proc.stdout or '').strip()}")
        return proc

    def die(self, msg: str):
        raise LabClusterError(f"{msg}\n{self.c.logs_tail()}")

    def wait(self, what: str, node: str, args: list[str], ok=lambda p: p.returncode == 0):
        deadline = time.monotonic() + self.wait_s
        while True:
            proc = self.run(node, args, check=False, timeout=30)
            if ok(proc):
                return proc
            if time.monotonic() > deadline:
                last = f"{(proc.stdout or '').strip()[-300:]} {(proc.stderr or '').strip()[-300:]}"
                self.die(f"timed out after {self.wait_s:.0f}s waiting for {what} "
                         f"(last: {' '.join(args)}: rc={proc.returncode} {last})")
            time.sleep(0.2)

    def pidfile(self, node: str, name: str) -> Path:
        return Path(self.c.node_tmp[node]) / NODE_DIR.removeprefix("/tmp/") / name

    def alive(self, node: str, pidfile: str, comm: str) -> int | None:
        return _alive(self.pidfile(node, pidfile), comm, self.c.holders[node])

    def daemon(self, node: str, name: str, pidfile: str, args: list[str], comm: str | None = None,
               foreground: bool = False) -> None:
        """Start ``args`` in ``node`` unless ``comm`` runs there from ``pidfile``. ``foreground``: the program does
        not daemonize itself (setsid --fork detaches it, its output goes to ROOT/log/NAME.out)."""
        comm = comm or name
        if self.alive(node, pidfile, comm):
            return
        self.pidfile(node, pidfile).unlink(missing_ok=True)
        out = open(self.c.log(f"{name}-{node}.out"), "ab")
        try:
            if foreground:
                args = ["setsid", "--fork", *args]
            self.run(node, args, stdout=out, stderr=subprocess.STDOUT, capture_output=False)
        finally:
            out.close()
        deadline = time.monotonic() + self.wait_s
        while not self.alive(node, pidfile, comm):
            if time.monotonic() > deadline:
                self.die(f"{name} in {node}: no live {comm} named by its PID file after {self.wait_s:.0f}s")
            time.sleep(0.05)
        self.c.started.append(f"{name}@{node}")


def start_lab_cluster(lab, *, root: str | os.PathLike | None = None, controller: str | None = None,
                      cpus: int = 4, mem_mb: int | None = None, accounting: bool = True,
                      cluster_name: str | None = None, partition: str = "lab", wait_s: float = 60) -> LabCluster:
    """Start (or complete) the SLURM cluster of the running NetLab ``lab``: munged and slurmd in every node,
    slurmctld (and, with ``accounting``, mariadbd and slurmdbd) in ``controller`` (default: the first node).
    Daemons already running from ROOT in the right node are kept. Returns once every node is idle in sinfo (and
    sacct answers). ``cpus``/``mem_mb``: what each node declares (default mem: 80% of RAM shared among the nodes).
    Raises LabClusterError with the daemons' log tails when something does not come up."""
    t0 = time.monotonic()
    reason = available(accounting)
    if reason:
        raise LabClusterError(reason)
    if not lab.members:
        raise LabClusterError(f"the lab {lab.name!r} is not running (NetLab.start() first)")
    nodes = {n.name: n.addr for n in sorted(lab.members.values(), key=lambda n: n.index)}
    controller = controller or next(iter(nodes))
    if controller not in nodes:
        raise LabClusterError(f"controller {controller!r} is not a node of lab {lab.name!r} ({', '.join(nodes)})")
    if mem_mb is None:
        total = int(next(ln for ln in Path("/proc/meminfo").read_text().splitlines()
                         if ln.startswith("MemTotal:")).split()[1]) // 1024
        mem_mb = max(256 * cpus, total * 8 // 10 // len(nodes))
    root = Path(root) if root is not None else Path(lab.dir) / "slurm"
    c = LabCluster(lab=lab.name, root=str(root), conf=str(root / "etc" / "slurm.conf"), controller=controller,
                   nodes=nodes, node_tmp={n.name: str(n.tmp) for n in lab.members.values()},
                   holders={n.name: n.pid for n in lab.members.values()}, cluster_name=cluster_name or lab.name,
                   partition=partition, cpus=cpus, mem_mb=mem_mb, accounting=accounting)
    s = _Starter(c, wait_s)
    for d in ("etc", "ctld", "log", "mysql"):
        (root / d).mkdir(parents=True, exist_ok=True)
    root.chmod(0o755)
    (root / "ctld").chmod(0o700)

    # configs: when one changes while daemons of this root run, they are stopped first (no half-applied change)
    pass_file = root / "etc" / "db.pass"
    if not pass_file.exists():
        old = os.umask(0o077)
        try:
            pass_file.write_text(os.urandom(18).hex())
        finally:
            os.umask(old)
    confs = {root / "etc" / "slurm.conf": (_slurm_conf(c), 0o644),
             root / "etc" / "slurmdbd.conf": (_slurmdbd_conf(c, pass_file.read_text().strip()), 0o600),
             root / "etc" / "my.cnf": (_my_cnf(c), 0o644)}
    changed = [p for p, (text, _) in confs.items() if not p.exists() or p.read_text() != text]
    if changed and _running(c):
        stop_lab_cluster(c)
    for path, (text, mode) in confs.items():
        if path in changed:
            tmp = path.with_suffix(".new")
            tmp.write_text(text)
            tmp.chmod(mode)
            tmp.replace(path)
    (root / "env.sh").write_text(f"export SLURM_CONF={c.conf}\n")
    key = root / "etc" / "munge.key"
    if not key.exists() or key.stat().st_size == 0:
        old = os.umask(0o077)
        try:
            key.write_bytes(os.urandom(1024))
        finally:
            os.umask(old)
    key.chmod(0o400)

    # 1. munged in every node (its socket in the node's /tmp)
    for node in nodes:
        s.run(node, ["mkdir", "-p", f"{NODE_DIR}/spool"])
        s.run(node, ["chmod", "755", NODE_DIR, f"{NODE_DIR}/spool"])
        if not s.alive(node, "munged.pid", "munged"):
            # a socket/lock left by a killed munged makes a new one exit ("socket is in use")
            s.run(node, ["rm", "-f", f"{NODE_DIR}/munge.socket", f"{NODE_DIR}/munge.socket.lock"])
        s.daemon(node, "munged", "munged.pid", [
            "munged", f"--socket={NODE_DIR}/munge.socket", f"--key-file={key}", f"--pid-file={NODE_DIR}/munged.pid",
            f"--log-file={c.log(f'munged-{node}.log')}", f"--seed-file={NODE_DIR}/munged.seed"])
    for node in nodes:
        s.wait(f"munge in {node}", node, ["sh", "-c", f"munge -n -S {NODE_DIR}/munge.socket | "
                                                      f"unmunge -S {NODE_DIR}/munge.socket"])

    # 2. accounting in the controller node: mariadbd, slurmdbd, the cluster
    ctl = controller
    if accounting:
        my = ["--defaults-file=" + str(root / "etc" / "my.cnf")]
        if not (root / "mysql" / "mysql").is_dir():
            with open(c.log("mariadb-install-db.log"), "ab") as out:
                s.run(ctl, ["mariadb-install-db", *my, "--auth-root-authentication-method=socket", "--skip-test-db"],
                      stdout=out, stderr=subprocess.STDOUT, capture_output=False, timeout=120)
        s.daemon(ctl, "mariadbd", "mysqld.pid", ["mariadbd", *my], foreground=True)
        s.wait("mariadbd to answer", ctl, ["mariadb-admin", *my, "ping"])
        db_pass = pass_file.read_text().strip()
        s.run(ctl, ["mariadb", *my, "-e", f"CREATE USER IF NOT EXISTS 'slurm'@'127.0.0.1' IDENTIFIED BY '{db_pass}';"
                    f" ALTER USER 'slurm'@'127.0.0.1' IDENTIFIED BY '{db_pass}';"
                    " GRANT ALL ON slurm_acct_db.* TO 'slurm'@'127.0.0.1';"])
        s.daemon(ctl, "slurmdbd", "slurmdbd.pid", ["slurmdbd"])
        s.wait("sacctmgr to reach slurmdbd", ctl, ["sacctmgr", "-n", "-P", "show", "cluster"])
        # The cluster, added before slurmctld starts so that the very first jobs are recorded (it would register
        # itself later otherwise). Adding it also gives root an association (account root): enough for jobs.
        if not s.run(ctl, ["sacctmgr", "-n", "-P", "show", "cluster", c.cluster_name, "format=cluster"],
                     check=False).stdout.strip():
            s.run(ctl, ["sacctmgr", "-i", "add", "cluster", c.cluster_name])

    # 3. slurmctld in the controller, slurmd in every node (hostname nI = NodeName nI: no -N needed)
    s.daemon(ctl, "slurmctld", "slurmctld.pid", ["slurmctld", "-i"])
    for node in nodes:
        s.daemon(node, "slurmd", "slurmd.pid", ["slurmd"])
    s.wait("slurmctld to answer", ctl, ["scontrol", "ping"], ok=lambda p: p.returncode == 0 and "UP" in p.stdout)

    # 4. usable: every node idle (or busy) in sinfo, a node left down/drained by an earlier run resumed
    deadline = time.monotonic() + wait_s
    while True:
        out = s.run(ctl, ["sinfo", "-h", "-N", "-o", "%N %T"], check=False).stdout
        states = dict(line.split()[:2] for line in out.splitlines() if len(line.split()) >= 2)
        bad = {n: st for n, st in states.items() if st.rstrip("*~#!%$@^-") not in
               ("idle", "mixed", "allocated", "completing")}
        if set(states) == set(nodes) and not bad:
            break
        for n, st in bad.items():
            if "inval" in st:
                why = s.run(ctl, ["sinfo", "-h", "-N", "-n", n, "-o", "%E"], check=False).stdout.strip()
                s.die(f"node {n} is INVAL: {why}")
            if "drain" in st or st.startswith("down"):
                s.run(ctl, ["scontrol", "update", f"NodeName={n}", "State=RESUME"], check=False)
        if time.monotonic() > deadline:
            s.die(f"nodes not usable after {wait_s:.0f}s: sinfo says {states or out.strip() or 'nothing'}")
        time.sleep(0.2)
    if accounting:
        s.wait("sacct to answer", ctl, ["sacct", "-n", "-X", "-S", "now"])
    c.startup_s = round(time.monotonic() - t0, 2)
    (root / "info.json").write_text(json.dumps(asdict(c), indent=1))
    return c


def _running(c: LabCluster) -> list[tuple[str, int]]:
    """(name, pid) of every daemon of this cluster that is alive (in any node, whatever its holder now)."""
    found = []
    for tmp in c.node_tmp.values():
        d = Path(tmp) / NODE_DIR.removeprefix("/tmp/")
        for pidfile, comm in (("slurmd.pid", "slurmd"), ("slurmctld.pid", "slurmctld"), ("slurmdbd.pid", "slurmdbd"),
                              ("mysqld.pid", "mariadbd"), ("munged.pid", "munged")):
            pid = _alive(d / pidfile, comm)
            if pid:
                found.append((comm, pid))
    return found


# ------------------------------------------------------------------------------------------------ stop
def stop_lab_cluster(cluster: LabCluster | str | os.PathLike, timeout: float = 30) -> list[str]:
    """Stop the lab cluster (a LabCluster, or its ROOT: ROOT/info.json says what runs where), and nothing else:
    jobs still queued are cancelled, then slurmd/slurmctld, slurmdbd, mariadbd and munged get SIGTERM (SIGKILL
    after ``timeout``), then job processes left behind (their environment names this cluster's SLURM_CONF) are
    killed. Safe to call twice, with the lab already stopped, or with nothing started. Returns what it did."""
    if not isinstance(cluster, LabCluster):
        info = Path(cluster) / "info.json"
        if not info.exists():
            return [f"nothing to stop: no {info}"]
        cluster = LabCluster(**{k: v for k, v in json.loads(info.read_text()).items() if k != "started"})
    c, done = cluster, []
    env = c.env()
    ctl_holder = c.holders.get(c.controller)
    ctld = _alive(Path(c.node_tmp[c.controller]) / NODE_DIR.removeprefix("/tmp/") / "slurmctld.pid", "slurmctld")
    # 1. cancel queued/running jobs while slurmctld and the slurmds can still end them properly
    if ctld and ctl_holder and _netns(ctl_holder) == _netns(ctld):
        def squeue() -> str:
            return subprocess.run(_enter(ctl_holder) + ["squeue", "-h", "-t", "PD,R,CG,S", "-o", "%A"], env=env,
                                  capture_output=True, text=True, timeout=30).stdout.split()
        try:
            jobs = squeue()
            if jobs:
                subprocess.run(_enter(ctl_holder) + ["scancel", *jobs], env=env, capture_output=True, timeout=30)
                done.append(f"cancelled jobs {' '.join(jobs)}")
                deadline = time.monotonic() + timeout
                while squeue() and time.monotonic() < deadline:
                    time.sleep(0.25)
        except (OSError, subprocess.SubprocessError):
            pass
    # 2. the daemons, in reverse start order (slurmctld sends its last records to slurmdbd; all need munge)
    live = _running(c)
    for group in (("slurmd", "slurmctld"), ("slurmdbd",), ("mariadbd", "munged")):
        members = [(n, p) for n, p in live if n in group]
        _stop_pids(members, timeout)
        done += [f"stopped {n} (pid {p})" for n, p in members]
    # 3. job processes left behind (slurmstepd and tasks carry SLURM_CONF): tasks first, then their stepds
    me, ancestors = os.getpid(), set()
    p = me
    while p > 1:
        ancestors.add(p)
        try:
            p = int(Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            break
    steps, tasks = [], []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) in ancestors:
            continue
        try:
            environ = Path(f"/proc/{entry}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"SLURM_CONF={c.conf}".encode() not in environ:
            continue
        if _comm(int(entry)) == "slurmstepd":
            steps.append(int(entry))
        elif any(e.startswith(b"SLURM_JOB_ID=") for e in environ):
            tasks.append(int(entry))
    if steps or tasks:
        for pid in tasks:
            send_signal(pid, signal.SIGTERM)
        deadline = time.monotonic() + 5
        while any(not _zombie(t) for t in tasks) and time.monotonic() < deadline:
            time.sleep(0.1)
        for pid in tasks + steps:
            send_signal(pid, signal.SIGKILL)
        done.append(f"killed job processes left behind: slurmstepd {steps}, tasks {tasks}")
    return done or ["nothing was running"]


# ------------------------------------------------------------------------------------------------ CLI
def main(argv: list[str] | None = None) -> int:
    _importable()
    from disteval.testing.netlab import DEFAULT_BASE, NetLab, NetLabError, attach

    p = argparse.ArgumentParser(prog="scripts/slurm/lab_cluster.py", description=__doc__.split("\n\n")[0])
    p.add_argument("cmd", choices=["start", "stop", "status"])
    p.add_argument("--name", default="slab", help="the lab's name (default slab)")
    p.add_argument("--base", default=DEFAULT_BASE)
    p.add_argument("--nodes", type=int, default=2, help="start: nodes of the lab, when it does not run yet")
    p.add_argument("--cpus", type=int, default=4)
    p.add_argument("--no-accounting", action="store_true", help="start: no slurmdbd/MariaDB (sacct fails)")
    p.add_argument("--lab-down", action="store_true", help="stop: stop the lab too")
    a = p.parse_args(argv)
    root = Path(a.base) / a.name / "slurm"
    if a.cmd == "stop":
        print("\n".join(stop_lab_cluster(root)))
        if a.lab_down:
            try:
                attach(a.name, a.base).stop()
            except NetLabError:
                pass
        return 0
    if a.cmd == "status":
        print((root / "info.json").read_text() if (root / "info.json").exists() else f"no cluster in {root}")
        return 0
    try:
        lab = attach(a.name, a.base)
    except NetLabError:
        reason = NetLab.available()
        if reason:
            print(reason, file=sys.stderr)
            return 2
        lab = NetLab(nodes=a.nodes, name=a.name, base=a.base).start()
    try:
        c = start_lab_cluster(lab, cpus=a.cpus, accounting=not a.no_accounting)
    except LabClusterError as exc:
        print(f"lab_cluster.py: ERROR: {exc}", file=sys.stderr)
        return 1
    print(f"lab cluster up in {c.startup_s}s: nodes {', '.join(f'{n}={ad}' for n, ad in c.nodes.items())}, "
          f"controller {c.controller}; started {', '.join(c.started) or 'nothing (all running)'}")
    print(f"clients run in a node: python -m disteval.testing.netlab --name {a.name} exec {c.controller} -- "
          f"env SLURM_CONF={c.conf} sinfo")
    return 0


if __name__ == "__main__":
    sys.exit(main())
