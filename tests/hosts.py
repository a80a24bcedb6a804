"""Several network hosts on this one machine, for the layouts docs/training.md advertises across machines.

Each host is a network namespace (``ip netns``) with its own loopback, its own address on one switch (a bridge in
a namespace of its own, every host joined to it by a veth pair) and its own view of the disk: a process started on
a host sees the bed's ``shared/`` folder (the shared disk) unless the host has none, and its own ``local/<host>/``
folder but no other host's (each hidden under an empty tmpfs in the process's mount namespace, which
``ip netns exec`` makes private). The test process itself is a host too, :attr:`HostBed.here` (the root namespace,
joined to the switch the same way): what runs in-process — a trainer, a client — runs there.

    with HostBed(["server", "learner"], no_shared_disk={"learner"}) as bed:
        srv = bed["server"].popen(["python", "-m", "http.server", "--bind", bed["server"].addr, "8000"])
        bed["server"].cut()     # a network partition: the host's switch port goes down
        bed["server"].heal()

Needs root and iproute2 (CI runs as root); :func:`unavailable` says why not. Everything is torn down on exit:
processes (each host's process groups, then anything left in its namespace), namespaces, links. A bed a crashed
run left behind (its pid dead) is removed by the next bed.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

__all__ = ["Host", "HostBed", "unavailable"]

PREFIX = "pvt"  # every name this module makes starts with it (namespaces, links)
SUBNET = "10.213"  # 10.213.K.0/24, K chosen per bed: an address plan no real network here uses


def unavailable() -> str | None:
    """Why namespaced hosts cannot be made here (None when they can)."""
    if os.geteuid() != 0:
        return "multi-host tests need root (ip netns); CI runs as root"
    if shutil.which("ip") is None or shutil.which("unshare") is None:
        return "multi-host tests need iproute2's `ip` and util-linux's `unshare` (apt-get install iproute2)"
    probe = f"{PREFIX}{os.getpid()}-probe"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"cannot make a network namespace here: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    done = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if check and done.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {done.stderr.strip()}")
    return done


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale() -> None:
    """Remove the namespaces (and with them their links) of beds whose process is gone."""
    listed = _ip("netns", "list", check=False).stdout
    for name in re.findall(rf"^({PREFIX}(\d+)-\S+)", listed, flags=re.M):
        if not _alive(int(name[1])):
            _kill_namespace(name[0])
    for link in re.findall(rf"^\d+: ({PREFIX}(\d+)h[^:@]*)", _ip("-o", "link", check=False).stdout, flags=re.M):
        if not _alive(int(link[1])):
            _ip("link", "del", link[0], check=False)


def _kill_namespace(ns: str) -> None:
    pids = _ip("netns", "pids", ns, check=False).stdout.split()
    for pid in pids:
        try:
            os.kill(int(pid), signal.SIGKILL)
        except (ProcessLookupError, ValueError):
            pass
    _ip("netns", "del", ns, check=False)


class Host:
    """One host of a :class:`HostBed`: ``name``, ``addr`` (its address on the switch), ``iface`` (its interface,
    what ``GLOO_SOCKET_IFNAME`` names), ``local`` (its own disk) and whether it sees the shared disk."""

    def __init__(self, bed: HostBed, name: str, index: int, shared_disk: bool, namespace: str | None):
        self.bed, self.name, self.shared_disk, self.namespace = bed, name, shared_disk, namespace
        self.addr = f"{bed.subnet}.{index}"
        self.iface = "eth0" if namespace else f"{PREFIX}{os.getpid()}h{index}"
        self.port = f"{PREFIX}{os.getpid()}s{index}"  # its port on the switch
        self.local = bed.root / "local" / name
        self.local.mkdir(parents=True, exist_ok=True)

    def __repr__(self) -> str:
        return f"Host({self.name!r}, {self.addr})"

    def url(self, port: int) -> str:
        return f"http://{self.addr}:{port}"

    def argv(self, argv: list[str]) -> list[str]:
        """``argv`` as run on this host: in its namespace, with the other hosts' disks (and the shared one, if it
        has none) out of sight."""
        if self.namespace is None:
            return list(argv)
        hidden = [h.local for h in self.bed.hosts if h is not self] + ([] if self.shared_disk else [self.bed.shared])
        mounts = "".join(f"mount -t tmpfs -o size=1m none {shlex.quote(str(p))} && " for p in hidden)
        return ["ip", "netns", "exec", self.namespace, "sh", "-c", mounts + 'exec "$@"', "sh", *argv]

    def popen(self, argv: list[str], env: dict | None = None, log: Path | None = None, **kw) -> subprocess.Popen:
        """Start ``argv`` on this host (its own process group, killed when the bed closes); output to ``log``."""
        out = open(log, "ab") if log is not None else subprocess.DEVNULL  # noqa: SIM115 (the child owns it)
        try:
            proc = subprocess.Popen(self.argv(argv), env=env, stdout=out, stderr=subprocess.STDOUT,
                                    start_new_session=True, **kw)
        finally:
            if log is not None:
                out.close()
        self.bed.procs.append(proc)
        return proc

    def run(self, argv: list[str], env: dict | None = None, timeout: float = 120, **kw) -> subprocess.CompletedProcess:
        return subprocess.run(self.argv(argv), env=env, capture_output=True, text=True, timeout=timeout, **kw)

    def cut(self) -> None:
        """A network partition: the host's port on the switch goes down (packets to and from it are lost; no
        connection is told)."""
        _ip("-n", self.bed.switch, "link", "set", self.port, "down")

    def heal(self) -> None:
        _ip("-n", self.bed.switch, "link", "set", self.port, "up")


class HostBed:
    """``names`` hosts, each in its own network namespace, plus :attr:`here` (this process), on one switch; the
    hosts in ``no_shared_disk`` do not see :attr:`shared`. A context manager: everything goes on exit."""

    def __init__(self, names: list[str], root: Path | None = None, no_shared_disk: set[str] | frozenset = frozenset()):
        remove_stale()
        self.tag = f"{PREFIX}{os.getpid()}"
        self.own_root = root is None
        self.root = Path(root or tempfile.mkdtemp(prefix="paravt-hosts-"))
        self.shared = self.root / "shared"
        self.shared.mkdir(parents=True, exist_ok=True)
        self.procs: list[subprocess.Popen] = []
        self.hosts: list[Host] = []
        self.subnet = self._free_subnet()
        self.switch = f"{self.tag}-switch"
        try:
            _ip("netns", "add", self.switch)
            _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
            _ip("-n", self.switch, "link", "set", "br0", "up")
            self.here = self._join("here", 254, namespace=None, shared_disk=True)
            for i, name in enumerate(names, start=1):
                self._join(name, i, namespace=f"{self.tag}-{name}"[:40], shared_disk=name not in no_shared_disk)
        except BaseException:
            self.close()
            raise

    def _free_subnet(self) -> str:
        used = set(re.findall(rf"inet {re.escape(SUBNET)}\.(\d+)\.", _ip("-o", "addr", check=False).stdout))
        for k in [os.getpid() % 250 + 1, *range(1, 251)]:
            if str(k) not in used:
                return f"{SUBNET}.{k}"
        raise RuntimeError(f"no free {SUBNET}.K.0/24 subnet for a host bed")

    def _join(self, name: str, index: int, namespace: str | None, shared_disk: bool) -> Host:
        host = Host(self, name, index, shared_disk, namespace)
        inner = f"{self.tag}t{index}"  # made here, then moved and renamed
        _ip("link", "add", host.port, "type", "veth", "peer", "name", inner)
        _ip("link", "set", host.port, "netns", self.switch)
        _ip("-n", self.switch, "link", "set", host.port, "master", "br0")
        _ip("-n", self.switch, "link", "set", host.port, "up")
        if namespace is None:
            _ip("link", "set", inner, "name", host.iface)
            _ip("addr", "add", f"{host.addr}/24", "dev", host.iface)
            _ip("link", "set", host.iface, "up")
        else:
            _ip("netns", "add", namespace)
            _ip("link", "set", inner, "netns", namespace)
            _ip("-n", namespace, "link", "set", inner, "name", host.iface)
            _ip("-n", namespace, "addr", "add", f"{host.addr}/24", "dev", host.iface)
            _ip("-n", namespace, "link", "set", host.iface, "up")
            _ip("-n", namespace, "link", "set", "lo", "up")
        self.hosts.append(host)
        return host

    def __getitem__(self, name: str) -> Host:
        return next(h for h in self.hosts if h.name == name)

    def __enter__(self) -> HostBed:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        for proc in self.procs:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        for proc in self.procs:
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                pass
        for host in self.hosts:
            if host.namespace:
                _kill_namespace(host.namespace)
            else:
                _ip("link", "del", host.iface, check=False)
        _kill_namespace(self.switch)
        if self.own_root:
            shutil.rmtree(self.root, ignore_errors=True)


def torchrun(hosts: list[Host], argv: list[str], env: dict, timeout: float = 300,
             port: int = 29400) -> list[subprocess.CompletedProcess]:
    """``torch.distributed.run`` across ``hosts``, one process a host (a node each: ``--nnodes N --node_rank i``,
    the rendezvous at the first host's address), gloo bound to each host's own interface (``GLOO_SOCKET_IFNAME``,
    as on machines with several NICs); ``argv`` is what follows torchrun's own arguments. Every node's result,
    in node order (a node that outlives ``timeout`` is killed and reported with returncode -9)."""
    import sys

    logs, procs = [], []
    for rank, host in enumerate(hosts):
        log = host.bed.root / f"torchrun-{os.getpid()}-{len(host.bed.procs)}-{rank}.log"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(len(hosts)), "--node_rank", str(rank),
               "--nproc_per_node", "1", "--master_addr", hosts[0].addr, "--master_port", str(port), *argv]
        procs.append(host.popen(cmd, env={**env, "GLOO_SOCKET_IFNAME": host.iface}, log=log))
        logs.append(log)
    deadline = time.monotonic() + timeout
    out = []
    for proc, log in zip(procs, logs, strict=True):
        try:
            code = proc.wait(max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
            code = -9
        out.append(subprocess.CompletedProcess(proc.args, code, log.read_text(errors="replace"), ""))
    return out
