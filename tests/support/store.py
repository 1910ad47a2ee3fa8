"""What someone on the path between a client and the store sees: a recording proxy."""

from __future__ import annotations

import socket
import threading

from weightsync.rendezvous.store.client import StoreClient


def record_session(port: int, token: bytes, job: str, talk) -> bytes:
    """The bytes a real client sends to the store at `port` while talk(client) runs, through a
    recording proxy between them, as someone on the path would see them."""
    listener = socket.create_server(("127.0.0.1", 0))
    captured = bytearray()
    done = threading.Event()

    def pipe(src, dst, record):
        while True:
            try:
                data = src.recv(65536)
            except OSError:
                data = b""
            if not data:
                try:
                    dst.shutdown(socket.SHUT_WR)
                except OSError:
                    pass
                return
            if record:
                captured.extend(data)
            dst.sendall(data)

    def proxy():
        down, _ = listener.accept()
        up = socket.create_connection(("127.0.0.1", port))
        back = threading.Thread(target=pipe, args=(up, down, False))
        back.start()
        pipe(down, up, True)
        back.join(60)
        done.set()

    threading.Thread(target=proxy, daemon=True).start()
    with StoreClient("127.0.0.1", listener.getsockname()[1], token, job, timeout=30) as c:
        talk(c)
    assert done.wait(60)
    listener.close()
    return bytes(captured)


def recv_all(sock: socket.socket, timeout: float = 30.0) -> bytes:
    """Everything the peer sends until it closes the connection."""
    sock.settimeout(timeout)
    out = b""
    while True:
        try:
            chunk = sock.recv(65536)
        except ConnectionResetError:
            return out
        if not chunk:
            return out
        out += chunk
