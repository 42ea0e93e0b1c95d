"""A network lab on one Linux machine: K "nodes" n1..nK, each a set of network + UTS + mount namespaces with
its own hostname, interface ``eth0``, address from 198.18.0.0/24 (RFC 2544's range for network test labs),
port space, ``/etc/hosts`` and private ``/tmp``, joined by veth pairs to a bridge that lives in a network
namespace of its own. Traffic between nodes is real TCP through the kernel's bridge, so rendezvous, gloo's
full mesh and the rate limits and partitions below behave as between machines.

Containment (checked by ``NetLab.start`` and by tests/test_netlab.py): the machine's own (root) namespace gets
no address in the lab and holds a ``blackhole`` route for 198.18.0.0/15, and the nodes have no default route:
a node reaches only its lab neighbours, and no lab packet can leave through the machine's interfaces. The
bridge namespace has no address at all. ``NetLab.stop`` always runs (context manager, pytest finalizer) and
``cleanup_stale`` removes what a crashed run left (nodes are found by the ``DISTEVAL_NETLAB`` variable in
their holder's environment, the bridge by its namespace name).

Each node is held by one ``unshare --net --uts --mount`` process (``sleep infinity``); commands run in a node
through ``nsenter --target HOLDER``. Needs root and util-linux's unshare/nsenter and iproute2's ip/tc; where
they are missing ``NetLab.available()`` says why (tests skip with that reason).

Link controls (all undone by ``heal``/``thaw`` or by ``stop``):

- ``rate(node, mbit, peer=None)``: token-bucket shaping (tc tbf) of everything a node sends and receives, or,
  with ``peer``, of the node pair's traffic only (tc htb with a u32 filter on the peer's address, both ways);
- ``partition(node, peer=None, how=...)``: ``down`` (the node's link down), ``blackhole`` (packets to the
  peer, or to every other node, silently dropped both ways: a silent partition, through a sink veth and a
  permanent neighbour entry, since this kernel has no dummy device and no tc drop action) or ``prohibit``
  (refused at once, EACCES);
- ``freeze(node)`` / ``thaw(node)``: SIGSTOP / SIGCONT every process in the node; ``kill(node)``: SIGKILL every
  process in it (the holder stays, so the node can run again).

Command line (as root)::

    python -m disteval.testing.netlab up --nodes 3 [--name lab] [--second-net]
    python -m disteval.testing.netlab exec n1 -- python -m disteval ...
    python -m disteval.testing.netlab status | down | cleanup
"""
from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from disteval.common.liveness import process_state

SUBNET = "198.18.0"  # node i: SUBNET.i/24 on eth0
SUBNET2 = "198.18.1"  # the optional second network: SUBNET2.i/24 on eth1
CONTAINMENT = "198.18.0.0/15"
MARK = "DISTEVAL_NETLAB"
DEFAULT_BASE = "/var/tmp/disteval-netlab"  # not under /tmp: nodes replace /tmp with their own


def hidden_by_private_tmp() -> str | None:
    """Why the lab's nodes could not run this Python (a node replaces /tmp with its own, so an interpreter, virtual
    environment or checkout under /tmp is missing there and every command in a node exits 127 with nsenter's "No
    such file or directory"), or None. Checked at lab start."""
    where = {"the interpreter": os.path.realpath(sys.executable), "its environment (sys.prefix)": os.path.realpath(sys.prefix),
             "the disteval package": os.path.realpath(os.path.dirname(os.path.dirname(__file__)))}
    under = [f"{what} {path}" for what, path in where.items() if path == "/tmp" or path.startswith("/tmp/")]
    if not under:
        return None
    return (f"the network lab's nodes have a private /tmp, so {' and '.join(under)} would not exist inside them "
            "(commands there would exit 127): put the virtual environment and the checkout outside /tmp "
            "(e.g. /var/tmp or your home) and run again")


class NetLabError(RuntimeError):
    """A lab command failed; the message holds the command and its stderr."""


def _run(args: list[str], check: bool = True, input: str | None = None) -> subprocess.CompletedProcess:
    proc = subprocess.run(args, capture_output=True, text=True, input=input, timeout=60)
    if check and proc.returncode != 0:
        raise NetLabError(f"{' '.join(args)} failed ({proc.returncode}): {proc.stderr.strip() or proc.stdout.strip()}")
    return proc


def _ns_inode(pid: int, kind: str = "net") -> int | None:
    try:
        return os.stat(f"/proc/{pid}/ns/{kind}").st_ino
    except OSError:
        return None


def _pids_in_netns(inode: int) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and _ns_inode(int(entry)) == inode:
            out.append(int(entry))
    return out


def _marked_holders(name: str | None = None) -> list[tuple[int, str]]:
    """(pid, "lab:node") of every holder process of a lab (of ``name`` only, when given)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            env = Path(f"/proc/{entry}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        for item in env:
            if item.startswith(MARK.encode() + b"="):
                value = item.split(b"=", 1)[1].decode()
                if name is None or value.startswith(name + ":"):
                    found.append((int(entry), value))
    return found


@dataclass
class Node:
    """One lab node: its name (also its hostname), index i (address SUBNET.i), holder pid and folders."""

    name: str
    index: int
    pid: int
    root: Path  # host-side folder: tmp/ (the node's /tmp), hosts
    addr: str = ""
    addr2: str | None = None

    @property
    def tmp(self) -> Path:
        """The node's private /tmp, as seen from the machine (node-local run directories live here)."""
        return self.root / "tmp"


@dataclass
class NetLab:
    """A lab of ``nodes`` nodes (see the module docstring). ``name``: a short prefix (namespace and interface
    names, at most 6 characters); ``base``: the lab's folder on the machine (``base/name``: nodes' /tmp and hosts
    files, ``shared/`` a folder every node sees at the same path); ``second_net``: give every node a second
    interface eth1 on SUBNET2 through a second bridge; ``loopback_hostname``: node names whose hosts file maps
    their own hostname to 127.0.1.1 (Debian's default for a machine without a fixed address)."""

    nodes: int = 2
    name: str = "dlab"
    base: str = DEFAULT_BASE
    second_net: bool = False
    loopback_hostname: tuple[str, ...] = ()
    members: dict[str, Node] = field(default_factory=dict)

    # ---- life cycle ---------------------------------------------------------------------------------------
    @staticmethod
    def available() -> str | None:
        """None when a lab can be made here, else the reason (not root, a tool missing, no namespaces)."""
        if os.geteuid() != 0:
            return "the network lab needs root (network namespaces, veth pairs, mounts)"
        for tool in ("ip", "tc", "unshare", "nsenter"):
            if shutil.which(tool) is None:
                return f"the network lab needs `{tool}` (iproute2 / util-linux)"
        probe = subprocess.run(["unshare", "--net", "--uts", "--mount", "true"], capture_output=True, text=True)
        if probe.returncode != 0:
            return f"cannot create network/UTS/mount namespaces here: {probe.stderr.strip()}"
        return None

    @property
    def dir(self) -> Path:
        return Path(self.base) / self.name

    @property
    def shared(self) -> Path:
        """A folder every node sees at the same path (the lab's shared filesystem)."""
        return self.dir / "shared"

    @property
    def bridge_ns(self) -> str:
        return f"{self.name}-br"

    def node(self, name: str) -> Node:
        try:
            return self.members[name]
        except KeyError:
            raise NetLabError(f"no node {name!r} in lab {self.name!r} (nodes: {', '.join(self.members)})") from None

    def __enter__(self) -> "NetLab":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self) -> "NetLab":
        """Create the bridge namespace, the nodes and their links; check containment. Cleans a stale lab of the
        same name first and empties the lab's folder (``base/name``). Raises NetLabError (after undoing what was made) when a step fails."""
        if len(self.name) > 6 or not self.name.isalnum():
            raise NetLabError(f"lab name {self.name!r}: at most 6 letters or digits (interface names are short)")
        if not 1 <= self.nodes <= 200:
            raise NetLabError(f"nodes={self.nodes}: 1..200")
        hidden = hidden_by_private_tmp()
        if hidden:
            raise NetLabError(hidden)
        cleanup_stale(self.name, self.base)
        try:
            with _building():
                self._build()
        except BaseException:
            self.stop()
            raise
        return self

    def _build(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)  # a fresh lab: no run directories of an earlier one
        self.dir.mkdir(parents=True, exist_ok=True)
        self.shared.mkdir(exist_ok=True)
        # containment in the machine's own namespace: lab addresses are never routed out
        _run(["ip", "route", "replace", "blackhole", CONTAINMENT])
        _run(["ip", "netns", "add", self.bridge_ns])
        self._in_bridge("ip", "link", "set", "lo", "up")
        for br in ("br0", "br1") if self.second_net else ("br0",):
            self._in_bridge("ip", "link", "add", br, "type", "bridge")
            self._in_bridge("ip", "link", "set", br, "up")
        names = [f"n{i}" for i in range(1, self.nodes + 1)]
        hosts = "127.0.0.1 localhost\n" + "".join(f"{SUBNET}.{i} n{i}\n" for i in range(1, self.nodes + 1))
        for i, name in enumerate(names, start=1):
            root = self.dir / "nodes" / name
            (root / "tmp").mkdir(parents=True, exist_ok=True)
            (root / "tmp").chmod(0o1777)
            text = hosts if name not in self.loopback_hostname else hosts.replace(f"{SUBNET}.{i} {name}\n", "") + \
                f"127.0.1.1 {name}\n"
            (root / "hosts").write_text(text)
            holder = subprocess.Popen(["unshare", "--net", "--uts", "--mount", "--propagation", "private",
                                       "sleep", "infinity"], env=dict(os.environ, **{MARK: f"{self.name}:{name}"}),
                                      stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                      start_new_session=True)
            node = Node(name, i, holder.pid, root, addr=f"{SUBNET}.{i}")
            self.members[name] = node
            self._wait_holder(node)
            self._wire(node, "eth0", "br0", f"{SUBNET}.{i}")
            if self.second_net:
                node.addr2 = f"{SUBNET2}.{i}"
                self._wire(node, "eth1", "br1", node.addr2)
            self.sh(name, "hostname", name)
            self.sh(name, "sysctl", "-qw", "net.ipv6.conf.all.disable_ipv6=1")
            self.sh(name, "sysctl", "-qw", "net.ipv6.conf.default.disable_ipv6=1")
            self.sh(name, "ip", "link", "set", "lo", "up")
            self.sh(name, "mount", "--bind", str(root / "tmp"), "/tmp")
            self.sh(name, "mount", "--bind", str(root / "hosts"), "/etc/hosts")
        (self.dir / "lab.json").write_text(json.dumps(self.describe(), indent=1))
        self.check_containment()

    def _wait_holder(self, node: Node) -> None:
        root_net = _ns_inode(os.getpid())
        deadline = time.monotonic() + 10
        while _ns_inode(node.pid) in (None, root_net):  # unshare has not entered its namespaces yet
            if time.monotonic() > deadline:
                raise NetLabError(f"node {node.name}: its namespace holder (pid {node.pid}) did not start")
            time.sleep(0.01)

    def _wire(self, node: Node, ifname: str, bridge: str, addr: str) -> None:
        port = f"{self.name}{node.index}{ifname[-1]}"  # bridge-side end, e.g. dlab10
        _run(["ip", "link", "add", port, "type", "veth", "peer", "name", ifname, "netns", str(node.pid)])
        _run(["ip", "link", "set", port, "netns", self.bridge_ns])
        self._in_bridge("ip", "link", "set", port, "master", bridge)
        self._in_bridge("ip", "link", "set", port, "up")
        self.sh(node.name, "ip", "addr", "add", f"{addr}/24", "dev", ifname)
        self.sh(node.name, "ip", "link", "set", ifname, "up")

    def stop(self) -> None:
        """Kill every process in every node, remove the namespaces and links. Safe to call twice."""
        for node in self.members.values():
            inode = _ns_inode(node.pid)
            if inode is not None and inode != _ns_inode(os.getpid()):
                for pid in _pids_in_netns(inode):
                    send_signal(pid, signal.SIGCONT)
                    send_signal(pid, signal.SIGKILL)
            send_signal(node.pid, signal.SIGKILL)
        self.members.clear()
        cleanup_stale(self.name, self.base)

    def describe(self) -> dict:
        return {"name": self.name, "dir": str(self.dir), "shared": str(self.shared), "bridge_ns": self.bridge_ns,
                "nodes": {n.name: {"pid": n.pid, "addr": n.addr, "addr2": n.addr2, "tmp": str(n.tmp)}
                          for n in self.members.values()}}

    def check_containment(self) -> None:
        """Raise NetLabError unless: the root namespace has no lab address and routes the lab range to a
        blackhole; no node has a default route; the bridge namespace has no address."""
        addrs = _run(["ip", "-o", "addr", "show"]).stdout
        if f" {SUBNET}." in addrs or f" {SUBNET2}." in addrs:
            raise NetLabError("containment: the machine's own namespace holds a lab address")
        route = _run(["ip", "route", "get", f"{SUBNET}.1"], check=False)
        if "blackhole" not in _run(["ip", "route", "show", CONTAINMENT]).stdout or route.returncode == 0:
            raise NetLabError(f"containment: the machine's namespace would route {SUBNET}.1: {route.stdout}")
        if any(" lo " not in line for line in self._in_bridge("ip", "-o", "-4", "addr", "show").stdout.splitlines()):
            raise NetLabError("containment: the bridge namespace holds an address")
        for node in self.members.values():
            if "default" in self.sh(node.name, "ip", "route", "show").stdout:
                raise NetLabError(f"containment: node {node.name} has a default route")

    # ---- running things in a node -----------------------------------------------------------------------
    def _enter(self, name: str, cwd: str | os.PathLike | None = None) -> list[str]:
        node = self.node(name)
        return ["nsenter", "--target", str(node.pid), "--net", "--uts", "--mount",
                f"--wd={cwd or os.getcwd()}"]

    def sh(self, name: str, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        """Run a short command in node ``name``; returns the finished process (raises NetLabError on failure
        when ``check``)."""
        return _run(self._enter(name, "/") + list(args), check=check)

    def _in_bridge(self, *args: str) -> subprocess.CompletedProcess:
        return _run(["ip", "netns", "exec", self.bridge_ns, *args])

    def popen(self, name: str, args: list[str], cwd: str | os.PathLike | None = None, env: dict | None = None,
              **kw) -> subprocess.Popen:
        """Start ``args`` in node ``name`` (its network, hostname, /etc/hosts and /tmp) in folder ``cwd``
        (default: this process's). No shell is involved."""
        return subprocess.Popen(self._enter(name, cwd) + list(args), env=env, **kw)

    def run(self, name: str, args: list[str], cwd=None, env: dict | None = None, timeout: float = 300,
            **kw) -> subprocess.CompletedProcess:
        """Run ``args`` in node ``name`` and wait (text output captured unless given otherwise)."""
        kw.setdefault("capture_output", True)
        kw.setdefault("text", True)
        return subprocess.run(self._enter(name, cwd) + list(args), env=env, timeout=timeout, **kw)

    def pids(self, name: str) -> list[int]:
        """Every process in node ``name`` except its holder."""
        node = self.node(name)
        return [p for p in _pids_in_netns(_ns_inode(node.pid)) if p != node.pid]

    # ---- link controls ----------------------------------------------------------------------------------
    def rate(self, name: str, mbit: float, peer: str | None = None) -> None:
        """Shape node ``name``'s traffic to ``mbit`` Mbit/s both ways (tbf on its eth0 and on its bridge port),
        or only the traffic between it and ``peer`` (htb + u32 on both nodes' eth0)."""
        node = self.node(name)
        if peer is None:
            tbf = ["tbf", "rate", f"{mbit}mbit", "burst", "32kb", "latency", "400ms"]
            self.sh(name, "tc", "qdisc", "replace", "dev", "eth0", "root", *tbf)
            self._in_bridge("tc", "qdisc", "replace", "dev", f"{self.name}{node.index}0", "root", *tbf)
            return
        for a, b in ((name, peer), (peer, name)):
            dst = self.node(b).addr
            self.sh(a, "tc", "qdisc", "replace", "dev", "eth0", "root", "handle", "1:", "htb", "default", "10")
            self.sh(a, "tc", "class", "replace", "dev", "eth0", "parent", "1:", "classid", "1:10", "htb",
                    "rate", "10gbit")
            self.sh(a, "tc", "class", "replace", "dev", "eth0", "parent", "1:", "classid", "1:20", "htb",
                    "rate", f"{mbit}mbit", "ceil", f"{mbit}mbit")
            self.sh(a, "tc", "filter", "replace", "dev", "eth0", "parent", "1:", "protocol", "ip", "prio", "1",
                    "u32", "match", "ip", "dst", f"{dst}/32", "flowid", "1:20")

    def unrate(self, name: str) -> None:
        """Remove node ``name``'s shaping (both directions)."""
        node = self.node(name)
        self.sh(name, "tc", "qdisc", "del", "dev", "eth0", "root", check=False)
        _run(["ip", "netns", "exec", self.bridge_ns, "tc", "qdisc", "del", "dev", f"{self.name}{node.index}0",
              "root"], check=False)

    def partition(self, name: str, peer: str | None = None, how: str = "blackhole") -> None:
        """Cut node ``name`` off from ``peer`` (or from every other node), both directions. ``how``: ``down`` (the
        node's link down, no peer), ``blackhole`` (a silent partition: packets leave through a sink interface
        to a MAC nobody owns and vanish; no error, TCP retries until its timeout) or ``prohibit`` (refused at
        once: EACCES on connect)."""
        if how == "down":
            if peer is not None:
                raise NetLabError("partition(how='down') takes the whole link down; give no peer")
            self.sh(name, "ip", "link", "set", "eth0", "down")
            return
        if how not in ("blackhole", "prohibit"):
            raise NetLabError(f"partition how={how!r}: down, blackhole or prohibit")
        for other in ([peer] if peer else [n for n in self.members if n != name]):
            for a, b in ((name, other), (other, name)):
                dst = self.node(b).addr
                if how == "prohibit":
                    self.sh(a, "ip", "route", "replace", "prohibit", f"{dst}/32")
                    continue
                self._sink(a)
                self.sh(a, "ip", "neigh", "replace", dst, "lladdr", "02:00:00:00:00:01", "dev", "sink0",
                        "nud", "permanent")
                self.sh(a, "ip", "route", "replace", f"{dst}/32", "dev", "sink0")

    def _sink(self, name: str) -> None:
        """A veth pair sink0/sink1 inside node ``name`` (made once): frames sent out of sink0 to an unknown MAC
        arrive at sink1 and are dropped (the lab's kernel has neither the dummy device nor tc's drop action)."""
        if self.sh(name, "ip", "link", "show", "sink0", check=False).returncode == 0:
            return
        self.sh(name, "ip", "link", "add", "sink0", "type", "veth", "peer", "name", "sink1")
        self.sh(name, "ip", "link", "set", "sink0", "up")
        self.sh(name, "ip", "link", "set", "sink1", "up")

    def heal(self, name: str) -> None:
        """Undo ``partition`` for node ``name`` (its link up, its /32 routes and its peers' routes to it gone)."""
        self.sh(name, "ip", "link", "set", "eth0", "up")
        for other in self.members.values():
            if other.name != name:
                self.sh(name, "ip", "route", "del", f"{other.addr}/32", check=False)
                self.sh(other.name, "ip", "route", "del", f"{self.node(name).addr}/32", check=False)

    def freeze(self, name: str) -> list[int]:
        """SIGSTOP every process in node ``name`` and wait (at most 5 s) until each is stopped (state T) or gone:
        the signal is delivered when the process is next scheduled, which on a loaded machine is not at once.
        Returns their pids; NetLabError naming a process still running after 5 s."""
        pids = self.pids(name)
        for pid in pids:
            send_signal(pid, signal.SIGSTOP)
        deadline = time.monotonic() + 5
        for pid in pids:
            while process_state(pid) not in (None, "T", "t"):
                if time.monotonic() > deadline:
                    raise NetLabError(f"node {name}: process {pid} still {process_state(pid)} 5 s after SIGSTOP")
                time.sleep(0.01)
        return pids

    def thaw(self, name: str) -> None:
        for pid in self.pids(name):
            send_signal(pid, signal.SIGCONT)

    def kill(self, name: str) -> list[int]:
        """SIGKILL every process in node ``name`` (its holder stays) at one instant, as a node that loses power;
        returns their pids. Every process is stopped first: killed one by one, a rank would outlive its launcher
        by a few microseconds, get the launcher's death signal and record an error a dead node never writes."""
        pids = self.freeze(name)
        for pid in pids:
            send_signal(pid, signal.SIGKILL)
        return pids


def send_signal(pid: int, sig: int) -> None:
    """``os.kill(pid, sig)``, ignoring a process that is already gone (or not ours)."""
    try:
        os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


@contextlib.contextmanager
def _building():
    """One lab built at a time on this machine (labs of other names may run side by side): two first
    ``ip netns add`` at once race in mounting /run/netns. An advisory lock on /run/disteval-netlab.lock, released
    when the build ends or its process dies."""
    with open("/run/disteval-netlab.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def cleanup_stale(name: str | None = None, base: str = DEFAULT_BASE) -> list[str]:
    """Remove what labs (of ``name``, or every lab when None) left behind: processes in their nodes, their
    holders, bridge namespaces and bridge ports. Returns what was removed, one line each."""
    removed = []
    root_net = _ns_inode(os.getpid())
    for pid, label in _marked_holders(name):
        inode = _ns_inode(pid)
        if inode is not None and inode != root_net:
            for p in _pids_in_netns(inode):
                if p != pid:
                    send_signal(p, signal.SIGCONT)
                    send_signal(p, signal.SIGKILL)
        send_signal(pid, signal.SIGKILL)
        removed.append(f"node {label} (holder pid {pid})")
    listing = _run(["ip", "netns", "list"], check=False).stdout.split()
    for ns in listing:
        if ns.endswith("-br") and (name is None or ns == f"{name}-br"):
            _run(["ip", "netns", "del", ns], check=False)
            removed.append(f"bridge namespace {ns}")
    return removed


def main(argv: list[str] | None = None) -> int:
    """The lab's command line (see the module docstring)."""
    p = argparse.ArgumentParser(prog="python -m disteval.testing.netlab", description=__doc__.split("\n\n")[0])
    p.add_argument("--name", default="dlab")
    p.add_argument("--base", default=DEFAULT_BASE)
    sub = p.add_subparsers(dest="cmd", required=True)
    up = sub.add_parser("up", help="start a lab (it stays until `down`)")
    up.add_argument("--nodes", type=int, default=2)
    up.add_argument("--second-net", action="store_true")
    sub.add_parser("down", help="stop the lab")
    sub.add_parser("cleanup", help="remove every lab's leftovers")
    sub.add_parser("status", help="print the lab's nodes")
    ex = sub.add_parser("exec", help="run a command in a node: exec n1 -- CMD ...")
    ex.add_argument("node")
    ex.add_argument("command", nargs=argparse.REMAINDER)
    a = p.parse_args(argv)
    if a.cmd == "cleanup":
        print("\n".join(cleanup_stale(None, a.base)) or "nothing to clean")
        return 0
    if a.cmd == "up":
        reason = NetLab.available()
        if reason:
            print(reason, file=sys.stderr)
            return 2
        lab = NetLab(nodes=a.nodes, name=a.name, base=a.base, second_net=a.second_net).start()
        print(json.dumps(lab.describe(), indent=1))
        return 0
    lab = attach(a.name, a.base)
    if a.cmd == "down":
        lab.stop()
        return 0
    if a.cmd == "status":
        print(json.dumps(lab.describe(), indent=1))
        return 0
    command = a.command[1:] if a.command[:1] == ["--"] else a.command
    return lab.run(a.node, command, capture_output=False, text=False, timeout=None).returncode


def attach(name: str = "dlab", base: str = DEFAULT_BASE) -> NetLab:
    """The running lab ``name`` (started by another process, e.g. ``up``), from its holders."""
    lab = NetLab(name=name, base=base)
    for pid, label in sorted(_marked_holders(name), key=lambda x: int(x[1].split(":n")[1])):
        node = label.split(":", 1)[1]
        i = int(node[1:])
        lab.members[node] = Node(node, i, pid, lab.dir / "nodes" / node, addr=f"{SUBNET}.{i}")
    if not lab.members:
        raise NetLabError(f"no lab named {name!r} is running (start one: python -m disteval.testing.netlab up)")
    lab.nodes = len(lab.members)
    return lab


def _cli() -> int:
    try:
        return main()
    except NetLabError as exc:
        print(f"netlab: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(_cli())
