"""Patches sent while they are being made (STREAM frames): a real sender streams the pieces as a
producer hands them over and the receiver applies them bit for bit; a patch already whole when its
connection gets to it goes as one PATCH frame; a damaged stream is asked for again whole; one
longer than a patch may be, or one whose header claims a length, cuts the trainer off before the
excess is read; an abandoned one cuts the connection."""

import threading
import time

import numpy as np
import pytest
import torch
import xxhash
from test_transport_tcp import TOKEN, a_patch, authenticated_raw_client, pair, receive_in_thread

from weightsync.transfer.delta import Patcher
from weightsync.transport import make_transport, sockets, wire
from weightsync.transport.base import Filling, Pieces


def versions(length: int = 1 << 20):
    """(base, new, the patch of new against base at version 4, as a trainer makes it: one chunk)."""
    g = np.random.default_rng(1)
    base = g.integers(0, 256, size=length, dtype=np.uint8)
    new = base.copy()
    where = g.choice(length // 2, size=length // 50, replace=False)
    new.view("<u2")[where] ^= 1
    return base.tobytes(), new.tobytes(), a_patch(base.tobytes(), new.tobytes(), 4)


def split(patch: bytes, n: int) -> list[bytes]:
    step = -(-len(patch) // n)
    return [patch[a:a + step] for a in range(0, len(patch), step)]


def receive_patched(receiver, base: bytes, staging, expected):
    patcher = Patcher(4, torch.frombuffer(bytearray(base), dtype=torch.uint8), staging)
    out = {}

    def run():
        try:
            out["sums"] = receiver.receive(5, staging, expected, 10, patcher)
        except Exception as e:  # noqa: BLE001 - examined by the test
            out["error"] = e
    t = threading.Thread(target=run)
    t.start()
    return t, out, patcher


@pytest.mark.parametrize("streamed", [True, False])
def test_a_patch_goes_out_as_it_is_made_and_lands_bit_for_bit(streamed):
    base, new, patch = versions()
    receiver, endpoint = pair()
    sender = make_transport("tcp", token=TOKEN, timeout=10).sender(0)
    sender.connect({0: endpoint})
    staging = torch.zeros(len(new), dtype=torch.uint8)
    t, out, patcher = receive_patched(receiver, base, staging, {0: [(0, len(new))]})
    pieces, filling, parts = Pieces(), Filling(len(new)), split(patch, 7)
    if not streamed:  # all made before the connection gets to it: one PATCH frame
        pieces.put(parts)
        pieces.close()
        filling.finish(xxhash.xxh3_64_intdigest(new))
    future = sender.send_patch(0, 5, 0, len(new), pieces, filling, lambda: new)
    if streamed:
        pieces.put(parts[:1])
        for part in parts[1:]:
            time.sleep(0.01)  # the first pieces are on the wire before the last are made
            pieces.put([part])
        filling.finish(xxhash.xxh3_64_intdigest(new))
        pieces.close()
    sender.end_version(5)
    t.join(10)
    assert future.result() == xxhash.xxh3_64_intdigest(new)
    assert out["sums"] == {0: xxhash.xxh3_64_intdigest(new)} and bytes(staging.numpy()) == new
    assert patcher.refused == [] and patcher.applied == 1
    sender.close(), receiver.close()


def stream_frame(version: int, offset: int, pieces: list[bytes], checksum: int, trailer: int) -> bytes:
    body = b"".join(wire.PIECE.pack(len(p)) + p for p in pieces)
    return (wire.header(wire.STREAM, version, offset, 0) + body + wire.PIECE.pack(0)
            + wire.STREAM_TRAILER.pack(checksum, trailer))


def test_a_damaged_stream_is_asked_for_again_whole():
    base, new, patch = versions()
    receiver, endpoint = pair()
    sock = authenticated_raw_client(endpoint)
    staging = torch.zeros(len(new), dtype=torch.uint8)
    t, out, patcher = receive_patched(receiver, base, staging, {0: [(0, len(new))]})
    damaged = bytearray(patch)
    damaged[100] ^= 0xFF
    checksum = xxhash.xxh3_64_intdigest(new)
    sock.sendall(stream_frame(5, 0, split(bytes(damaged), 3), checksum, xxhash.xxh3_64_intdigest(patch)))
    sock.sendall(wire.header(wire.END, 5, 1, len(new)))
    frame = wire.parse_header(sockets.recv_exact(sock, wire.HEADER.size))
    assert wire.parse_need(frame, sockets.recv_exact(sock, frame.length)) == [0]
    sock.sendall(wire.header(wire.DATA, 5, 0, len(new)) + new + wire.TRAILER.pack(checksum))
    sock.sendall(wire.header(wire.END, 5, 1, len(new)))
    t.join(10)
    assert out["sums"] == {0: checksum} and bytes(staging.numpy()) == new
    assert patcher.applied == 0 and "damaged in transit" in patcher.refused[0]
    sock.close(), receiver.close()


def test_a_stream_longer_than_a_patch_may_be_cuts_the_trainer_off():
    receiver, endpoint = pair()
    sock = authenticated_raw_client(endpoint)
    t, out = receive_in_thread(receiver, 1, bytearray(128), {0: [(0, 64)]}, 5)
    limit = wire.patch_limit(64)
    sock.sendall(wire.header(wire.STREAM, 1, 0, 0) + wire.PIECE.pack(limit) + b"\0" * limit
                 + wire.PIECE.pack(1 << 30))  # the excess is never sent: the receiver refuses it unread
    t.join(5)
    assert f"sent more than {limit} bytes of patch for bytes at 0 of version 1" in str(out["error"])
    assert "trainer rank 0" in str(out["error"])
    sock.close(), receiver.close()


def test_a_stream_that_claims_a_length_is_refused():
    receiver, endpoint = pair()
    sock = authenticated_raw_client(endpoint)
    t, out = receive_in_thread(receiver, 1, bytearray(128), {0: [(0, 64)]}, 5)
    sock.sendall(wire.header(wire.STREAM, 1, 0, 10))
    t.join(5)
    assert "sent a STREAM of 10 bytes for bytes at 0 of version 1" in str(out["error"])
    sock.close(), receiver.close()


def test_an_abandoned_stream_cuts_the_connection():
    base, new, patch = versions()
    receiver, endpoint = pair(timeout=5)
    sender = make_transport("tcp", token=TOKEN, timeout=5).sender(0)
    sender.connect({0: endpoint})
    staging = torch.zeros(len(new), dtype=torch.uint8)
    t, out, _ = receive_patched(receiver, base, staging, {0: [(0, len(new))]})
    pieces = Pieces()
    future = sender.send_patch(0, 5, 0, len(new), pieces, Filling(len(new)), lambda: new)
    pieces.put(split(patch, 4)[:1])
    pieces.fail(RuntimeError("the cast failed"))
    with pytest.raises(RuntimeError, match="the patch was abandoned: the cast failed"):
        future.result(5)
    t.join(10)
    assert "trainer rank 0" in str(out["error"])
    sender.close(), receiver.close()
