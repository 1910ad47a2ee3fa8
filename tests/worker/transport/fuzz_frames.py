"""A fuzz pass over the inference data port's parsing: atheris feeds bytes to a real listening
TcpReceiver over real loopback sockets.

Each input is one connection. Its first byte picks what the rest is:
  0  the bytes a trainer sends after a valid handshake, as they are;
  1  a recipe for frames (kinds, versions, ranges, payloads, right or wrong checksums and
     counts), built into bytes, so that the fuzzer gets past the checksums to the deeper checks;
  2  the bytes a client sends instead of a handshake answer (before proving the token).
After the bytes the client closes its side, so a receiver that waits for more is a bug (a hang),
not a slow peer. The plan is small: version 7, trainer rank 1 sends three ranges of a 512-byte
buffer. Every input must end in one of two ways: accepted, with each range's checksum equal to
the bytes that landed, or refused with the transport's own error (a TransferError naming
trainer rank 1, or the door refusing the connection). Any other exception, a hang (the receiver
waiting on a peer that has closed), or memory growing by more than `--rss-growth-mb N` (default
512) over what the process held at its first input, is a crash. The harness checks that itself
(libFuzzer's -rss_limit_mb is off): libFuzzer's limit counts the peak of the whole process,
setup included, which differs by machine; this one measures what the parser grows by.

The test suite runs it for a bounded time (test_fuzz_frames.py). By hand, for longer, from the
repository root:
  PYTHONPATH=worker python tests/worker/transport/fuzz_frames.py -max_total_time=3600 --rss-growth-mb 512 \\
      -max_len=4096 -timeout=30 --seeds-into CORPUS_DIR CORPUS_DIR
(-seed=N repeats a run; a crash leaves its input in crash-* for `python tests/worker/transport/fuzz_frames.py
crash-...` to replay.)
"""

import logging
import os
import socket
import struct
import sys

import atheris
import xxhash

with atheris.instrument_imports():
    from weightsync.transport import TransferError, sockets, wire
    from weightsync.transport.tcp_receiver import TcpReceiver

TOKEN = b"fuzz-job-token-0123456789abcdef"
TRAINER, INFERENCE, VERSION = 1, 0, 7
RANGES = [(0, 64), (64, 32), (96, 160)]
PLAN = {TRAINER: RANGES}
BUFFER = 512
U64 = 2 ** 64 - 1
MAX_STREAM = 64 << 10  # fits in a loopback socket's buffers: the client never blocks on a refusing receiver
# a receiver that waits this long on a client that has closed its side has hung
SILENT = 20.0

CHECK_EVERY = 64  # inputs between two looks at the resident memory
growth_limit = 512  # MiB (--rss-growth-mb)
inputs = 0
baseline: int | None = None  # MiB resident at the first input

receiver: TcpReceiver | None = None
endpoint: tuple[str, int] | None = None
seen: set[str] = set()


def first(outcome: str) -> None:
    """Say once per run that an outcome happened (the test checks both were reached)."""
    if outcome not in seen:
        seen.add(outcome)
        print(f"fuzz_frames: first input {outcome}", flush=True)


def valid_stream() -> bytes:
    out = b""
    for offset, length in RANGES:
        payload = bytes((offset + i) % 251 for i in range(length))
        out += wire.header(wire.DATA, VERSION, offset, length) + payload + wire.TRAILER.pack(xxhash.xxh3_64_intdigest(payload))
    return out + wire.header(wire.END, VERSION, len(RANGES), sum(n for _, n in RANGES))


def seeds() -> list[bytes]:
    """Inputs to start from: a valid version, and near misses."""
    valid = valid_stream()
    return [b"\x00" + valid, b"\x00" + valid[:-1], b"\x00" + valid[:40 + 64] + b"\x00" * 8 + valid[40 + 64 + 8:],
            b"\x00" + wire.header(wire.DATA, VERSION, 0, U64), b"\x00" + wire.header(wire.PATCH, VERSION, 0, 0) + bytes(8),
            b"\x01" + bytes(range(64)),
            b"\x02" + wire.ANSWER.pack(b"WSHA", TRAINER, INFERENCE, bytes(32))]


def recipe(fdp: "atheris.FuzzedDataProvider") -> bytes:
    """Frames built from a recipe: mostly well-formed, each field sometimes wrong."""
    out = bytearray()
    frames = nbytes = 0
    while fdp.remaining_bytes() and len(out) < MAX_STREAM:
        step = fdp.ConsumeIntInRange(0, 9)
        version = VERSION if fdp.ConsumeBool() else fdp.ConsumeIntInRange(0, U64)
        if step <= 5:  # a DATA frame
            if fdp.ConsumeBool():
                offset, length = fdp.PickValueInList(RANGES)
            else:
                offset, length = fdp.ConsumeIntInRange(0, U64), fdp.ConsumeIntInRange(0, U64)
            size = min(length, 512) if fdp.ConsumeBool() else fdp.ConsumeIntInRange(0, 512)  # as announced, or not
            payload = fdp.ConsumeBytes(size)
            trailer = xxhash.xxh3_64_intdigest(payload) if fdp.ConsumeBool() else fdp.ConsumeIntInRange(0, U64)
            out += wire.header(wire.DATA, version, offset, length) + payload + wire.TRAILER.pack(trailer)
            frames, nbytes = frames + 1, nbytes + length
        elif step == 6:  # END, with the counts so far or others
            if fdp.ConsumeBool():
                count, total = frames, nbytes % (U64 + 1)
            else:
                count, total = fdp.ConsumeIntInRange(0, U64), fdp.ConsumeIntInRange(0, U64)
            out += wire.header(wire.END, version, count, total)
        elif step == 7:  # any header at all
            out += struct.pack("<4sB3sQQQQ", wire.MAGIC if fdp.ConsumeBool() else fdp.ConsumeBytes(4).ljust(4, b"\0"),
                               fdp.ConsumeIntInRange(0, 255),
                               b"\0\0\0" if fdp.ConsumeBool() else fdp.ConsumeBytes(3).ljust(3, b"\0"),
                               version, fdp.ConsumeIntInRange(0, U64), fdp.ConsumeIntInRange(0, U64),
                               fdp.ConsumeIntInRange(0, U64))
        elif step == 8:  # raw bytes
            out += fdp.ConsumeBytes(fdp.ConsumeIntInRange(0, 128))
        else:  # cut short
            del out[len(out) - fdp.ConsumeIntInRange(0, min(len(out), 48)):]
            break
    return bytes(out[:MAX_STREAM])


def closed_by_receiver(sock: socket.socket) -> None:
    """Read until the receiver closes the connection (it must, having refused it)."""
    sock.settimeout(SILENT)
    try:
        while sock.recv(1 << 16):
            pass
    except ConnectionResetError:
        pass
    except socket.timeout:
        raise AssertionError(f"the receiver kept a refused pre-handshake connection open for {SILENT:g}s") from None


def before_handshake(stream: bytes) -> None:
    sock = socket.create_connection(endpoint, timeout=SILENT)
    try:
        assert wire.parse_challenge(sockets.recv_exact(sock, wire.CHALLENGE.size)) == INFERENCE
        try:
            sock.sendall(stream)
            sock.shutdown(socket.SHUT_WR)
        except (BrokenPipeError, ConnectionResetError, OSError):
            pass  # the door refused the answer and closed while the rest was on its way
        closed_by_receiver(sock)
    finally:
        sock.close()
    assert receiver.door.thread.is_alive(), "the data port's door died"
    assert not receiver.conns, "a connection that never proved the token was admitted"
    first("refused before the handshake")


def after_handshake(stream: bytes) -> None:
    sock = socket.create_connection(endpoint, timeout=SILENT)
    try:
        sockets.client_handshake(sock, TOKEN, TRAINER, INFERENCE)
        sock.sendall(stream)
        sock.shutdown(socket.SHUT_WR)
        buf = bytearray(BUFFER)
        try:
            sums = receiver.receive(VERSION, buf, PLAN, timeout=SILENT)
        except TransferError as e:
            assert e.peer == f"trainer rank {TRAINER}", e
            assert "silent for" not in str(e) and "did not connect" not in str(e), f"the receiver hung: {e}"
            first("refused")
            return
        assert set(sums) == {o for o, _ in RANGES}, sums
        for offset, length in RANGES:
            assert sums[offset] == xxhash.xxh3_64_intdigest(bytes(buf[offset:offset + length]))
        first("accepted")
    finally:
        sock.close()
        receiver.drop(TRAINER)  # the next input starts on a connection of its own


def check_memory() -> None:
    """Every CHECK_EVERY inputs: a MemoryError (a crash, with the input) once the process holds
    more than growth_limit MiB beyond what it held at its first input."""
    global inputs, baseline
    inputs += 1
    if inputs % CHECK_EVERY != 1:
        return
    now = resident_mb()
    if baseline is None:
        baseline = now
    elif now - baseline > growth_limit:
        raise MemoryError(f"resident memory grew by {now - baseline} MiB since the first input (limit {growth_limit})")


def TestOneInput(data: bytes) -> None:  # noqa: N802 - the entry point's name in atheris and libFuzzer
    check_memory()
    if not data:
        return
    mode, rest = data[0] % 3, data[1:]
    if mode == 2:
        before_handshake(rest[:MAX_STREAM])
    elif mode == 1:
        after_handshake(recipe(atheris.FuzzedDataProvider(rest)))
    else:
        after_handshake(rest[:MAX_STREAM])


def resident_mb() -> int:
    """This process's resident memory now, in MiB."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") >> 20


def main() -> None:
    global receiver, endpoint
    logging.disable(logging.CRITICAL)  # every refused input logs a line
    receiver = TcpReceiver(INFERENCE, TOKEN, timeout=SILENT)
    host, port = receiver.listen("127.0.0.1", 0).rsplit(":", 1)
    endpoint = (host, int(port))
    receiver.expect_trainers(TRAINER + 1)
    argv = list(sys.argv)
    if "--seeds-into" in argv:  # write the seeds into the corpus directory the run starts from
        i = argv.index("--seeds-into")
        seed_dir = argv[i + 1]
        del argv[i:i + 2]
        os.makedirs(seed_dir, exist_ok=True)
        for n, s in enumerate(seeds()):
            with open(os.path.join(seed_dir, f"seed-{n}"), "wb") as f:
                f.write(s)
    global growth_limit
    if "--rss-growth-mb" in argv:
        i = argv.index("--rss-growth-mb")
        growth_limit = int(argv[i + 1])
        del argv[i:i + 2]
    argv.insert(1, "-rss_limit_mb=0")
    atheris.Setup(argv, TestOneInput)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
