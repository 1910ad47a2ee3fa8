"""The wire format of the socket transports (tcp, and the control channel of uccl).

Only bytes live here: the structs, and the functions that pack them and parse them with their
checks. Sockets, threads and timeouts belong to the transports that use it, so a new frame kind is
added in one small module and every transport sees it.

Wire format (little-endian; this is the one place it is defined)
----------------------------------------------------------------
Handshake, as soon as the sender (trainer) connects to the receiver (inference):
  receiver -> sender  CHALLENGE  b"WSHC" | u32 inference rank | 32 random bytes             40 bytes
  sender -> receiver  ANSWER     b"WSHA" | u32 trainer rank | u32 inference rank |
                                 HMAC-SHA256(token, CHALLENGE || first 12 bytes of ANSWER)  44 bytes
  receiver -> sender  VERDICT    b"WSOK" | HMAC-SHA256(token, b"accept" || CHALLENGE || ANSWER)  36 bytes
  The receiver checks the MAC (job/token.py, in constant time) and that the answer names its own rank;
  on failure it logs the attempt and closes the connection without a verdict, and nothing the
  connection sent is ever read. The verdict proves the receiver knows the token too.
Then frames, each a 40-byte header
  b"WSYN" | u8 kind | 3 zero bytes | u64 version | u64 offset | u64 length | u64 checksum
  DATA     (1) sender -> receiver: `length` payload bytes follow, to land at version byte
               `offset` (or, where the plan's bucket at `offset` bundles several runs, in those
               runs in turn), then a u64 trailer: xxh3_64 of the payload (after it, so that the
               sender can stream bytes as they are produced); the header's checksum is 0.
  END      (2) sender -> receiver: the sender is done with `version`; offset = the number of
               DATA/WRITTEN/PATCH frames it sent for it, length = the total bytes of their
               ranges, checksum = 0.
  WRITTEN  (3) sender -> receiver, RDMA transports: the range [offset, offset+length) was
               written one-sided into the receiver's buffer; checksum as for DATA; no payload.
  ADVERT   (4) receiver -> sender, RDMA transports: `length` payload bytes follow, the remote
               access descriptors of the receiver's buffer for `version` (transport-defined).
  PATCH    (5) sender -> receiver: `length` payload bytes follow, a patch (delta.py defines it)
               that makes the range starting at `offset` (a range of the plan) of the bytes the
               receiver holds, then a u64 trailer: xxh3_64 of the payload; checksum = xxh3_64
               of the range's new bytes. A patch is at most patch_limit(range length) bytes.
  NEED     (6) receiver -> sender, after the END of a version for which the sender sent PATCH
               frames: offset = the number of patched ranges it could not apply, length = 8 x
               that, followed by their u64 offsets. The sender then sends those ranges as DATA
               frames and a second END that counts them (no NEED follows that one).
  STREAM   (7) sender -> receiver: a patch as PATCH carries, sent while it is being made (its
               size and the new bytes' checksum are not known yet): length = 0, checksum = 0;
               then pieces, each a u32 byte count and that many bytes of the patch, until a
               piece of 0 bytes; then a 16-byte trailer: u64 xxh3_64 of the range's new bytes,
               u64 xxh3_64 of the patch (its pieces' bytes, joined). At most patch_limit(range
               length) bytes of patch, like PATCH; otherwise it is read and answered like one.
"""

from __future__ import annotations

import os
import struct
from typing import NamedTuple

from weightsync.job.token import mac, same

CHALLENGE = struct.Struct("<4sI32s")
ANSWER = struct.Struct("<4sII32s")
ANSWER_HEAD = struct.Struct("<4sII")  # the part of ANSWER its MAC covers
VERDICT = struct.Struct("<4s32s")
HEADER = struct.Struct("<4sB3xQQQQ")
TRAILER = struct.Struct("<Q")
MAGIC = b"WSYN"
PIECE = struct.Struct("<I")  # a STREAM's piece: its byte count
STREAM_TRAILER = struct.Struct("<QQ")  # a STREAM's end: the new bytes' checksum, the patch's
DATA, END, WRITTEN, ADVERT, PATCH, NEED, STREAM = 1, 2, 3, 4, 5, 6, 7
KIND_NAMES = {DATA: "DATA", END: "END", WRITTEN: "WRITTEN", ADVERT: "ADVERT", PATCH: "PATCH", NEED: "NEED",
              STREAM: "STREAM"}


class WireError(ConnectionError):
    """Bytes that break the wire format; the message says how."""


class Frame(NamedTuple):
    kind: int
    version: int
    offset: int
    length: int
    checksum: int


def challenge(rank: int) -> bytes:
    """A fresh CHALLENGE from inference rank `rank`."""
    return CHALLENGE.pack(b"WSHC", rank, os.urandom(32))


def parse_challenge(raw: bytes) -> int:
    """The inference rank a CHALLENGE names."""
    magic, rank, _ = CHALLENGE.unpack(raw)
    if magic != b"WSHC":
        raise WireError("the peer does not speak the weightsync protocol")
    return rank


def answer(token: bytes, challenge_bytes: bytes, rank: int, peer_rank: int) -> bytes:
    """Trainer rank `rank`'s ANSWER to inference rank `peer_rank`'s challenge."""
    head = ANSWER_HEAD.pack(b"WSHA", rank, peer_rank)
    return head + mac(token, challenge_bytes, head)


def check_answer(token: bytes, challenge_bytes: bytes, raw: bytes) -> tuple[int, int]:
    """(trainer rank, inference rank it meant) of an ANSWER whose MAC proves the token."""
    magic, trainer, target, their_mac = ANSWER.unpack(raw)
    if magic != b"WSHA":
        raise WireError("not a weightsync handshake")
    if not same(their_mac, mac(token, challenge_bytes, raw[:ANSWER_HEAD.size])):
        raise WireError(f"wrong token (claimed trainer rank {trainer})")
    return trainer, target


def verdict(token: bytes, challenge_bytes: bytes, answer_bytes: bytes) -> bytes:
    return VERDICT.pack(b"WSOK", mac(token, b"accept", challenge_bytes, answer_bytes))


def check_verdict(token: bytes, challenge_bytes: bytes, answer_bytes: bytes, raw: bytes) -> None:
    magic, their_mac = VERDICT.unpack(raw)
    if magic != b"WSOK" or not same(their_mac, mac(token, b"accept", challenge_bytes, answer_bytes)):
        raise WireError("the peer's handshake verdict does not prove the job token")


def header(kind: int, version: int, offset: int, length: int, checksum: int = 0) -> bytes:
    return HEADER.pack(MAGIC, kind, version, offset, length, checksum)


def parse_header(raw: bytes) -> Frame:
    """A frame header, checked against the format above (what the frame means to the version
    under way is the receiver's to check)."""
    magic, kind, version, offset, length, checksum = HEADER.unpack(raw)
    if magic != MAGIC:
        raise WireError("sent a frame without the weightsync magic")
    if raw[5:8] != b"\0\0\0":
        raise WireError(f"sent a frame whose reserved bytes are not zero ({raw[5:8].hex()})")
    if kind not in KIND_NAMES:
        raise WireError(f"sent a frame of unknown kind {kind}")
    if checksum and kind not in (WRITTEN, PATCH):
        raise WireError(f"sent a {KIND_NAMES[kind]} frame with a checksum in its header, where the format has 0")
    return Frame(kind, version, offset, length, checksum)


def patch_limit(length: int) -> int:
    """The most bytes a PATCH of a `length`-byte range may carry: the range itself and its
    framing (a patch that would be larger is sent as DATA)."""
    return length + length // 4096 + 4096


def need(version: int, offsets: list[int]) -> bytes:
    """A NEED frame asking again, whole, for the ranges at `offsets`."""
    return header(NEED, version, len(offsets), 8 * len(offsets)) + struct.pack(f"<{len(offsets)}Q", *offsets)


def parse_need(frame: Frame, payload: bytes) -> list[int]:
    """The offsets a NEED frame (its header parsed, then its payload) asks for."""
    if frame.kind != NEED or frame.length != 8 * frame.offset or len(payload) != frame.length:
        raise WireError(f"expected a NEED frame, got {KIND_NAMES.get(frame.kind, frame.kind)} of {frame.length} bytes")
    return list(struct.unpack(f"<{frame.offset}Q", payload))
