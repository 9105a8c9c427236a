"""Processes and the ports they listen on, read from /proc (Linux): what a test that
stops a stack, or the end of the suite, checks is gone."""

from __future__ import annotations

import os
from pathlib import Path


def listeners(pid: int) -> set[tuple[str, int]]:
    """(address, port) of every TCP socket in LISTEN state that ``pid`` holds."""
    return set(listener_sockets(pid).values())


def listener_sockets(pid: int) -> dict[str, tuple[str, int]]:
    """Socket inode -> (address, port) of every TCP socket in LISTEN state ``pid`` holds.
    An inode outlives the process while another still holds the socket."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:  # closed meanwhile
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    return {i: a for i, a in _listening(Path(f"/proc/{pid}/net")).items() if i in inodes}


def _listening(net: Path) -> dict[str, tuple[str, int]]:
    """Inode -> (address, port) of the TCP sockets in LISTEN state in ``net`` (a
    /proc/.../net folder: its network namespace)."""
    found = {}
    for table in ("tcp", "tcp6"):
        for line in (net / table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] != "0A":  # 0A: LISTEN
                continue
            address, port = fields[1].split(":")
            raw = bytes.fromhex(address)
            if table == "tcp":
                host = ".".join(str(b) for b in reversed(raw))
            else:  # four little-endian words
                words = b"".join(raw[i : i + 4][::-1] for i in range(0, 16, 4))
                host = ":".join(words[i : i + 2].hex() for i in range(0, 16, 2))
            found[fields[9]] = (host, int(port, 16))
    return found


def is_loopback_address(host: str) -> bool:
    """127.0.0.0/8 or ::1 (and IPv4 loopback mapped into IPv6), as ``listeners`` writes them."""
    return (
        host.startswith("127.")
        or host == "0000:" * 7 + "0001"
        or host.startswith("0000:" * 5 + "ffff:7f")
    )


def listening_inodes() -> set[str]:
    """The inodes of every listening TCP socket on this machine (this namespace)."""
    return set(_listening(Path("/proc/net")))


def processes_with_env(entry: bytes) -> dict[int, str]:
    """Live processes (not zombies) whose environment holds ``entry`` (``NAME=value``):
    pid -> command line. Processes of other users, unreadable, are left out."""
    found = {}
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            if entry not in (proc / "environ").read_bytes().split(b"\0"):
                continue
            if (proc / "stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
                continue  # exited, waiting for its parent to reap it
            found[int(proc.name)] = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:  # gone meanwhile, or not ours to read
            continue
    return found
