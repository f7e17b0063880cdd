"""Ports ``pagedkv serve`` is about to hand its children: checked before any child starts (a port that cannot be
bound fails serve at once, naming the flag, the address and the process holding it), and, while they start,
whether the listener on a port is the child's own (not a stranger's that merely answers connections).

The holder is found through /proc/net/tcp{,6} (the listening socket's inode) and /proc/*/fd (which process has that
socket open): Linux only, and only processes this user may look into; otherwise the message says it is unknown.
"""

from __future__ import annotations

import errno
import os
import socket
from pathlib import Path

PROC = Path("/proc")
LISTEN = "0A"  # the TCP state in /proc/net/tcp


class PortUnavailable(ValueError):
    """A port serve needs cannot be bound; the message is one line naming the flag, the address and the holder."""


def listening_inodes(port: int) -> set[int]:
    """Inodes of the sockets that listen on TCP ``port`` (any address, IPv4 or IPv6)."""
    inodes: set[int] = set()
    for table in ("tcp", "tcp6"):
        try:
            lines = (PROC / "net" / table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if len(fields) > 9 and fields[3] == LISTEN and int(fields[1].rsplit(":", 1)[1], 16) == port:
                inodes.add(int(fields[9]))
    return inodes


def socket_holders(inodes: set[int], among: set[int] | None = None) -> list[int]:
    """The pids (of ``among``, else all) that have one of these socket inodes open (those this user may see)."""
    wanted = {f"socket:[{i}]" for i in inodes}
    holders: list[int] = []
    if not wanted:
        return holders
    procs = [PROC / str(p) for p in among] if among is not None else list(PROC.iterdir())
    for proc in procs:
        if not proc.name.isdigit():
            continue
        try:
            for fd in (proc / "fd").iterdir():
                if os.readlink(fd) in wanted:
                    holders.append(int(proc.name))
                    break
        except OSError:
            continue
    return holders


def describe_pid(pid: int) -> str:
    """``pid 123 (python3 -m http.server 8000)``: the command line, cut to 80 characters."""
    try:
        argv = (PROC / str(pid) / "cmdline").read_bytes().split(b"\0")
        cmd = " ".join(a.decode(errors="replace") for a in argv if a)
    except OSError:
        cmd = ""
    if len(cmd) > 80:
        cmd = cmd[:77] + "..."
    return f"pid {pid} ({cmd})" if cmd else f"pid {pid}"


def holder_of(port: int) -> str:
    """Who listens on ``port``: ``pid 123 (cmd)``, or a sentence saying it cannot be seen."""
    pids = socket_holders(listening_inodes(port))
    if pids:
        return ", ".join(describe_pid(p) for p in sorted(pids)[:3])
    return f"a process this user cannot see (try: ss -ltnp 'sport = :{port}')"


def listens_in(port: int, pids: set[int]) -> bool:
    """Whether one of ``pids`` holds a socket listening on ``port``. True where /proc cannot tell (not Linux)."""
    if not (PROC / "net" / "tcp").exists():
        return True
    return bool(socket_holders(listening_inodes(port), pids))


def check_port(flag: str, host: str, port: int) -> None:
    """Raises PortUnavailable unless ``host:port`` can be bound now (as the server will: SO_REUSEADDR, so a port
    whose last connections linger in TIME_WAIT is free)."""
    if not 0 < port < 65536:
        raise PortUnavailable(f"{flag} {port}: not a TCP port (1-65535)")
    try:
        infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as err:
        raise PortUnavailable(f"{flag} {port}: cannot resolve the host {host!r}: {err.strerror}") from None
    family, _, _, _, address = infos[0]
    shown = f"[{address[0]}]:{port}" if family == socket.AF_INET6 else f"{address[0]}:{port}"
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(address)
        except OSError as err:
            if err.errno == errno.EADDRINUSE:
                raise PortUnavailable(f"{flag} {port}: {shown} is already in use by {holder_of(port)}; stop it "
                                      f"or choose another {flag}") from None
            if err.errno == errno.EACCES:
                raise PortUnavailable(f"{flag} {port}: binding {shown} is not permitted (ports below 1024 need "
                                      "privileges); choose a port of 1024 or more") from None
            raise PortUnavailable(f"{flag} {port}: cannot bind {shown}: {err.strerror}") from None


def check_ports(wanted: list[tuple[str, str, int]]) -> None:
    """Each (flag, host, port) in turn (a port of 0 is chosen by the child: skipped); the first failure raises."""
    for flag, host, port in wanted:
        if port:
            check_port(flag, host, port)


def tcp_targets(address: str) -> list[tuple[str, int]]:
    """The (host, port) pairs behind a client's --address: HOST:PORT, a comma-separated list, ipv4:/ipv6: lists,
    dns:///NAME:PORT (each a name to resolve)."""
    rest = address.split(":///", 1)[1] if ":///" in address else address
    if rest.startswith(("ipv4:", "ipv6:")):
        rest = rest.split(":", 1)[1]
    targets = []
    for part in rest.split(","):
        host, _, port = part.strip().rpartition(":")
        if port.isdigit():
            targets.append((host.strip("[]") or "127.0.0.1", int(port)))
    return targets


def unreachable(address: str, timeout: float = 1.5) -> str | None:
    """None when something accepts a TCP connection at one of ``address``'s targets within ``timeout`` seconds in
    all; else why not (``connection refused``, ``timed out``...), for a one-line error."""
    targets = tcp_targets(address)
    if not targets:
        return None  # (a target form this does not know: grpc will say)
    why = ""
    each = timeout / len(targets)
    for host, port in targets:
        try:
            with socket.create_connection((host, port), timeout=each):
                return None
        except OSError as err:
            why = err.strerror or str(err) or type(err).__name__
    return why.lower()
