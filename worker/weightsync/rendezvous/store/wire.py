"""The rendezvous store's wire format: the handshake, the frames, and the values they carry.

Bytes only, and reading one frame from a socket: the server's and the client's connections, with
their threads and deadlines, are in server.py and client.py.

Wire format (big-endian; this is the one place it is defined)
-------------------------------------------------------------
  server -> client  HELLO    b"WSKV" | u8 1 | server nonce (32 bytes)                         37 bytes
                             (u8 0 and a zero nonce: at the connection limit; the server closes)
  client -> server  PROOF    b"WSKV" | client nonce (32) | HMAC(token, "client", job, both nonces)  68
  server -> client  VERDICT  u8 1 | HMAC(token, "server", job, both nonces)                     33
                             (u8 0 and 32 zero bytes: refused; the server closes)
  Then frames, both ways:    u32 n | u64 sequence | payload | HMAC(session key, direction | sequence | payload)
  n counts what follows it. The session key is HMAC(token, "session", job, both nonces); direction
  is b"C" (requests) or b"S" (responses); the client numbers its requests 1, 2, 3, ... and the
  server answers request k with sequence k. A request's payload is u8 op | arguments, a response's
  u8 status | results, each value tagged: b"b" u32 length | bytes, b"i" i64, b"f" f64, b"?" u8,
  b"l" u32 count | (u32 length | bytes) per item; peek and wait_get answer a list whose items are
  SET | value or UNSET, one per key asked. A frame out of sequence or with a wrong HMAC
  closes the connection. The handshake's HMACs are over their parts each preceded by its u32
  length, the frames' over the parts as they are (job/token.py).
"""

from __future__ import annotations

import socket
import struct

from weightsync.job.token import mac, same
from weightsync.transport.sockets import recv_exact

MAGIC = b"WSKV"
HELLO = struct.Struct(">4sB32s")
PROOF = struct.Struct(">4s32s32s")
VERDICT = struct.Struct(">B32s")
LENGTH = struct.Struct(">I")
SEQ = struct.Struct(">Q")
MAC_BYTES = 32

# op code: (name, argument tags)
OPS = {1: ("set", "bb"), 2: ("get", "bf"), 3: ("add", "bi"), 4: ("check", "l"), 5: ("wait", "lf"),
       6: ("compare_set", "bbb"), 7: ("delete_key", "b"), 8: ("num_keys", ""), 9: ("append", "bb"),
       10: ("multi_get", "lf"), 11: ("multi_set", "ll"), 12: ("peek", "l"),
       14: ("wait_get", "lllf")}
CODES = {name: code for code, (name, _) in OPS.items()}
BLOCKING = {"get", "wait", "multi_get", "wait_get"}  # their last argument is how long the server may wait
OK, ERROR, TIMEOUT, FULL = 0, 1, 2, 3  # a response's status
SET, UNSET = b"\x01", b"\x00"  # what peek puts before each key's value: set (the value follows), or not set


def as_bytes(x: str | bytes) -> bytes:
    return x.encode() if isinstance(x, str) else bytes(x)


def handshake_macs(token: bytes, job: str, server_nonce: bytes, client_nonce: bytes) -> tuple[bytes, bytes, bytes]:
    """(client proof, server proof, session key) for one connection."""
    return tuple(mac(token, b"weightsync store " + what, job, server_nonce, client_nonce, lengths=LENGTH.format)
                 for what in (b"client", b"server", b"session"))


# ---------------------------------------------------------------- values


def pack(values) -> bytes:
    out = []
    for v in values:
        if isinstance(v, bool):
            out.append(b"?" + bytes([v]))
        elif isinstance(v, int):
            out.append(b"i" + struct.pack(">q", v))
        elif isinstance(v, float):
            out.append(b"f" + struct.pack(">d", v))
        elif isinstance(v, (bytes, str)):
            v = as_bytes(v)
            out.append(b"b" + LENGTH.pack(len(v)) + v)
        else:  # a list of bytes
            items = [as_bytes(x) for x in v]
            out.append(b"l" + LENGTH.pack(len(items)) + b"".join(LENGTH.pack(len(x)) + x for x in items))
    return b"".join(out)


def unpack(data: bytes) -> list:
    return unpack_tagged(data)[0]


_FIXED = {b"i"[0]: (8, ">q", "i"), b"f"[0]: (8, ">d", "f")}


def _blob(data: bytes, at: int, end: int) -> tuple[bytes, int]:
    """The bytes whose u32 length is at `at`, and where what follows them begins."""
    n = LENGTH.unpack_from(data, at)[0]
    at += 4
    if at + n > end:
        raise ValueError("a value runs past the end of the message")
    return bytes(data[at:at + n]), at + n


def unpack_tagged(data: bytes) -> tuple[list, str]:
    """The values of a payload, and their tags (as OPS names an operation's arguments), in one
    pass: the server reads every request of every rank with it."""
    out, seen, at, end = [], [], 0, len(data)
    try:
        while at < end:
            tag = data[at]
            at += 1
            if tag == 98:  # b"b"
                value, at = _blob(data, at, end)
                out.append(value)
                seen.append("b")
            elif tag in _FIXED:
                size, fmt, name = _FIXED[tag]
                if at + size > end:
                    raise ValueError("a value runs past the end of the message")
                out.append(struct.unpack_from(fmt, data, at)[0])
                at += size
                seen.append(name)
            elif tag == 63:  # b"?"
                if at >= end:
                    raise ValueError("a value runs past the end of the message")
                out.append(data[at] != 0)
                at += 1
                seen.append("?")
            elif tag == 108:  # b"l"
                count = LENGTH.unpack_from(data, at)[0]
                at += 4
                if count > end - at:
                    raise ValueError("a list longer than the message")
                items = []
                for _ in range(count):
                    value, at = _blob(data, at, end)
                    items.append(value)
                out.append(items)
                seen.append("l")
            else:
                raise ValueError(f"unknown value tag {bytes([tag])!r}")
    except struct.error:
        raise ValueError("a value runs past the end of the message") from None
    return out, "".join(seen)


# ---------------------------------------------------------------- frames


def seal(key: bytes, direction: bytes, seq: int, payload: bytes) -> bytes:
    head = SEQ.pack(seq)
    return LENGTH.pack(len(head) + len(payload) + MAC_BYTES) + head + payload + mac(key, direction, head, payload)


def frame_length(head: bytes, max_bytes: int) -> int:
    n = LENGTH.unpack(head)[0]
    if n > max_bytes or n < SEQ.size + MAC_BYTES:
        raise ValueError(f"a frame of {n} bytes (the limit is {max_bytes})")
    return n


def read_frame(sock: socket.socket, key: bytes, direction: bytes, expect_seq: int, max_bytes: int,
               deadline: float | None = None) -> bytes:
    """The payload of the next frame; ValueError if it is too long, out of sequence or forged."""
    n = frame_length(recv_exact(sock, LENGTH.size, deadline), max_bytes)
    return open_frame(recv_exact(sock, n, deadline), key, direction, expect_seq)


def open_frame(body: bytes, key: bytes, direction: bytes, expect_seq: int) -> bytes:
    """The payload of a frame's body (what follows its length), checked."""
    head, payload, tag = body[:SEQ.size], body[SEQ.size:-MAC_BYTES], body[-MAC_BYTES:]
    if not same(tag, mac(key, direction, head, payload)):
        raise ValueError("a frame with a wrong HMAC (altered, or from another connection)")
    if SEQ.unpack(head)[0] != expect_seq:
        raise ValueError(f"a frame numbered {SEQ.unpack(head)[0]} where {expect_seq} was due (replayed or reordered)")
    return payload
