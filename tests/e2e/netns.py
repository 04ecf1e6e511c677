"""Two "hosts" on one machine: network namespaces, a veth pair, nftables, a system user.

Theory of operation
-------------------
:func:`two_hosts` builds, in order, and tears down in reverse order even when a
later step fails:

1. two network namespaces with names unique to the run (``<prefix>-h-<hex>``
   for the harness, ``<prefix>-w-<hex>`` for the workspace), loopback up in each;
2. a veth pair, one end moved into each namespace, with the two usable
   addresses of a random ``10.231.x.y/30`` block (private to these namespaces:
   no address is ever configured outside them);
3. in the workspace namespace, an nftables table whose output chain accepts
   packets of established or related connections and rejects every *new*
   connection toward the harness address, so the harness may connect to the
   workspace (and the replies flow back) while nothing in the workspace can
   open a connection to the harness.

Teardown kills whatever still runs in the namespaces (by PID, from
``ip netns pids``), deletes the nftables table and the namespaces; deleting a
namespace destroys the veth end inside it, and with it the pair.

:func:`system_user` creates a ``useradd --system`` account with a unique name
and removes it (after killing, by PID, any process still running as its uid).

Every failure to build something raises :class:`HostsUnavailable`, which the
tests turn into a skip with the reason.
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import pwd
import secrets
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

TOOLS = ("ip", "nft", "setpriv", "useradd", "userdel")
"""Programs the two-host tests need."""

_TIMEOUT = 30.0
_NETWORK = ipaddress.IPv4Network("10.231.0.0/16")


class HostsUnavailable(Exception):
    """The namespaces, the firewall or the user cannot be set up here (the reason)."""


def missing_tools() -> list[str]:
    """Names of the needed programs that are not on PATH."""
    return [tool for tool in TOOLS if shutil.which(tool) is None]


def _run(argv: Sequence[str], *, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        list(argv),
        input=stdin,
        capture_output=True,
        text=True,
        timeout=_TIMEOUT,
        check=False,
        stdin=None if stdin is not None else subprocess.DEVNULL,
    )


def _must(argv: Sequence[str], *, stdin: str | None = None) -> str:
    result = _run(argv, stdin=stdin)
    if result.returncode != 0:
        detail = (result.stderr or result.stdout).strip()[-500:]
        raise HostsUnavailable(f"{' '.join(argv)} failed ({result.returncode}): {detail}")
    return result.stdout


@dataclass(frozen=True, slots=True)
class TwoHosts:
    """The harness and workspace namespaces and how they are joined."""

    harness_ns: str
    workspace_ns: str
    harness_if: str
    workspace_if: str
    harness_addr: str
    workspace_addr: str
    nft_table: str

    def in_harness(self, argv: Sequence[str]) -> list[str]:
        """``argv`` run in the harness namespace."""
        return ["ip", "netns", "exec", self.harness_ns, *argv]

    def in_workspace(self, argv: Sequence[str]) -> list[str]:
        """``argv`` run in the workspace namespace."""
        return ["ip", "netns", "exec", self.workspace_ns, *argv]


def nft_ruleset(table: str, harness_addr: str) -> str:
    """The workspace's ruleset: no new connection from the workspace to the harness."""
    return (
        f"table inet {table} {{\n"
        "    chain output {\n"
        "        type filter hook output priority 0; policy accept;\n"
        "        ct state established,related accept\n"
        f"        ip daddr {harness_addr} meta l4proto tcp ct state new reject with tcp reset\n"
        f"        ip daddr {harness_addr} ct state new reject\n"
        "    }\n"
        "}\n"
    )


def namespace_pids(name: str) -> list[int]:
    """PIDs of the processes whose network namespace is ``name`` (empty when it is gone)."""
    result = _run(["ip", "netns", "pids", name])
    if result.returncode != 0:
        return []
    return [int(word) for word in result.stdout.split() if word.isdigit()]


def kill_pids(pids: Sequence[int], *, timeout: float = 10.0) -> None:
    """SIGKILL each PID and wait until it is gone or a zombie (never ``os.getpid()``)."""
    mine = os.getpid()
    targets = [pid for pid in pids if pid not in (mine, 1)]
    for pid in targets:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and any(is_alive(pid) for pid in targets):
        time.sleep(0.02)


def is_alive(pid: int) -> bool:
    """True when ``pid`` exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as handle:
            stat = handle.read()
    except OSError:
        return False
    # The state follows the parenthesised command name, which may contain spaces.
    state = stat[stat.rfind(b")") + 2 : stat.rfind(b")") + 3]
    return state not in (b"Z", b"X", b"")


def pids_of_uid(uid: int) -> list[int]:
    """Live PIDs whose real or effective uid is ``uid``."""
    found: list[int] = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/status") as handle:
                for line in handle:
                    if line.startswith("Uid:"):
                        real, effective = (int(v) for v in line.split()[1:3])
                        if uid in (real, effective) and is_alive(int(name)):
                            found.append(int(name))
                        break
        except (OSError, ValueError):
            continue
    return found


def _addresses() -> tuple[str, str]:
    block = secrets.randbelow(_NETWORK.num_addresses // 4)
    base = _NETWORK.network_address + 4 * block
    return str(base + 1), str(base + 2)


@contextlib.contextmanager
def two_hosts(prefix: str = "sx") -> Iterator[TwoHosts]:
    """Build the two namespaces, the veth pair and the workspace firewall; remove them after."""
    tag = secrets.token_hex(3)
    harness_addr, workspace_addr = _addresses()
    hosts = TwoHosts(
        harness_ns=f"{prefix}-h-{tag}",
        workspace_ns=f"{prefix}-w-{tag}",
        harness_if=f"{prefix}h{tag}"[:15],
        workspace_if=f"{prefix}w{tag}"[:15],
        harness_addr=harness_addr,
        workspace_addr=workspace_addr,
        nft_table=f"{prefix}_fw_{tag}",
    )
    made_ns: list[str] = []
    made_link = False
    made_table = False
    try:
        for name in (hosts.harness_ns, hosts.workspace_ns):
            _must(["ip", "netns", "add", name])
            made_ns.append(name)
            _must(["ip", "-n", name, "link", "set", "lo", "up"])
        _must(
            [
                "ip",
                "link",
                "add",
                hosts.harness_if,
                "type",
                "veth",
                "peer",
                "name",
                hosts.workspace_if,
            ]
        )
        made_link = True
        for ns, ifname, addr in (
            (hosts.harness_ns, hosts.harness_if, harness_addr),
            (hosts.workspace_ns, hosts.workspace_if, workspace_addr),
        ):
            _must(["ip", "link", "set", ifname, "netns", ns])
            _must(["ip", "-n", ns, "addr", "add", f"{addr}/30", "dev", ifname])
            _must(["ip", "-n", ns, "link", "set", ifname, "up"])
        made_link = False  # from here on the namespaces own both ends
        _must(
            ["ip", "netns", "exec", hosts.workspace_ns, "nft", "-f", "-"],
            stdin=nft_ruleset(hosts.nft_table, harness_addr),
        )
        made_table = True
        yield hosts
    finally:
        for name in made_ns:
            kill_pids(namespace_pids(name))
        if made_table:
            _run(hosts.in_workspace(["nft", "delete", "table", "inet", hosts.nft_table]))
        if made_link:
            _run(["ip", "link", "del", hosts.harness_if])
        for name in reversed(made_ns):
            _run(["ip", "netns", "del", name])


@dataclass(frozen=True, slots=True)
class SystemUser:
    """An account made for one test run."""

    name: str
    uid: int
    gid: int


@contextlib.contextmanager
def system_user(prefix: str = "sxw") -> Iterator[SystemUser]:
    """A new ``useradd --system`` user with its own group; killed and deleted afterwards."""
    name = f"{prefix}{secrets.token_hex(4)}"
    _must(
        [
            "useradd",
            "--system",
            "--user-group",
            "--no-create-home",
            "--home-dir",
            "/nonexistent",
            "--shell",
            "/usr/sbin/nologin",
            name,
        ]
    )
    try:
        entry = pwd.getpwnam(name)
        yield SystemUser(name=name, uid=entry.pw_uid, gid=entry.pw_gid)
    finally:
        with contextlib.suppress(KeyError):
            kill_pids(pids_of_uid(pwd.getpwnam(name).pw_uid))
        _run(["userdel", name])
        # userdel removes the user's private group; remove it if it did not.
        if shutil.which("groupdel") and _run(["getent", "group", name]).returncode == 0:
            _run(["groupdel", name])
