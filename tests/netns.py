"""Nodes on one machine for the memory tier's multi-node tests (docs/memory-tier.md, "How it
is tested"): each node is a network namespace joined by a veth pair to a bridge in the root
namespace, where the service listens on the bridge's address. A node runs processes (its
`lastgood agent`, a rank) with `ip netns exec`, has its own shm root, and is "killed" the way a
machine fails: every process of the namespace SIGKILLed, then the namespace and its shm root
removed, so its segments vanish with it. A spare is a fresh namespace.

Traffic stays on the bridge (a private /24 picked per fabric) and loopback. Where namespaces
cannot be made (not root, no `ip`, a container without CAP_NET_ADMIN) the tests skip with the
reason; under CI=true they fail, as the other environment checks do.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

AGENT_PORT = 7300          # every node has its own port space: the agents all listen on this one
SHM_BASE = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path("/tmp")


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=30)


def netns_unavailable() -> str | None:
    """Why namespaces cannot be made here, or None."""
    if shutil.which("ip") is None:
        return "no `ip` command (iproute2) on this machine"
    if os.geteuid() != 0:
        return "network namespaces need root (CAP_NET_ADMIN)"
    probe = f"lgprobe{uuid.uuid4().hex[:6]}"
    got = _ip("netns", "add", probe, check=False)
    if got.returncode != 0:
        return f"`ip netns add` failed: {got.stderr.strip()[:200]}"
    _ip("netns", "del", probe, check=False)
    return None


def require_netns() -> None:
    why = netns_unavailable()
    if why:
        if os.environ.get("CI") == "true":  # as the other environment checks: CI must run it
            pytest.fail(why)
        pytest.skip(why)


def mac_of(ip: str) -> str:
    """A locally administered MAC that follows the IPv4 address."""
    return "02:00:" + ":".join(f"{int(b):02x}" for b in ip.split("."))


class Node:
    """One namespace: its veth address, its shm root, the processes started in it."""

    def __init__(self, fabric: "Fabric", index: int, label: str) -> None:
        self.fabric, self.label = fabric, label
        self.ns = f"lg{fabric.tag}n{index}"
        self.veth = f"lv{fabric.tag}{index}"          # the root side; the node's side is eth0
        self.ip = f"{fabric.prefix}.{10 + index}"
        self.shm_root = SHM_BASE / f"lastgood-netns-{self.ns}"
        self.procs: list[subprocess.Popen] = []
        self.agent_address = f"{self.ip}:{AGENT_PORT}"
        self.agent_id: int | None = None
        self.agent_pid: int | None = None
        self.alive = False

    def create(self) -> "Node":
        _ip("netns", "add", self.ns)
        self.alive = True
        _ip("link", "add", self.veth, "type", "veth", "peer", "name", f"{self.veth}p")
        _ip("link", "set", f"{self.veth}p", "netns", self.ns)
        _ip("-n", self.ns, "link", "set", f"{self.veth}p", "name", "eth0")
        _ip("link", "set", self.veth, "master", self.fabric.bridge, "up")
        # the MAC follows the address: a spare that takes a lost node's address is reached at
        # once by peers whose neighbour cache still holds the lost node's entry
        _ip("-n", self.ns, "link", "set", "eth0", "address", mac_of(self.ip))
        _ip("-n", self.ns, "addr", "add", f"{self.ip}/24", "dev", "eth0")
        _ip("-n", self.ns, "link", "set", "eth0", "up")
        _ip("-n", self.ns, "link", "set", "lo", "up")
        self.shm_root.mkdir(mode=0o700)
        return self

    def popen(self, cmd: list[str], **kw) -> subprocess.Popen:
        env = {**os.environ, **kw.pop("env", {})}
        proc = subprocess.Popen(["ip", "netns", "exec", self.ns, *cmd], env=env, **kw)
        self.procs.append(proc)
        return proc

    def python(self, *args: str, timeout: float = 60.0) -> subprocess.CompletedProcess:
        """Run `python args...` in the node to its end."""
        proc = self.popen([sys.executable, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
        return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)

    def start_agent(self, *extra: str) -> "Node":
        """`lastgood agent` of this node, registered with the fabric's service over the veth."""
        svc = self.fabric.service
        cmd = [sys.executable, "-m", "lastgood.cli", "--url", svc.url, "agent", "--host", self.label,
               "--listen", self.agent_address, "--shm-root", str(self.shm_root), "--live-every", "0.3", *extra]
        proc = self.popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          env={"LASTGOOD_TOKEN": self.fabric.token})
        line = proc.stdout.readline()
        assert line, f"the agent of {self.label} did not start: {proc.stderr.read()[-2000:]}"
        started = json.loads(line)
        assert started["address"] == self.agent_address, started
        self.agent_id, self.agent_pid = started["agent_id"], proc.pid  # `ip netns exec` execs the agent
        return self

    def pids(self) -> list[int]:
        got = _ip("netns", "pids", self.ns, check=False)
        return [int(p) for p in got.stdout.split()]

    def _sigkill_all(self, spare: int | None = None) -> list[int]:
        """SIGKILL every process of the namespace but `spare`, until none is left (a process
        may fork while we kill); what is still alive after 50 rounds."""
        pids: list[int] = []
        for _ in range(50):
            pids = [p for p in self.pids() if p != spare]
            if not pids:
                return []
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.02)
        return pids

    def kill_job(self) -> None:
        """The node's training processes are killed (a torchrun group killed, a job preempted):
        SIGKILL every process of the namespace but its agent, which keeps its segments."""
        left = self._sigkill_all(spare=self.agent_pid)
        assert not left, f"{self.label}: processes still alive after SIGKILL: {left}"

    def kill(self) -> None:
        """The node fails: SIGKILL every process of the namespace (the agent included), then
        the namespace (its veth goes with it) and its shm root are gone."""
        if not self.alive:
            return
        self._sigkill_all()
        for proc in self.procs:
            try:
                proc.kill()
                proc.wait(10)
            except (OSError, subprocess.TimeoutExpired):
                pass
        _ip("netns", "del", self.ns, check=False)
        _ip("link", "del", self.veth, check=False)
        shutil.rmtree(self.shm_root, ignore_errors=True)
        self.alive = False


class Fabric:
    """A bridge, the service on its address (auth required: it listens beyond loopback), and
    the nodes made on it. `close()` removes everything, also after a failed setup."""

    def __init__(self, data_dir: Path, env: dict[str, str] | None = None) -> None:
        self.tag = uuid.uuid4().hex[:5]
        self.prefix = f"10.{random.randint(100, 250)}.{random.randint(0, 255)}"
        self.bridge = f"lgb{self.tag}"
        self.gateway = f"{self.prefix}.1"
        self.data_dir, self.env = data_dir, dict(env or {})
        self.nodes: list[Node] = []
        self.service = None
        self.admin = f"lg-netns-admin-{uuid.uuid4().hex}"
        self.token = ""

    def open(self) -> "Fabric":
        try:
            _ip("link", "add", self.bridge, "type", "bridge")
            # a fixed MAC: a bridge otherwise takes its lowest port's, and a node joining
            # would change the gateway's address under the nodes' neighbour caches
            _ip("link", "set", self.bridge, "address", mac_of(self.gateway))
            _ip("addr", "add", f"{self.gateway}/24", "dev", self.bridge)
            _ip("link", "set", self.bridge, "up")
            self._start_service()
        except BaseException:
            self.close()
            raise
        return self

    def _start_service(self) -> None:
        import httpx

        from .conftest import FAST, ServiceProc

        gateway = self.gateway

        class BridgedService(ServiceProc):
            @property
            def url(self) -> str:
                return f"http://{gateway}:{self.port}"

        self.service = BridgedService(self.data_dir, {**FAST, "LASTGOOD_HOST": gateway, "LASTGOOD_GRPC_HOST": gateway,
                                                      "LASTGOOD_AUTH_REQUIRED": "true",
                                                      "LASTGOOD_ADMIN_TOKEN": self.admin, **self.env}).start()
        r = httpx.post(f"{self.service.url}/api/v1/tokens", json={"name": "netns-writer", "role": "admin"},
                       headers={"Authorization": f"Bearer {self.admin}"}, timeout=30)
        assert r.status_code == 200, r.text
        self.token = r.json()["token"]

    def node(self, label: str, replaces: Node | None = None) -> Node:
        """A fresh namespace on the bridge (not yet running anything); a spare that `replaces`
        a killed node gets that node's address (its agent's registration replaces the dead one's)."""
        node = Node(self, len(self.nodes), label)
        if replaces is not None:
            assert not replaces.alive, "a spare replaces a node that is gone"
            node.ip, node.agent_address = replaces.ip, replaces.agent_address
        self.nodes.append(node)
        try:
            return node.create()
        except BaseException:
            node.kill()
            raise

    def close(self) -> None:
        for node in self.nodes:
            node.kill()
        if self.service is not None:
            self.service.stop()
        _ip("link", "del", self.bridge, check=False)


@pytest.fixture
def fabric(tmp_path):
    require_netns()
    fab = Fabric(tmp_path / "svc").open()
    yield fab
    fab.close()
