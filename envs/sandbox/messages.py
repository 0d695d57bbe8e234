"""Messages between the host, the zygote and the processes of a sandboxed run, and the fds they use.

Standard library only, like `envs.sandbox.child`: the zygote and a cold child import it by plain name.
A message is a length-prefixed payload with fds riding along its first bytes (`send_message`,
`recv_message`); status lines are one decimal number per line (`report`).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import socket
import struct

EVENTS_FD = 3  # C -> host: JSON lines
SPEC_FD = 4  # where a child's spec comes from: a pipe (cold path) or its channel from the zygote


def _recv_exact(sock: socket.socket, n: int, head: bytes = b"") -> bytes:
    data = bytearray(head)
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise EOFError
        data += chunk
    return bytes(data)


def recv_message(sock: socket.socket) -> tuple[bytes, list[int]] | None:
    """One `send_message`: its payload and fds; None at EOF."""
    try:
        head, fds, _, _ = socket.recv_fds(sock, 8, 5)
        if not head:
            return None
        (size,) = struct.unpack("!Q", _recv_exact(sock, 8, head))
        return _recv_exact(sock, size), fds
    except (ConnectionError, EOFError):
        return None


def send_message(sock: socket.socket, payload: bytes, fds: list[int]) -> None:
    """A length-prefixed payload, `fds` riding with its first bytes."""
    head = struct.pack("!Q", len(payload))
    if fds:
        socket.send_fds(sock, [head], fds)
    else:
        sock.sendall(head)
    sock.sendall(payload)


def place_fds(fds: list[int]) -> None:
    """Moves `fds` to 0, 1, 2, ... (through high numbers first, so that no move clobbers another); the
    originals are closed (a copy left behind would hold a pipe open)."""
    high = [fcntl.fcntl(fd, fcntl.F_DUPFD, 100) for fd in fds]
    for fd in set(fds) - set(range(len(fds))):
        os.close(fd)
    for target, fd in enumerate(high):
        os.dup2(fd, target)
        os.close(fd)


def report(fd: int, number: int, close: bool = False) -> None:
    """One line to the host's status pipe; a host that stopped listening must not take the sender down."""
    with contextlib.suppress(OSError):
        os.write(fd, f"{number}\n".encode())
    if close:
        os.close(fd)
