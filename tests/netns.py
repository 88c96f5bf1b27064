"""Another machine on this one: a network namespace joined to this one by a veth pair, for
tests and benchmarks that need a second address (an attacker, node 1 of a two-node run)
or a link to cut.

    machine = Machine("pld", "10.213.78")   # here 10.213.78.1, inside .2
    if machine.why: pytest.skip(machine.why)
    subprocess.Popen(machine.run(["plait", ...]))   # a process inside the namespace
    machine.cut()   # its end of the link down: no FIN, no RST, as a machine losing power
    machine.up(); machine.close()

Only the privilege (root, ``ip``) is a reason to go without one: as root, a command that
fails is the caller's failure, raised. Subnets in use: 10.213.77 test_security,
10.213.78 test_resilience, 10.213.79 benchmarks/resilience.py.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys


class Machine:
    def __init__(self, tag: str, subnet: str):
        pid = os.getpid()
        self.name = f"plait{tag}{pid}"
        self.host_if, self.ns_if = f"{tag}{pid % 10**6}", f"{tag}ns"  # <= 15 characters
        self.host_ip, self.ns_ip = f"{subnet}.1", f"{subnet}.2"
        self.why: str | None = None
        if os.geteuid() != 0 or shutil.which("ip") is None:
            self.why = (f"uid {os.geteuid()}, ip {shutil.which('ip') or 'missing'}: network "
                        "namespaces need root and ip")  # fmt: skip
            return
        if subprocess.run(["ip", "netns", "list"], capture_output=True).returncode:
            self.why = "ip netns is not available here"
            return
        for cmd in (["ip", "netns", "add", self.name],
                    ["ip", "link", "add", self.host_if, "type", "veth", "peer", "name", self.ns_if],
                    ["ip", "link", "set", self.ns_if, "netns", self.name],
                    ["ip", "addr", "add", f"{self.host_ip}/24", "dev", self.host_if],
                    ["ip", "link", "set", self.host_if, "up"],
                    self.run(["ip", "addr", "add", f"{self.ns_ip}/24", "dev", self.ns_if]),
                    self.run(["ip", "link", "set", "lo", "up"])):  # fmt: skip
            subprocess.run(cmd, check=True, capture_output=True)
        self.up()

    def run(self, cmd: list[str]) -> list[str]:
        """``cmd`` run inside the namespace (``ip netns exec`` execs it: the same pid)."""
        return ["ip", "netns", "exec", self.name, *cmd]

    def _link(self, state: str) -> None:
        subprocess.run(self.run(["ip", "link", "set", self.ns_if, state]), check=True,
                       capture_output=True)  # fmt: skip

    def cut(self) -> None:
        self._link("down")

    def up(self) -> None:
        self._link("up")

    def reachable(self, port: int) -> bool:
        """Whether this machine's ``port`` accepts a connection from inside."""
        probe = (f"import socket\ntry:\n socket.create_connection(('{self.host_ip}', {port}), "
                 "timeout=3).close(); print('open')\nexcept OSError as e: print(type(e).__name__)")  # fmt: skip
        r = subprocess.run(self.run([sys.executable, "-c", probe]), capture_output=True,
                           text=True, timeout=30)  # fmt: skip
        return r.stdout.strip() == "open"

    def close(self) -> None:
        subprocess.run(["ip", "link", "del", self.host_if], capture_output=True)
        subprocess.run(["ip", "netns", "del", self.name], capture_output=True)
