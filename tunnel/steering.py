"""Keeping a QUIC connection on one worker when the gateway's address changes.

Worker processes share the tunnel port as one SO_REUSEPORT group, and the
kernel spreads datagrams over the group by hashing their addresses. A
connection whose gateway address changes (a NAT rebinding, a QUIC migration)
would hash to another worker's socket, which does not know its connection ID
and drops its packets: the connection and every request on it are lost.

Steering by connection ID instead keeps it where it is:

- each worker issues only connection IDs whose first byte is its own index
  modulo the worker count (`ConnectionIdSteering`);
- a classic BPF program on the group (`reuseport_program`) picks the socket
  of that index from the first byte of each datagram's destination
  connection ID, which is the second byte of a short-header packet and the
  seventh of a long-header one (RFC 9000 §17.2, §17.3).

A client's first Initial carries a destination ID the client chose at random,
so a new connection lands on the worker its first byte picks, and that worker
then issues IDs that lead back to it. The first byte therefore reveals the
worker index (log2 of the worker count bits) to anyone watching the path:
RFC 9000 §5.1 asks that an observer cannot link a connection's IDs, and a
QUIC-LB style encryption would hide it, which a classic BPF program cannot
undo. The tunnel runs between the platform's gateway and its own nodes, where
this is accepted in exchange for connections that survive a rebinding.

`steer_connection_ids` reaches into aioquic (`_host_cids`,
`_replenish_connection_ids`); like `tunnel.acks` it is pinned by tests
against the aioquic version the project locks.
"""

from __future__ import annotations

import ctypes
import socket
import struct
from collections.abc import Callable
from dataclasses import dataclass

from aioquic.quic.connection import QuicConnection

SO_ATTACH_REUSEPORT_CBPF = 51
"""Linux `asm-generic/socket.h`; Python's socket module does not name it."""

_LONG_HEADER_BIT = 0x80
_SHORT_HEADER_CID_OFFSET = 1  # after the first byte
_LONG_HEADER_CID_OFFSET = 6  # after the first byte, the version and the ID's length

# Classic BPF opcodes (linux/bpf_common.h).
_LOAD_BYTE_ABSOLUTE = 0x00 | 0x10 | 0x20  # BPF_LD | BPF_B | BPF_ABS
_JUMP_IF_BITS_SET = 0x05 | 0x40  # BPF_JMP | BPF_JSET | BPF_K
_JUMP_ALWAYS = 0x05  # BPF_JMP | BPF_JA
_MODULO_CONSTANT = 0x04 | 0x90  # BPF_ALU | BPF_MOD | BPF_K
_RETURN_ACCUMULATOR = 0x06 | 0x10  # BPF_RET | BPF_A


@dataclass(frozen=True)
class ConnectionIdSteering:
    """Worker `index` of `count`: the connection IDs it issues lead back to it."""

    index: int
    count: int

    def __post_init__(self) -> None:
        if not 0 <= self.index < self.count <= 256:
            raise ValueError(f"worker index {self.index} of {self.count} is out of range")

    def connection_id(self, random_bytes: bytes) -> bytes:
        """`random_bytes` with its first byte moved to this worker's residue class,
        keeping as much of that byte's randomness as the class allows."""
        if not random_bytes:
            raise ValueError("a steered connection ID needs at least one byte")
        classes = 256 // self.count  # values of the byte that belong to each worker
        first = self.index + self.count * (random_bytes[0] % classes)
        return bytes((first,)) + random_bytes[1:]

    def owns(self, connection_id: bytes) -> bool:
        return bool(connection_id) and connection_id[0] % self.count == self.index


def reuseport_program(count: int) -> bytes:
    """The classic BPF program, as `struct sock_filter` records, that returns the
    group index `first byte of the destination connection ID % count`.

    For UDP the kernel runs it on the payload (the QUIC packet). A datagram too
    short to hold the byte ends the program with 0, the group's first socket,
    whose QUIC server drops it.
    """
    if not 1 <= count <= 256:
        raise ValueError(f"cannot steer over {count} sockets")
    instructions = (
        (_LOAD_BYTE_ABSOLUTE, 0, 0, 0),
        (_JUMP_IF_BITS_SET, 2, 0, _LONG_HEADER_BIT),  # long header: to the 5th
        (_LOAD_BYTE_ABSOLUTE, 0, 0, _SHORT_HEADER_CID_OFFSET),
        (_JUMP_ALWAYS, 0, 0, 1),  # to the modulo
        (_LOAD_BYTE_ABSOLUTE, 0, 0, _LONG_HEADER_CID_OFFSET),
        (_MODULO_CONSTANT, 0, 0, count),
        (_RETURN_ACCUMULATOR, 0, 0, 0),
    )
    return b"".join(struct.pack("=HBBI", *instruction) for instruction in instructions)


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]


def attach_reuseport_program(sock: socket.socket, count: int) -> None:
    """Steer `sock`'s SO_REUSEPORT group by connection ID (Linux 4.5 or later).

    Raises OSError where the kernel refuses or lacks the option; the group
    then keeps the kernel's address hash.
    """
    program = reuseport_program(count)
    records = ctypes.create_string_buffer(program, len(program))
    fprog = _SockFprog(len(program) // 8, ctypes.addressof(records))
    # The kernel copies the records during the call; `records` outlives it.
    sock.setsockopt(socket.SOL_SOCKET, SO_ATTACH_REUSEPORT_CBPF, bytes(fprog))


def steer_connection_ids(quic: QuicConnection, steering: ConnectionIdSteering) -> None:
    """Make a server connection, before its first datagram, issue only IDs of
    `steering`'s worker: its initial source ID and every ID it issues later."""
    first = quic._host_cids[0]
    first.cid = steering.connection_id(first.cid)
    quic.host_cid = first.cid
    quic._local_initial_source_connection_id = first.cid
    replenish: Callable[[], None] = quic._replenish_connection_ids

    def replenish_steered() -> None:
        # The new IDs are announced in NEW_CONNECTION_ID frames only when a
        # packet is built, after this returns.
        issued = len(quic._host_cids)
        replenish()
        for connection_id in quic._host_cids[issued:]:
            connection_id.cid = steering.connection_id(connection_id.cid)

    quic._replenish_connection_ids = replenish_steered  # type: ignore[method-assign]
