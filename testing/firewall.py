"""Dropping packets for real, for the tests of partitions and unreachable services.

``DropRules`` adds iptables DROP rules to the OUTPUT chain (a loopback packet passes it once, when
sent, so one rule cuts a direction for the sender and the receiver alike), each tagged with a
comment of its own, and deletes exactly those (``heal``). ``iptables_unusable`` says why this
process cannot use them (iptables missing, or no right to change the firewall: root or
CAP_NET_ADMIN), for a test to skip with that reason.
"""

from __future__ import annotations

import shutil
import subprocess
import uuid

UNUSED_ADDRESS = "127.0.2.254"  # what the usability check drops: nothing listens there


class DropRules:
    """Tagged iptables DROP rules in OUTPUT; ``heal`` deletes them (also after a failed ``add``)."""

    def __init__(self) -> None:
        self.tag = f"oobleck-test-{uuid.uuid4().hex[:8]}"
        self.installed: list[list[str]] = []

    def add(self, *match: str) -> None:
        """A rule dropping the packets ``match`` selects (iptables match options, e.g. ``-d ADDR``)."""
        rule = ["OUTPUT", *match, "-m", "comment", "--comment", self.tag, "-j", "DROP"]
        subprocess.run(["iptables", "-I", *rule], check=True, capture_output=True)
        self.installed.append(rule)

    def drop_tcp_port(self, host: str, port: int) -> None:
        """Every TCP packet from or to ``host:port``."""
        self.add("-p", "tcp", "-s", host, "--sport", str(port))
        self.add("-p", "tcp", "-d", host, "--dport", str(port))

    def heal(self) -> None:
        while self.installed:
            subprocess.run(["iptables", "-D", *self.installed.pop()], check=False, capture_output=True)


def iptables_unusable() -> str | None:
    """Why this process cannot drop packets with iptables, or None when it can."""
    if shutil.which("iptables") is None:
        return "iptables is not installed (apt-get install iptables)"
    probe = DropRules()
    try:
        probe.add("-d", UNUSED_ADDRESS)
    except subprocess.CalledProcessError as error:
        return f"iptables refused a DROP rule: {error.stderr.decode(errors='replace').strip()}"
    finally:
        probe.heal()
    return None
