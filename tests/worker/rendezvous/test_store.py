"""The rendezvous store over real sockets: its operations, the handshake that keeps out whoever
lacks the job's token (or belongs to another job), replays refused, the bounds on what a client
can make the server hold, deadlines against a frozen or dead server, and torch.distributed (gloo)
meeting through it in two processes."""
from __future__ import annotations

import datetime
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch.distributed as dist
from support.store import record_session, recv_all
from support.waits import until

from weightsync.rendezvous.protocol import Channel
from weightsync.rendezvous.store.client import StoreClient
from weightsync.rendezvous.store.server import HANDSHAKE_SECONDS, StoreServer
from weightsync.rendezvous.store.table import Limits, StoreError, StoreFull, StoreRefused, StoreTimeout
from weightsync.rendezvous.store.wire import CODES, HELLO, OK, PROOF, VERDICT, handshake_macs, pack, read_frame, seal
from weightsync.rendezvous.store.wire import ERROR as CODES_ERROR
from weightsync.transport.sockets import recv_exact

TOKEN = b"0123456789abcdef0123456789abcdef"
JOB = "team-a/job-1"
SLACK = 15.0  # generous room on a loaded machine around a deadline that must hold


@pytest.fixture()
def server():
    s = StoreServer("127.0.0.1", 0, TOKEN, JOB)
    yield s
    s.close()


def client(server, token=TOKEN, job=JOB, timeout=10.0, **kw) -> StoreClient:
    return StoreClient("127.0.0.1", server.port, token, job, timeout=timeout, **kw)


def raw_session(port: int, token: bytes = TOKEN, job: str = JOB) -> tuple[socket.socket, bytes]:
    """A hand-made authenticated connection: (socket, session key)."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=30)
    _, version, server_nonce = HELLO.unpack(recv_exact(sock, HELLO.size))
    assert version == 1
    client_nonce = os.urandom(32)
    proof, answer, key = handshake_macs(token, job, server_nonce, client_nonce)
    sock.sendall(PROOF.pack(b"WSKV", client_nonce, proof))
    assert VERDICT.unpack(recv_exact(sock, VERDICT.size)) == (1, answer)
    return sock, key


def request(name: str, *args) -> bytes:
    return bytes([CODES[name]]) + pack(args)


def test_the_operations_torch_and_the_rendezvous_use(server):
    c = client(server)
    c.set("a", b"1")
    c.set("text", "a str value")
    assert c.get("a") == b"1" and c.get("text") == b"a str value"
    assert (c.add("n", 3), c.add("n", 2), c.add("n", 0)) == (3, 5, 5)
    assert c.check(["a", "n"]) and not c.check(["a", "missing"])
    assert c.compare_set("cs", b"", b"x") == b"x"  # unset and nothing expected: set
    assert c.compare_set("cs", b"y", b"z") == b"x"  # not what was expected: unchanged
    assert c.compare_set("cs", b"x", b"z") == b"z"
    assert c.compare_set("unset", b"e", b"d") == b"e" and not c.check(["unset"])
    c.append("log", b"ab")
    c.append("log", b"cd")
    c.multi_set(["m1", "m2"], [b"1", b"2"])
    assert c.get("log") == b"abcd" and c.multi_get(["m1", "m2"]) == [b"1", b"2"]
    assert c.num_keys() == 7
    assert c.delete_key("cs") and not c.delete_key("cs") and c.num_keys() == 6
    with pytest.raises(StoreError, match="add: 'log' holds b'abcd', not a number"):
        c.add("log", 1)
    # the process that runs the server reads and writes the same table without a socket
    server.set("from-host", "1")
    assert c.get("from-host") == b"1" and server.get("a") == b"1"


def test_waits_end_at_their_deadline_naming_the_keys(server):
    c = client(server, timeout=2.0)
    with pytest.raises(StoreTimeout, match="get: never not set within"):
        c.get("never")
    with pytest.raises(StoreTimeout, match="wait: gone, also-gone not set within"):
        c.wait(["gone", "also-gone"], datetime.timedelta(seconds=1))
    assert c.check([]) is True  # the connection is still good after a key's timeout

    def later():
        server.set("soon", b"here")

    threading.Timer(0.2, later).start()
    assert c.get("soon") == b"here"  # get waits for a key that is set meanwhile
    c.wait(["soon"], datetime.timedelta(seconds=5))


def test_the_hosts_watch_hands_out_each_key_once_as_it_is_set(server):
    c = client(server)
    c.set("r/0", b"early")
    with server.arrivals(["r/0", "r/1", "r/2"]) as watch:
        assert watch.take(0.0) == ["r/0"]  # set before the watch: handed out first
        assert watch.take(0.05) == []  # nothing more: the wait ends at its deadline
        threading.Timer(0.1, lambda: c.set("r/2", b"late")).start()
        assert watch.take(5.0 + SLACK) == ["r/2"]  # the wait ends as a key is set, not at its deadline
        c.set("other", b"x")
        c.set("r/1", b"1")
        c.set("r/1", b"1 again")
        assert watch.take(0.0) == ["r/1"]  # once, however often it was set since the last take
    assert not server._arrivals  # closed: nothing watched any more
    c.set("r/0", b"after")
    server.close()
    with server.arrivals(["r/9"]) as closed:
        assert closed.take(5.0 + SLACK) == []  # a closing store ends the wait at once


@pytest.mark.parametrize("seconds", [float("nan"), float("inf"), float("-inf")])
def test_a_wait_of_no_number_of_seconds_is_refused_at_once(server, seconds):
    """A token holder's get or wait with a NaN or infinite timeout is an error, not a server thread
    that spins for ever."""
    sock, key = raw_session(server.port)
    for seq, (name, args) in enumerate([("wait", ([b"never"], seconds)), ("get", (b"never", seconds))], start=1):
        sock.sendall(seal(key, b"C", seq, request(name, *args)))
        reply = read_frame(sock, key, b"S", seq, 1 << 20)
        assert reply[0] == CODES_ERROR and b"is no number of seconds" in reply
    sock.close()


def test_prefix_store_and_clone_over_the_client(server):
    c = client(server)
    prefixed = dist.PrefixStore("ddp", c)
    prefixed.set("k", "v")
    assert c.get("ddp/k") == b"v" and prefixed.get("k") == b"v"
    assert prefixed.add("n", 2) == 2 and prefixed.check(["k", "n"])
    assert prefixed.num_keys() == 2  # the C++ side calls getNumKeys
    assert prefixed.delete_key("k") and not c.check(["ddp/k"])  # and deleteKey
    other = c.clone()
    assert other.get("ddp/n") == b"2" and other is not c


def test_a_client_without_the_token_is_refused(server):
    with pytest.raises(StoreRefused, match="refused this client's proof"):
        client(server, token=b"not-the-job-token-0123456789abcd")
    # the same token for another job's name is another job
    with pytest.raises(StoreRefused, match="refused this client's proof"):
        client(server, job="team-a/job-2")
    assert server.num_keys() == 0


def test_a_client_does_not_trust_a_server_without_the_token():
    impostor = socket.create_server(("127.0.0.1", 0))

    def serve():
        conn, _ = impostor.accept()
        conn.sendall(HELLO.pack(b"WSKV", 1, os.urandom(32)))
        recv_exact(conn, PROOF.size)
        conn.sendall(VERDICT.pack(1, os.urandom(32)))  # accepts anyone, proves nothing
        recv_all(conn)
        conn.close()

    threading.Thread(target=serve, daemon=True).start()
    with pytest.raises(StoreRefused, match="did not prove it holds the token of job team-a/job-1"):
        StoreClient("127.0.0.1", impostor.getsockname()[1], TOKEN, JOB, timeout=10)
    impostor.close()


def test_without_the_token_nothing_is_read_or_written(server):
    server.set("plan", b"the plan")
    forged_key = os.urandom(32)
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:
        magic, version, _ = HELLO.unpack(recv_exact(sock, HELLO.size))
        assert (magic, version) == (b"WSKV", 1)
        sock.sendall(PROOF.pack(b"WSKV", os.urandom(32), os.urandom(32)))
        try:  # frames as if the proof had passed: read the plan, end the job
            sock.sendall(seal(forged_key, b"C", 1, request("get", b"plan", 1.0)) +
                         seal(forged_key, b"C", 2, request("set", b"end", b'{"state": "Failed"}')))
        except OSError:
            pass  # the server may have closed already
        rest = recv_all(sock)
    assert rest == VERDICT.pack(0, bytes(32)), "the server sent more than its refusal"
    assert not server.check(["end"]) and server.num_keys() == 1


def test_junk_before_the_handshake_is_not_read(server):
    # what a TCPStore client, or any stranger, sends: never more than the proof's size is read
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:
        HELLO.unpack(recv_exact(sock, HELLO.size))
        try:
            for _ in range(64):
                sock.sendall(os.urandom(1 << 20))
        except OSError:
            pass  # refused and closed while sending
        assert recv_all(sock) == VERDICT.pack(0, bytes(32))
    assert server.num_keys() == 0 and server.bytes_held == 0


def test_a_captured_session_replayed_on_a_new_connection_is_refused(server):
    def talk(c):
        c.set("x", b"1")
        assert c.add("counter", 1) == 1

    captured = record_session(server.port, TOKEN, JOB, talk)
    server.delete_key("x")

    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:
        HELLO.unpack(recv_exact(sock, HELLO.size))
        sock.sendall(bytes(captured))  # the whole client side: proof, set, add
        assert recv_all(sock) == VERDICT.pack(0, bytes(32))
    assert not server.check(["x"]) and server.get("counter") == b"1"


@pytest.mark.parametrize("attack", ["replayed", "reordered", "altered", "reflected"])
def test_within_a_session_a_frame_replayed_reordered_altered_or_reflected_closes_it(server, attack):
    sock, key = raw_session(server.port)
    first = seal(key, b"C", 1, request("add", b"n", 1))
    sock.sendall(first)
    reply = read_frame(sock, key, b"S", 1, 1 << 20)
    assert reply[0] == OK
    bad = {"replayed": first,
           "reordered": seal(key, b"C", 3, request("add", b"n", 1)),
           "altered": first[:-40] + bytes([first[-40] ^ 1]) + first[-39:],
           "reflected": seal(key, b"S", 2, request("add", b"n", 1))}[attack]
    sock.sendall(bad)
    assert recv_all(sock) == b"", "the server answered a bad frame"
    sock.close()
    assert server.get("n") == b"1"


def test_an_authenticated_client_is_bounded_with_errors_that_name_the_bound():
    limits = Limits(value_bytes=10_000, total_bytes=100_000, keys=50)
    s = StoreServer("127.0.0.1", 0, TOKEN, JOB, limits)
    try:
        c = client(s)
        with pytest.raises(StoreFull, match="over the store's limit of 67108864 bytes per value"):
            c.set("huge", b"x" * (65 << 20))  # refused before it is sent
        # a client that does not check (its own limits are larger) is refused by the server
        loose = client(s)
        with pytest.raises(StoreFull, match="a value of 20000 bytes for 'big' is over the store's limit of 10000"):
            loose.set("big", b"x" * 20_000)
        written = 0
        with pytest.raises(StoreFull, match="over its limit of 100000 bytes"):
            for i in range(1000):
                c.set(f"fill/{i}", b"x" * 9_000)
                written += 1
        assert 0 < written < 12 and s.bytes_held <= limits.total_bytes
        c.set("fill/0", b"y" * 9_000)  # replacing a value within the bound still works
        assert c.delete_key("fill/1")
        c.set("fill/again", b"z" * 1000)  # deleting frees room
        with pytest.raises(StoreFull, match="holds its limit of 50 keys"):
            for i in range(100):
                c.set(f"k/{i}", b"")
        assert s.num_keys() == 50 and s.bytes_held <= limits.total_bytes
        assert c.get("fill/0") == b"y" * 9_000  # the connection survives a refused request
    finally:
        s.close()


def test_unauthenticated_connections_are_capped_oldest_first_and_timed_out():
    s = StoreServer("127.0.0.1", 0, TOKEN, JOB, Limits(pending=2))
    try:
        idle = [socket.create_connection(("127.0.0.1", s.port), timeout=30) for _ in range(2)]
        for sock in idle:
            assert HELLO.unpack(recv_exact(sock, HELLO.size))[1] == 1
        with socket.create_connection(("127.0.0.1", s.port), timeout=30) as third:
            assert HELLO.unpack(recv_exact(third, HELLO.size))[1] == 1  # let in: the oldest made room
            assert recv_all(idle[0]) == b""
            c = client(s, connect_timeout=10)  # a client with the token gets in at once, the same way
            c.set("in", b"1")
            # the rest are closed at their deadline
            for sock in (idle[1], third):
                assert recv_all(sock, timeout=HANDSHAKE_SECONDS + 60) == b""
        for sock in idle:
            sock.close()
    finally:
        s.close()


def test_a_flood_of_connections_without_the_token_takes_no_slot_from_the_job():
    """Clients without the token that hold as many connections as they can and open a new one as
    soon as one is closed (more than every budget of a 4-rank job) do not keep a rank out: it
    connects within its usual deadline, and uses all the authenticated slots it needs."""
    s = StoreServer("127.0.0.1", 0, TOKEN, JOB, Limits(connections=4, pending=8))
    stop = threading.Event()

    def flood():
        while not stop.is_set():
            try:
                with socket.create_connection(("127.0.0.1", s.port), timeout=30) as sock:
                    sock.recv(1 << 10)  # the HELLO, then hold it until the server closes it
                    sock.recv(1 << 10)
            except OSError:
                pass

    threads = [threading.Thread(target=flood, daemon=True) for _ in range(40)]
    for t in threads:
        t.start()
    try:
        # the flood holds every slot of the connections that have not proven the token (however
        # long its threads take to start on a busy machine) before the ranks connect
        until("the flood filling the unauthenticated slots", lambda: len(s._handshaking) >= s.limits.pending, 30)
        ranks = [client(s, connect_timeout=30) for _ in range(4)]
        for i, c in enumerate(ranks):
            c.set(f"rank{i}", b"here")
        assert all(ranks[0].get(f"rank{i}") == b"here" for i in range(4))
    finally:
        stop.set()
        s.close()
        for t in threads:
            t.join(30)


def test_connections_are_capped():
    s = StoreServer("127.0.0.1", 0, TOKEN, JOB, Limits(connections=2))
    try:
        first, second = client(s), client(s)
        with pytest.raises(StoreError, match="is at its connection limit"):
            client(s, connect_timeout=1.0)
        first.close()
        deadline = time.monotonic() + 30
        while True:  # the server notices the close on its own thread
            try:
                third = client(s, connect_timeout=1.0)
                break
            except StoreError:
                assert time.monotonic() < deadline
        third.set("k", b"v")
        assert second.get("k") == b"v"
    finally:
        s.close()


def test_the_server_binds_one_address_never_every_interface():
    for wildcard in ("0.0.0.0", "::", ""):
        with pytest.raises(ValueError, match="not every interface"):
            StoreServer(wildcard, 0, TOKEN, JOB)
    s = StoreServer("127.0.0.1", 0, TOKEN, JOB)
    try:
        assert s._listener.getsockname()[0] == "127.0.0.1"
        other = _non_loopback_address()
        if other is None:
            pytest.skip("this machine has no address besides loopback to try the store from")
        with pytest.raises(OSError):
            socket.create_connection((other, s.port), timeout=5).close()
    finally:
        s.close()


def _non_loopback_address() -> str | None:
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as u:
            u.connect(("192.0.2.1", 9))  # no packet is sent: this only picks the outgoing address
            address = u.getsockname()[0]
    except OSError:
        return None
    return None if address.startswith("127.") else address


SERVER = """
import sys, time
from weightsync.rendezvous.store.server import StoreServer
s = StoreServer("127.0.0.1", 0, sys.argv[1].encode(), sys.argv[2])
s.set("here", b"1")
print(s.port, flush=True)
time.sleep(600)
"""


def freeze(pid: int) -> None:
    """SIGSTOP, and wait until every thread of the process is stopped (the signal takes effect
    asynchronously: a thread on another core may still answer one request)."""
    os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + 30
    while any(Path(f"/proc/{pid}/task/{t}/stat").read_text().rsplit(")", 1)[1].split()[0] != "T"
              for t in os.listdir(f"/proc/{pid}/task")):
        assert time.monotonic() < deadline, "the server did not stop"
        time.sleep(0.01)


@pytest.fixture()
def server_process():
    proc = subprocess.Popen([sys.executable, "-c", SERVER, TOKEN.decode(), JOB], stdout=subprocess.PIPE, text=True)
    port = int(proc.stdout.readline())
    yield proc, port
    proc.kill()
    proc.wait()


@pytest.mark.slow  # waits out the client's timeout, once per call: not in `make unit`
@pytest.mark.parametrize("call", ["check", "set", "get", "wait"])
def test_a_frozen_server_is_an_error_within_the_timeout_for_every_call(server_process, call):
    proc, port = server_process
    c = StoreClient("127.0.0.1", port, TOKEN, JOB, timeout=3.0)
    assert c.get("here") == b"1"
    freeze(proc.pid)
    try:
        op = {"check": lambda: c.check(["here"]), "set": lambda: c.set("k", b"v"), "get": lambda: c.get("missing"),
              "wait": lambda: c.wait(["missing"])}[call]
        start = time.monotonic()
        with pytest.raises(StoreTimeout, match=f"did not answer {call} within 3.0s .the controller is frozen"):
            op()
        assert time.monotonic() - start < 3.0 + SLACK
        with pytest.raises(StoreError, match="the connection was lost earlier"):  # and at once after that
            c.check(["here"])
        start = time.monotonic()
        with pytest.raises(StoreError, match="cannot reach the rendezvous store .* within 2s"):
            StoreClient("127.0.0.1", port, TOKEN, JOB, timeout=2.0)
        assert time.monotonic() - start < 2.0 + SLACK
    finally:
        os.kill(proc.pid, signal.SIGCONT)


def test_a_dead_server_is_an_error_at_once(server_process):
    proc, port = server_process
    c = StoreClient("127.0.0.1", port, TOKEN, JOB, timeout=60.0)
    proc.kill()
    proc.wait()
    start = time.monotonic()
    with pytest.raises(StoreError, match="the connection failed during get"):
        c.get("here")
    assert time.monotonic() - start < SLACK


GLOO_RANK = """
import datetime, sys
import torch, torch.distributed as dist
from weightsync.rendezvous.protocol import Channel
from weightsync.rendezvous.store.client import StoreClient
rank, port = int(sys.argv[1]), int(sys.argv[2])
# handed straight to PrefixStore, without a reference of its own
store = dist.PrefixStore("ddp", StoreClient("127.0.0.1", port, sys.argv[3].encode(), sys.argv[4], timeout=60))
dist.init_process_group("gloo", store=store, rank=rank, world_size=2, timeout=datetime.timedelta(seconds=60))
t = torch.full((4,), float(rank + 1))
dist.all_reduce(t)
dist.barrier()
print(t.tolist(), flush=True)
dist.destroy_process_group()
"""


@pytest.mark.slow  # two processes with torch.distributed: not in `make unit`
def test_gloo_process_group_meets_through_the_store_in_two_processes(server):
    procs = [subprocess.Popen([sys.executable, "-c", GLOO_RANK, str(rank), str(server.port), TOKEN.decode(), JOB],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for rank in range(2)]
    outs = []
    for p in procs:
        out, err = p.communicate(timeout=300)
        assert p.returncode == 0, err
        outs.append(out.strip())
    assert outs == ["[3.0, 3.0, 3.0, 3.0]"] * 2
    assert server.num_keys() > 0


def test_a_closing_server_answers_the_requests_it_holds(server):
    # the controller's process closes its server when it ends (atexit): a rank whose request is
    # being answered gets the answer, not a connection cut in the middle
    c = client(server, timeout=60)
    outcome: list = []

    def waiting():
        try:
            c.wait(["never"], datetime.timedelta(seconds=60))
        except StoreError as e:
            outcome.append(e)

    t = threading.Thread(target=waiting)
    t.start()
    deadline = time.monotonic() + 30
    while server._answering == 0:  # the wait is being served
        assert time.monotonic() < deadline
        time.sleep(0.01)
    server.close()
    t.join(30)
    assert len(outcome) == 1 and "wait: the store is closing" in str(outcome[0])


def test_a_wait_is_woken_by_its_own_keys_alone_and_leaves_nothing_behind(server):
    """Each wait is registered under the keys it waits for (a set wakes those waits alone), and
    unregistered when it ends, however it ends: a job's heartbeats, which are sets, wake no client
    that waits for something else, and the store holds nothing of a wait once it ended."""
    ended = []
    waiting = [threading.Thread(target=lambda k=k: ended.append(server.wait([f"w/{k}", "both"], 30.0) or k))
               for k in range(20)]
    for t in waiting:
        t.start()
    until("the 20 waits to be registered under their two keys each", lambda: server.waits == 40, 10.0)
    for beat in range(200):
        server.add("beat/trainer/0", 1)  # a heartbeat: no wait ends, none is dropped
    server.set("w/3", b"1")
    assert server.waits == 40 and ended == []
    server.set("both", b"1")  # every wait has one of its keys now; w/3's has both
    until("the wait whose keys are both set to end", lambda: ended == [3], 10.0)
    for k in range(20):
        server.set(f"w/{k}", b"1")
    for t in waiting:
        t.join(10.0)
    assert sorted(ended) == list(range(20)) and server.waits == 0
    with pytest.raises(StoreTimeout):
        server.wait(["never"], 0.05)  # a wait that times out unregisters too
    assert server.waits == 0


def test_a_peek_reads_several_keys_in_one_request_telling_an_empty_value_from_none(server):
    c = client(server)
    c.set("a", b"1")
    c.set("empty", b"")
    before = server.requests
    assert Channel(c).peek(["a", "missing", "empty"]) == [b"1", None, b""]
    assert server.requests == before + 1
    assert Channel(server).peek(["a", "missing", "empty"]) == [b"1", None, b""]  # the store's own process alike
    with pytest.raises(StoreError, match="malformed"):
        c._call("peek", b"not a list")
