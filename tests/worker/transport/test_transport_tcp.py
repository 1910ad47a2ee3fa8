"""The TCP transport: framing, the HMAC handshake (wrong tokens refused, nothing they send used),
checksums, ranges the plan does not give, silent and dead peers, patches applied or asked for
again whole. Ranks run as threads here; the
multi-process tests of the whole path are in test_transfer.py."""

import socket
import struct
import threading
import time

import pytest
import xxhash

from weightsync.transport import TransferError, make_transport, sockets, wire
from weightsync.transport.base import Filling
from weightsync.transport.checksum import CHUNK

TOKEN = b"0123456789abcdef-job-token"


def pair(timeout=10.0, token=TOKEN, inference_rank=0):
    receiver = make_transport("tcp", token=TOKEN, timeout=timeout).receiver(inference_rank)
    endpoint = receiver.listen("127.0.0.1", 0)
    return receiver, endpoint


def receive_in_thread(receiver, version, buf, expected, timeout):
    out = {}

    def run():
        try:
            out["sums"] = receiver.receive(version, buf, expected, timeout)
        except Exception as e:  # noqa: BLE001 - examined by the test
            out["error"] = e
    t = threading.Thread(target=run)
    t.start()
    return t, out


def authenticated_raw_client(endpoint, trainer_rank=0, inference_rank=0, token=TOKEN):
    host, port = sockets.parse_endpoint(endpoint)
    sock = socket.create_connection((host, port), timeout=5)
    sockets.client_handshake(sock, token, trainer_rank, inference_rank)
    return sock


def test_frame_header_layout():
    assert wire.HEADER.size == 40 and wire.CHALLENGE.size == 40 and wire.ANSWER.size == 44 and wire.VERDICT.size == 36
    raw = wire.HEADER.pack(wire.MAGIC, wire.DATA, 7, 4096, 128, 2**64 - 1)
    assert raw[:4] == b"WSYN" and raw[4] == wire.DATA and raw[5:8] == b"\0\0\0"
    assert struct.unpack_from("<QQQQ", raw, 8) == (7, 4096, 128, 2**64 - 1)
    assert "DATA" in wire.__doc__ and "END" in wire.__doc__ and "HMAC-SHA256" in wire.__doc__


def test_send_all_handles_partial_sends_of_many_views():
    a, b = socket.socketpair()
    a.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    payload = bytes(range(256)) * 4096  # 1 MiB, far more than one sendmsg moves
    views = [memoryview(payload)[i:i + 1000] for i in range(0, len(payload), 1000)]  # > IOV_MAX entries
    got = bytearray(len(payload))
    t = threading.Thread(target=sockets.recv_into_all, args=(b, memoryview(got)))
    t.start()
    sockets.send_all(a, views)
    t.join(5)
    assert bytes(got) == payload
    a.close(), b.close()


def test_two_versions_over_one_connection_land_in_place():
    receiver, endpoint = pair()
    sender = make_transport("tcp", token=TOKEN, timeout=10).sender(0)
    sender.connect({0: endpoint})
    conn = sender.conns[0].sock
    for version in (1, 2):
        buf = bytearray(256)
        payload = bytes([version]) * 128
        t, out = receive_in_thread(receiver, version, buf, {0: [(64, 64), (128, 128)]}, 10)
        sender.send(0, version, 128, [memoryview(payload)[:100], memoryview(payload)[100:]])
        sender.send(0, version, 64, payload[:64])
        sender.end_version(version)
        t.join(10)
        assert "error" not in out, out.get("error")
        assert out["sums"] == {128: xxhash.xxh3_64_intdigest(payload), 64: xxhash.xxh3_64_intdigest(payload[:64])}
        assert buf[:64] == bytes(64) and buf[64:] == payload[:64] + payload
        assert sender.conns[0].sock is conn  # kept open across versions
    sender.close(), receiver.close()


def test_wrong_token_is_refused_logged_and_nothing_is_used(caplog):
    receiver, endpoint = pair()
    intruder = make_transport("tcp", token=b"not-the-job-token-at-all", timeout=5).sender(0)
    with pytest.raises(TransferError, match="inference rank 0: handshake .* failed: the peer refused"):
        intruder.connect({0: endpoint})
    # a raw client that ignores the refusal and pushes a frame anyway
    host, port = sockets.parse_endpoint(endpoint)
    raw = socket.create_connection((host, port), timeout=5)
    challenge = sockets.recv_exact(raw, wire.CHALLENGE.size)
    head = struct.pack("<4sII", b"WSHA", 0, 0)
    bogus = head + wire.mac(b"guessed-token-guessed-token", challenge, head)
    payload = b"\xff" * 64
    raw.sendall(bogus + wire.HEADER.pack(wire.MAGIC, wire.DATA, 1, 0, 64, 0) + payload
                + wire.TRAILER.pack(xxhash.xxh3_64_intdigest(payload)))
    try:  # closed without a verdict (a reset, since what it sent was never read)
        assert raw.recv(64) == b""
    except ConnectionResetError:
        pass
    raw.close()
    buf = bytearray(64)
    start = time.monotonic()
    with pytest.raises(TransferError, match="trainer rank 0: did not connect within .*wrong token"):
        receiver.receive(1, buf, {0: [(0, 64)]}, timeout=1.0)
    assert time.monotonic() - start < 5
    assert buf == bytes(64)
    assert len(receiver.refused) == 2 and all("wrong token" in r for r in receiver.refused)
    # getMessage(): a record logged on another thread may not be formatted yet
    assert any("refused connection" in r.getMessage() for r in caplog.records)
    # the real trainer still gets through afterwards
    sender = make_transport("tcp", token=TOKEN, timeout=5).sender(0)
    sender.connect({0: endpoint})
    t, out = receive_in_thread(receiver, 1, buf, {0: [(0, 64)]}, 5)
    sender.send(0, 1, 0, b"\x01" * 64)
    sender.end_version(1)
    t.join(5)
    assert "error" not in out and buf == b"\x01" * 64
    sender.close(), receiver.close()


def test_a_connection_meant_for_another_rank_is_refused():
    receiver, endpoint = pair(inference_rank=1)
    sender = make_transport("tcp", token=TOKEN, timeout=5).sender(0)
    with pytest.raises(TransferError, match="belongs to inference rank 1, not 0"):
        sender.connect({0: endpoint})
    receiver.close()


def test_bad_checksum_names_the_trainer():
    receiver, endpoint = pair()
    sock = authenticated_raw_client(endpoint, trainer_rank=3)
    buf = bytearray(64)
    t, out = receive_in_thread(receiver, 5, buf, {3: [(0, 64)]}, 5)
    sock.sendall(wire.HEADER.pack(wire.MAGIC, wire.DATA, 5, 0, 64, 0) + b"\x07" * 64 + wire.TRAILER.pack(12345))
    t.join(5)
    assert isinstance(out.get("error"), TransferError) and out["error"].peer == "trainer rank 3"
    assert "checksum mismatch for bytes [0, 64) of version 5" in str(out["error"])
    sock.close(), receiver.close()


def test_a_range_outside_the_plan_is_refused_before_its_bytes_are_read():
    receiver, endpoint = pair()
    sock = authenticated_raw_client(endpoint)
    buf = bytearray(128)
    t, out = receive_in_thread(receiver, 1, buf, {0: [(0, 64)]}, 5)
    sock.sendall(wire.HEADER.pack(wire.MAGIC, wire.DATA, 1, 64, 64, 0) + b"\x09" * 64 + wire.TRAILER.pack(0))
    t.join(5)
    assert "bytes [64, 128) of version 1, which the plan does not give it" in str(out["error"])
    assert buf == bytes(128)
    sock.close(), receiver.close()


def test_end_with_missing_ranges_and_wrong_version_are_errors():
    receiver, endpoint = pair()
    sock = authenticated_raw_client(endpoint)
    t, out = receive_in_thread(receiver, 2, bytearray(128), {0: [(0, 64), (64, 64)]}, 5)
    sock.sendall(wire.HEADER.pack(wire.MAGIC, wire.END, 2, 0, 0, 0))
    t.join(5)
    assert "ended version 2 with 2 of 2 ranges missing" in str(out["error"])
    sock.close()
    sock = authenticated_raw_client(endpoint)
    t, out = receive_in_thread(receiver, 3, bytearray(128), {0: [(0, 64)]}, 5)
    sock.sendall(wire.HEADER.pack(wire.MAGIC, wire.END, 2, 0, 0, 0))
    t.join(5)
    assert "sent version 2 while version 3 was expected" in str(out["error"])
    sock.close(), receiver.close()


def test_a_silent_peer_times_out_with_its_rank():
    receiver, endpoint = pair(timeout=1.0)
    sock = authenticated_raw_client(endpoint, trainer_rank=1)
    start = time.monotonic()
    with pytest.raises(TransferError, match="trainer rank 1: silent for 1s during version 4"):
        receiver.receive(4, bytearray(64), {1: [(0, 64)]}, timeout=30)
    assert time.monotonic() - start < 5
    sock.close(), receiver.close()


def test_a_peer_that_dies_mid_frame_is_named_at_once():
    receiver, endpoint = pair(timeout=60)
    sock = authenticated_raw_client(endpoint, trainer_rank=1)
    t, out = receive_in_thread(receiver, 1, bytearray(1 << 20), {1: [(0, 1 << 20)]}, 60)
    sock.sendall(wire.HEADER.pack(wire.MAGIC, wire.DATA, 1, 0, 1 << 20, 0) + b"\x01" * 1000)
    start = time.monotonic()
    sock.close()
    t.join(10)
    assert time.monotonic() - start < 5
    assert out["error"].peer == "trainer rank 1" and "connection lost during version 1" in str(out["error"])
    receiver.close()


def test_a_send_stalled_on_a_receiver_that_stopped_reading_ends_at_once_when_cut():
    # The receiver's process vanished with its network (no reset ever comes): without cut() the
    # send would wait out its whole timeout.
    receiver, endpoint = pair(timeout=60)  # connections are admitted, but nothing reads them
    sender = make_transport("tcp", token=TOKEN, timeout=60).sender(0)
    sender.connect({0: endpoint})
    future = sender.send(0, 3, 0, bytearray(64 << 20))  # far more than the sockets' buffers hold
    time.sleep(0.5)
    assert not future.done()
    start = time.monotonic()
    sender.cut(0)
    with pytest.raises(TransferError, match="inference rank 0: connection lost while sending version 3"):
        future.result(timeout=30)
    assert time.monotonic() - start < 10
    sender.drop(0)
    assert not sender.connected(0)
    receiver.close()


def test_sender_names_the_inference_rank_it_cannot_reach():
    with socket.socket() as s:  # a port with nobody listening
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    sender = make_transport("tcp", token=TOKEN, timeout=0.5).sender(0)
    with pytest.raises(TransferError, match="inference rank 4: could not connect"):
        sender.connect({4: f"127.0.0.1:{port}"})


def test_short_tokens_are_refused():
    with pytest.raises(ValueError, match="at least 16 bytes"):
        make_transport("tcp", token=b"short").sender(0)


def test_a_buffer_is_streamed_as_its_producer_fills_it():
    receiver, endpoint = pair()
    sender = make_transport("tcp", token=TOKEN, timeout=10).sender(0)
    sender.connect({0: endpoint})
    size = 3 * CHUNK + 123
    payload = bytes(range(256)) * (size // 256) + bytes(size % 256)
    source, buf = bytearray(size), bytearray(size)
    t, out = receive_in_thread(receiver, 1, buf, {0: [(0, size)]}, 10)
    filling = Filling(size)
    future = sender.send(0, 1, 0, memoryview(source), filling)
    for a in range(0, size, CHUNK):  # fill chunk by chunk; the sender may only send what is ready
        b = min(a + CHUNK, size)
        source[a:b] = payload[a:b]
        filling.advance(b)
    filling.finish(xxhash.xxh3_64_intdigest(payload))
    assert future.result(10) == xxhash.xxh3_64_intdigest(payload)
    sender.end_version(1)
    t.join(10)
    assert "error" not in out, out.get("error")
    assert bytes(buf) == payload and out["sums"] == {0: xxhash.xxh3_64_intdigest(payload)}
    sender.close(), receiver.close()


def test_an_abandoned_buffer_cuts_the_connection_and_the_receiver_names_the_trainer():
    receiver, endpoint = pair(timeout=60)
    sender = make_transport("tcp", token=TOKEN, timeout=60).sender(2)
    sender.connect({0: endpoint})
    size = 4 * CHUNK
    t, out = receive_in_thread(receiver, 1, bytearray(size), {2: [(0, size)]}, 60)
    filling = Filling(size)
    future = sender.send(0, 1, 0, memoryview(bytearray(size)), filling)
    filling.advance(CHUNK)
    start = time.monotonic()
    filling.fail(ValueError("the cast failed"))
    with pytest.raises(RuntimeError, match="the send buffer was abandoned: the cast failed"):
        future.result(10)
    t.join(10)
    assert time.monotonic() - start < 5
    assert out["error"].peer == "trainer rank 2" and "connection lost during version 1" in str(out["error"])
    sender.close(), receiver.close()


# ---------------------------------------------------------------- crafted input on the data port

def frame(kind, version, offset, length, checksum=0):
    return wire.HEADER.pack(wire.MAGIC, kind, version, offset, length, checksum)


def data(version, offset, payload):
    return frame(wire.DATA, version, offset, len(payload)) + payload + wire.TRAILER.pack(xxhash.xxh3_64_intdigest(payload))


A, B = b"\x11" * 64, b"\x22" * 64  # trainer rank 3's two planned ranges, (0, 64) and (64, 64)
PLANNED = {3: [(0, 64), (64, 64)]}
U64 = 2 ** 64

CRAFTED = {
    "huge length": (frame(wire.DATA, 1, 0, U64 - 1),
                    "sent DATA for bytes [0, 18446744073709551615) of version 1, which the plan"),
    "negative offset (u64 wrap)": (frame(wire.DATA, 1, U64 - 64, 64), f"[{U64 - 64}, {U64}) of version 1, which the plan"),
    "overlapping range": (frame(wire.DATA, 1, 32, 64), "bytes [32, 96) of version 1, which the plan does not give it"),
    "a range of the plan twice": (data(1, 0, A) + frame(wire.DATA, 1, 0, 64), "bytes [0, 64) of version 1, a second time"),
    "another trainer's range": (frame(wire.DATA, 1, 128, 64), "bytes [128, 192) of version 1, which the plan does not give"),
    "a range beyond the buffer": (frame(wire.DATA, 1, 4096, 64), "bytes [4096, 4160) of version 1, which the plan"),
    "more bytes than announced": (data(1, 0, A) + b"\x11" * 64, "sent a frame without the weightsync magic during version 1"),
    "a longer payload than its length": (frame(wire.DATA, 1, 0, 64) + A + b"\x11" * 8 + wire.TRAILER.pack(0),
                                         "checksum mismatch for bytes [0, 64) of version 1"),
    "an unknown kind": (frame(9, 1, 0, 64), "sent a frame of unknown kind 9 during version 1"),
    "ADVERT from a sender": (frame(wire.ADVERT, 1, 0, 64), "sent ADVERT for bytes [0, 64) of version 1: a sender never sends"),
    "WRITTEN over tcp": (frame(wire.WRITTEN, 1, 0, 64, 5), "a sender never sends WRITTEN over the tcp transport"),
    "END with wrong counts": (data(1, 0, A) + data(1, 64, B) + frame(wire.END, 1, 5, 128),
                              "says it sent 5 ranges / 128 bytes, 2 / 128 arrived"),
    "END with a checksum": (data(1, 0, A) + data(1, 64, B) + frame(wire.END, 1, 2, 128, 7), "END frame with a checksum"),
    "END before the ranges": (frame(wire.END, 1, 0, 0), "ended version 1 with 2 of 2 ranges missing, first at byte 0"),
    "a DATA header with a checksum": (frame(wire.DATA, 1, 0, 64, 1) + A, "DATA frame with a checksum in its header"),
    "nonzero reserved bytes": (frame(wire.DATA, 1, 0, 64)[:5] + b"\x01\x00\x00" + frame(wire.DATA, 1, 0, 64)[8:],
                               "reserved bytes are not zero (010000)"),
    "another version": (data(2, 0, A), "sent version 2 while version 1 was expected"),
    "a second handshake": (wire.ANSWER.pack(b"WSHA", 3, 0, bytes(32)), "without the weightsync magic"),
    "a truncated header": (frame(wire.DATA, 1, 0, 64)[:20], "connection lost during version 1"),
    "a truncated payload": (frame(wire.DATA, 1, 0, 64) + A[:10], "connection lost during version 1"),
    "a missing trailer": (frame(wire.DATA, 1, 0, 64) + A + b"\x00\x01", "connection lost during version 1"),
}


@pytest.mark.parametrize("crafted", list(CRAFTED), ids=list(CRAFTED))
def test_crafted_frames_after_the_handshake_cut_the_trainer_off(crafted, caplog):
    """Every kind of crafted input from an authenticated trainer fails the version with a
    TransferError naming it and a log line naming it; nothing is returned as received (so
    nothing is verified or applied); the connection is cut; the real trainer then delivers."""
    stream, message = CRAFTED[crafted]
    receiver, endpoint = pair()
    receiver.expect_trainers(4)
    sock = authenticated_raw_client(endpoint, trainer_rank=3)
    buf = bytearray(256)
    t, out = receive_in_thread(receiver, 1, buf, PLANNED, 30)
    sock.sendall(stream)
    if crafted.startswith("a truncated") or crafted == "a missing trailer":
        sock.shutdown(socket.SHUT_WR)
    t.join(30)
    assert not t.is_alive()
    assert "sums" not in out, f"crafted input ({crafted}) was accepted"
    error = out["error"]
    assert isinstance(error, TransferError) and error.peer == "trainer rank 3", error
    assert message in str(error), error
    assert any(r.getMessage().startswith("inference rank 0 cut off trainer rank 3:") for r in caplog.records)
    if "plan" in message or "kind" in message or "never sends" in message:
        assert buf == bytes(256), "bytes of a refused frame were read into the buffer"
    sock.settimeout(10)
    try:  # the receiver closed the connection: what is left ends, and nothing more is answered
        while sock.recv(1 << 16):
            pass
    except ConnectionResetError:
        pass
    sock.close()
    # the port still serves the real trainer, over a new connection
    sender = make_transport("tcp", token=TOKEN, timeout=30).sender(3)
    sender.connect({0: endpoint})
    t, out = receive_in_thread(receiver, 2, buf, PLANNED, 30)
    sender.send(0, 2, 0, A)
    sender.send(0, 2, 64, B)
    sender.end_version(2)
    t.join(30)
    assert "error" not in out, out.get("error")
    assert bytes(buf[:128]) == A + B
    sender.close(), receiver.close()


def test_an_authenticated_rank_outside_the_plan_is_refused():
    receiver, endpoint = pair()
    receiver.expect_trainers(2)
    sender = make_transport("tcp", token=TOKEN, timeout=5).sender(7)
    with pytest.raises(TransferError, match="inference rank 0: handshake .* failed: the peer refused"):
        sender.connect({0: endpoint})
    wait_refused(receiver, "trainer rank 7 is not in the plan, which has 2 trainer ranks")
    receiver.close()


def raw_connect(endpoint):
    host, port = sockets.parse_endpoint(endpoint)
    sock = socket.create_connection((host, port), timeout=30)
    return sock, f"{host}:{sock.getsockname()[1]}"


def wait_refused(receiver, fragment, timeout=30):
    deadline = time.monotonic() + timeout
    with receiver.cond:
        while not any(fragment in r for r in receiver.refused):
            left = deadline - time.monotonic()
            assert left > 0, f"never refused: {fragment!r}; refused: {list(receiver.refused)}"
            receiver.cond.wait(left)


def closed_by_peer(sock) -> bool:
    sock.settimeout(30)
    try:
        while sock.recv(1 << 16):
            pass
    except ConnectionResetError:
        pass
    return True


@pytest.mark.parametrize("crafted,why", [
    (frame(wire.DATA, 1, 0, 64) + A, "not a weightsync handshake"),  # frames instead of an answer
    (b"GET / HTTP/1.1\r\nHost: x\r\n\r\n" + b"A" * 40, "not a weightsync handshake"),
    (wire.ANSWER.pack(b"WSHA", 0, 0, bytes(32)), "wrong token (claimed trainer rank 0)"),
])
def test_crafted_input_before_the_handshake_is_refused_naming_the_address(crafted, why, caplog):
    receiver, endpoint = pair()
    sock, me = raw_connect(endpoint)
    assert sockets.recv_exact(sock, wire.CHALLENGE.size)[:4] == b"WSHC"
    sock.sendall(crafted)
    wait_refused(receiver, f"refused connection from {me}: {why}")
    assert closed_by_peer(sock)
    assert any(f"inference rank 0 refused connection from {me}: {why}" in r.getMessage() for r in caplog.records)
    assert receiver.conns == {}
    sock.close(), receiver.close()


def test_a_partial_answer_is_refused_when_closed_or_silent(monkeypatch):
    from weightsync.transport import door

    monkeypatch.setattr(door, "HANDSHAKE_TIMEOUT", 0.5)
    receiver, endpoint = pair()
    closing, me = raw_connect(endpoint)
    closing.sendall(b"WSHA\x00")
    closing.shutdown(socket.SHUT_WR)
    wait_refused(receiver, f"refused connection from {me}: closed after 5 of the 44 bytes of a handshake answer")
    silent, me = raw_connect(endpoint)
    silent.sendall(b"WSHA\x00")
    wait_refused(receiver, f"refused connection from {me}: no handshake answer within 0.5s")
    assert closed_by_peer(silent)
    closing.close(), silent.close(), receiver.close()


def test_refusals_are_logged_at_most_once_per_interval_with_a_count(caplog):
    from weightsync.transport import door

    receiver, endpoint = pair()
    for _ in range(20):
        sock, _ = raw_connect(endpoint)
        sock.sendall(b"X" * wire.ANSWER.size)
        closed_by_peer(sock)
        sock.close()
    wait_refused(receiver, "not a weightsync handshake")
    lines = [r.getMessage() for r in caplog.records if "refused connection" in r.getMessage()]
    assert 1 <= len(lines) < 20 and len(receiver.refused) == receiver.refused.maxlen
    assert door.LOG_INTERVAL >= 1
    receiver.close()


@pytest.mark.parametrize("threads", [1, 4])
def test_the_door_survives_bursts_of_connections_opened_and_closed_at_once(threads):
    receiver, endpoint = pair()
    receiver.expect_trainers(1)  # a small cap: the burst makes the door close pending connections itself
    host, port = sockets.parse_endpoint(endpoint)

    def burst():
        for _ in range(6):
            socks = [socket.create_connection((host, port), timeout=30) for _ in range(40)]
            for s in socks:
                s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # a reset, at once
                s.close()

    workers = [threading.Thread(target=burst) for _ in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    assert receiver.door.thread.is_alive(), "the door thread died: the data port no longer accepts"
    sock = authenticated_raw_client(endpoint)  # a trainer still gets in after the burst
    sock.close()
    receiver.close()


# ---------------------------------------------------------------- patches (delta versions)


def a_patch(base: bytes, new: bytes, base_version: int) -> bytes:
    """A real patch of `new` against `base` (delta.py), as a trainer makes it."""
    import numpy as np

    from weightsync.plan.segments import Bucket
    from weightsync.transfer.delta import LastSent

    last = LastSent([Bucket(0, 0, 0, len(base))], 2)
    last.encoder(0, None).add(0, np.frombuffer(base, dtype=np.uint8))
    encoder = last.encoder(0, base_version)
    encoder.add(0, np.frombuffer(new, dtype=np.uint8).copy())
    return b"".join(encoder.finish(len(new)))


def test_a_patch_is_applied_and_a_damaged_one_asked_for_again_whole():
    import torch

    from weightsync.transfer.delta import Patcher

    base = bytes(range(256)) * 16  # two ranges of 2 KiB
    new = bytearray(base)
    new[10] ^= 1
    new[3000] ^= 2
    new = bytes(new)
    first, second = a_patch(base[:2048], new[:2048], 4), a_patch(base[2048:], new[2048:], 4)
    staging = torch.zeros(4096, dtype=torch.uint8)
    patcher = Patcher(4, torch.frombuffer(bytearray(base), dtype=torch.uint8), staging)
    receiver, endpoint = pair()
    sock = authenticated_raw_client(endpoint)
    out = {}

    def run():
        out["sums"] = receiver.receive(5, staging, {0: [(0, 2048), (2048, 2048)]}, 10, patcher)
    t = threading.Thread(target=run)
    t.start()
    sum1, sum2 = xxhash.xxh3_64_intdigest(new[:2048]), xxhash.xxh3_64_intdigest(new[2048:])
    sock.sendall(wire.header(wire.PATCH, 5, 0, len(first), sum1) + first + wire.TRAILER.pack(xxhash.xxh3_64_intdigest(first)))
    damaged = bytes([second[0] ^ 0xFF]) + second[1:]
    sock.sendall(wire.header(wire.PATCH, 5, 2048, len(second), sum2) + damaged
                 + wire.TRAILER.pack(xxhash.xxh3_64_intdigest(second)))
    sock.sendall(wire.header(wire.END, 5, 2, 4096))
    frame = wire.parse_header(sockets.recv_exact(sock, wire.HEADER.size))
    assert wire.parse_need(frame, sockets.recv_exact(sock, frame.length)) == [2048]
    sock.sendall(wire.header(wire.DATA, 5, 2048, 2048) + new[2048:] + wire.TRAILER.pack(sum2))
    sock.sendall(wire.header(wire.END, 5, 1, 2048))
    t.join(10)
    assert out["sums"] == {0: sum1, 2048: sum2} and bytes(staging.numpy()) == new
    assert patcher.applied == 1 and "damaged in transit" in patcher.refused[0]
    sock.close(), receiver.close()


def test_a_patch_for_a_range_outside_the_plan_is_refused():
    receiver, endpoint = pair()
    sock = authenticated_raw_client(endpoint)
    t, out = receive_in_thread(receiver, 1, bytearray(128), {0: [(0, 64)]}, 5)
    sock.sendall(wire.header(wire.PATCH, 1, 64, 10, 0) + b"\0" * 10 + wire.TRAILER.pack(0))
    t.join(5)
    assert "PATCH for bytes at 64 of version 1, which the plan does not give it" in str(out["error"])
    sock.close(), receiver.close()


def test_a_need_for_bytes_not_sent_as_a_patch_fails_the_sender():
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    sender = make_transport("tcp", token=TOKEN, timeout=10).sender(0)

    def inference_rank():  # the receiver's side of the handshake, then a NEED for bytes never patched
        sock, _ = listener.accept()
        challenge = wire.challenge(0)
        sock.sendall(challenge)
        answer = sockets.recv_exact(sock, wire.ANSWER.size)
        wire.check_answer(TOKEN, challenge, answer)
        sock.sendall(wire.verdict(TOKEN, challenge, answer))
        frame = wire.parse_header(sockets.recv_exact(sock, wire.HEADER.size))
        sockets.recv_exact(sock, frame.length + wire.TRAILER.size)
        sockets.recv_exact(sock, wire.HEADER.size)  # END
        sock.sendall(wire.need(1, [4096]))
        return sock
    held = []
    t = threading.Thread(target=lambda: held.append(inference_rank()))
    t.start()
    sender.connect({0: f"127.0.0.1:{port}"})
    sender.send_patch(0, 1, 0, 4096, [b"a patch"], 123, lambda: b"\0" * 4096)
    with pytest.raises(TransferError) as err:
        sender.end_version(1)
    t.join(5)
    assert err.value.peer == "inference rank 0" and "asked again for bytes at 4096 of version 1" in str(err.value)
    sender.close(), listener.close(), held[0].close()
