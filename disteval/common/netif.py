"""Which interface and address a rank uses to reach its peers, and the checks that catch the classic
multi-node mistakes before a rendezvous hangs.

gloo and NCCL pick their interface from ``GLOO_SOCKET_IFNAME`` / ``NCCL_SOCKET_IFNAME``; without them gloo
binds the address the hostname resolves to, which on many machines is 127.0.1.1 (Debian's /etc/hosts) and
makes the full mesh fail with ``connectFullMesh failed ... remote=[127.0.0.1]``. disteval sets both to the
interface that routes to the rendezvous address (``route_to``) unless the user set them, and records host,
interface and address per rank (``identity``).
"""
from __future__ import annotations

import fcntl
import ipaddress
import os
import socket
import struct
from pathlib import Path

SIOCGIFADDR = 0x8915
IFNAME_VARS = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")


def resolve(host: str) -> str | None:
    """``host``'s IPv4 address (as the system resolver returns it: /etc/hosts, DNS), None when it has none."""
    try:
        return socket.gethostbyname(host)
    except OSError:
        return None


def is_loopback(addr: str | None) -> bool:
    try:
        return addr is not None and ipaddress.ip_address(addr).is_loopback
    except ValueError:
        return False


def interface_addresses() -> dict[str, str]:
    """{interface name: IPv4 address} of this network namespace's interfaces that have one."""
    out = {}
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:
                packed = fcntl.ioctl(s.fileno(), SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
            except OSError:  # no IPv4 address on it
                continue
            out[name] = socket.inet_ntoa(packed[20:24])
    return out


def route_to(host: str, port: int = 9) -> tuple[str, str] | None:
    """(interface, source address) this machine uses to reach ``host`` (the kernel's route choice, read by
    connecting a UDP socket: no packet is sent); None when ``host`` does not resolve or has no route."""
    addr = resolve(host)
    if addr is None:
        return None
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((addr, port or 9))
            source = s.getsockname()[0]
    except OSError:
        return None
    for name, a in interface_addresses().items():
        if a == source:
            return name, source
    return None


def apply_socket_ifname(master_addr: str | None) -> dict:
    """Set GLOO_SOCKET_IFNAME and NCCL_SOCKET_IFNAME in this process to the interface routing to
    ``master_addr`` where the user has not set them (before the process group is created). Returns
    {interface, address, source}: source "user" (a variable was set), "route" or None (no route found: the
    libraries' own choice stands)."""
    user = {v: os.environ[v] for v in IFNAME_VARS if os.environ.get(v)}
    if user:
        name = user.get("GLOO_SOCKET_IFNAME") or user.get("NCCL_SOCKET_IFNAME")
        return {"interface": name, "address": interface_addresses().get(name.split(",")[0]), "source": "user"}
    found = route_to(master_addr) if master_addr else None
    if found is None:
        return {"interface": None, "address": None, "source": None}
    for var in IFNAME_VARS:
        os.environ[var] = found[0]
    return {"interface": found[0], "address": found[1], "source": "route"}


def node_id() -> str:
    """This node's identity for liveness: hostname, boot id and network namespace. Two namespaced "nodes" on
    one kernel share the boot id but not the namespace; a pid is only meaningful on the node that recorded
    it."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()[:8]
    except OSError:
        boot = "noboot"
    try:
        netns = os.stat("/proc/self/ns/net").st_ino
    except OSError:
        netns = 0
    return f"{socket.gethostname()}/{boot}/{netns}"


def loopback_hostname_error(rendezvous_host: str, local_addr: str | None) -> str | None:
    """The error message for a multi-node job on a node whose hostname resolves to a loopback address (other
    nodes would be told to reach it there), or None when the hostname is fine or ``local_addr`` (the address
    this node advertises, ``dist.local_addr``) overrides it. The message names the node, the hostname, what it
    resolves to, the address on the route to ``rendezvous_host`` and the settings that fix it."""
    if local_addr:
        return None
    host = socket.gethostname()
    addr = resolve(host)
    if not is_loopback(addr):
        return None
    route = route_to(rendezvous_host)
    fix = (f"set dist.local_addr={route[1]} (the address of {route[0]}, which routes to the rendezvous host "
           f"{rendezvous_host}; torchrun: --local-addr {route[1]}) or map {host} to {route[1]} in /etc/hosts"
           if route else f"set dist.local_addr=<this node's address reachable from the other nodes> or map {host} "
           "to that address in /etc/hosts")
    return (f"node {host}: its hostname {host!r} resolves to {addr}, a loopback address, so the other nodes would "
            f"be told to reach it at {addr} and the rendezvous would hang or fail; {fix}")
