"""A network namespace joined to this one by a veth pair, for tests of a real network cut: a process run inside it
(a node, or the coordinator) is cut off when the link is set down (every packet lost both ways, no connection
closed, as when a cable or a switch port goes) and reconnected when it is set up again. Needs root and iproute2;
a test that asks for one where it cannot be made is skipped, saying why."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
from dataclasses import dataclass
from typing import Iterator

import pytest

__all__ = ["NamespaceLink", "namespace_link"]


@dataclass(frozen=True)
class NamespaceLink:
    namespace: str
    host_if: str  # this namespace's end of the link
    host_ip: str
    inner_if: str
    inner_ip: str

    def command(self, program: str) -> list[str]:
        """`program` run inside the namespace (ip execs it: the process started is the program itself)."""
        return ["ip", "netns", "exec", self.namespace, program]

    def cut(self) -> None:
        subprocess.run(["ip", "link", "set", self.host_if, "down"], check=True)

    def restore(self) -> None:
        subprocess.run(["ip", "link", "set", self.host_if, "up"], check=True)


@contextlib.contextmanager
def namespace_link() -> Iterator[NamespaceLink]:
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("a network cut needs root and iproute2 (ip) to make a network namespace")
    pid = os.getpid()
    tag = str(pid % 100000)
    namespace, host_if, inner_if = f"rcy{tag}", f"rcyh{tag}", f"rcyn{tag}"
    subnet = f"10.{200 + pid % 50}.{pid // 50 % 250}"
    steps = [["ip", "netns", "add", namespace],
             ["ip", "link", "add", host_if, "type", "veth", "peer", "name", inner_if],
             ["ip", "link", "set", inner_if, "netns", namespace],
             ["ip", "addr", "add", f"{subnet}.1/24", "dev", host_if], ["ip", "link", "set", host_if, "up"],
             ["ip", "netns", "exec", namespace, "ip", "addr", "add", f"{subnet}.2/24", "dev", inner_if],
             ["ip", "netns", "exec", namespace, "ip", "link", "set", inner_if, "up"],
             ["ip", "netns", "exec", namespace, "ip", "link", "set", "lo", "up"]]
    try:
        for step in steps:
            made = subprocess.run(step, capture_output=True, text=True)
            if made.returncode != 0:
                if step is steps[0]:
                    pytest.skip(f"no network namespace here ({' '.join(step)}: {made.stderr.strip()})")
                raise AssertionError(f"{' '.join(step)} failed: {made.stderr}")
        yield NamespaceLink(namespace, host_if, f"{subnet}.1", inner_if, f"{subnet}.2")
    finally:
        subprocess.run(["ip", "link", "del", host_if], capture_output=True)
        subprocess.run(["ip", "netns", "del", namespace], capture_output=True)
