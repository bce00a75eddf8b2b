"""The listening socket of a one-process trainer's gloo group, closed to every connection.

torch.distributed needs a default process group even for one process (FSDP2 and the distributed checkpoints run on
it), and gloo's TCP transport opens a listening socket for the group's peers, on the address the host name resolves
to (127.0.0.1 where it names loopback, else the host's network address), for as long as the group lives. A group
of one has no peers, so nothing should ever connect there; yet gloo accepts anyone who reaches the port (it has no
authentication) and keeps each such connection open for good, one file descriptor each: another user of the host
could use up the trainer's descriptors until its next checkpoint fails to open a file.

gloo offers no way to close its listener (shutting the socket down makes gloo's accept loop abort the process), so
`sealed_new_listeners` attaches a socket filter that drops every packet to the listeners opened inside it: no
connection to them is ever established (a client's connect times out), and they cost nothing. Linux only (a BPF
socket filter, SO_ATTACH_FILTER); elsewhere nothing changes.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import socket
import struct
import sys
from collections.abc import Iterator

SO_ATTACH_FILTER = 26  # asm-generic/socket.h
SO_LOCK_FILTER = 44  # the filter cannot be removed or replaced afterwards
# One classic-BPF instruction, BPF_RET | BPF_K with k = 0: keep 0 bytes of every packet, i.e. drop it. A listening
# TCP socket runs its filter on each incoming SYN (tcp_filter, before the handshake), so no connection forms.
_DROP_ALL = struct.pack("=HBBI", 0x06, 0, 0, 0)  # struct sock_filter {u16 code; u8 jt; u8 jf; u32 k}
_TCP_LISTEN = "0A"  # the state column of /proc/net/tcp


def listening_sockets() -> dict[int, int]:
    """{socket inode: file descriptor} of this process's listening TCP sockets (IPv4 and IPv6); {} off Linux."""
    if not sys.platform.startswith("linux"):
        return {}
    listening: set[int] = set()
    for table in ("/proc/self/net/tcp", "/proc/self/net/tcp6"):  # every socket of this network namespace
        with contextlib.suppress(FileNotFoundError), open(table) as f:
            next(f)  # the header
            for line in f:
                fields = line.split()
                if fields[3] == _TCP_LISTEN:
                    listening.add(int(fields[9]))
    own = {}
    for name in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):  # a descriptor closed meanwhile
            target = os.readlink(f"/proc/self/fd/{name}")
            if target.startswith("socket:["):
                inode = int(target[len("socket:["):-1])
                if inode in listening:
                    own[inode] = int(name)
    return own


def seal(fd: int) -> None:
    """Drop every packet that reaches the socket `fd` (a listener: no connection to it ever forms), for good."""
    program = ctypes.create_string_buffer(_DROP_ALL)  # alive until setsockopt has copied it
    fprog = struct.pack("@HP", 1, ctypes.addressof(program))  # struct sock_fprog {u16 len; sock_filter *filter}
    with socket.socket(fileno=os.dup(fd)) as sock:  # the same socket: options set on the copy apply to it
        sock.setsockopt(socket.SOL_SOCKET, SO_ATTACH_FILTER, fprog)
        sock.setsockopt(socket.SOL_SOCKET, SO_LOCK_FILTER, 1)


@contextlib.contextmanager
def sealed_new_listeners() -> Iterator[None]:
    """Seal (see `seal`) every TCP listener this process opens inside the block: wrap only code whose listeners
    nothing may connect to, and keep the block short (another thread's listener opened meanwhile is sealed too)."""
    before = set(listening_sockets())
    yield
    for inode, fd in listening_sockets().items():
        if inode not in before:
            seal(fd)
