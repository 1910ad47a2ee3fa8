"""The transport interface: register buffers once, move version-tagged byte ranges, complete.

A Sender lives on a trainer rank and a Receiver on an inference rank. Connections are opened
once and kept across versions. Every byte range travels with the xxh3_64 checksum of its bytes,
which the receiver verifies before it reports the range delivered. A range may be handed to the
sender before its bytes exist (a Filling): the sender streams them as the producer fills them.
Transports that carry patches also send a range as a patch against bytes the receiver already
holds, which the receiver applies with a Patcher or refuses, and then gets the range whole.

What a transport can do is declared once, on its class, as a Capabilities record that its
senders and receivers carry too; what it needs to be built is its own Options record, which
options_for makes from what any rank offers (a RankContext), so no caller branches on a
transport's name.
"""

from __future__ import annotations

import abc
import threading
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Callable, ClassVar, Iterable, Mapping, Protocol, Sequence

from weightsync.job import reasons


class TransferError(RuntimeError):
    """A version could not be moved. `peer` names the rank at fault ("trainer rank 1",
    "inference rank 0"); the message says what happened."""

    reason: ClassVar[str] = reasons.TRANSPORT_ERROR  # the job's, where a rank fails of it

    def __init__(self, peer: str, message: str):
        self.peer, self.message = peer, message
        super().__init__(f"{peer}: {message}")


class ChecksumMismatch(TransferError):
    """Bytes arrived other than their sender checksummed them: changed on the way (a fault of the
    network, the memory or the code between), not a peer that was lost, slow or cut off."""

    reason: ClassVar[str] = reasons.CHECKSUM_MISMATCH


class PeersFailed(TransferError):
    """A version could not be sent to some peers ({peer rank: TransferError}, in `failed`);
    every other peer was sent all of it."""

    def __init__(self, failed: dict[int, TransferError]):
        self.failed = failed
        first = failed[min(failed)]
        more = f" (and {len(failed) - 1} more peers)" if len(failed) > 1 else ""
        super().__init__(first.peer, first.message + more)


class TransportUnavailable(RuntimeError):
    """This transport cannot run here; the message says why (never a silent fallback)."""


@dataclass(frozen=True)
class Capabilities:
    """What a transport can do: the planner, the send pipeline and the receive side read it here,
    never from the transport's name."""

    patches: bool = False  # sends a range as a patch against bytes the receiver holds (delta versions)
    scatters: bool = False  # a receiver lands one range in several runs (a bucket bundling runs of several tensors)
    in_place: bool = False  # a sender takes lists of memoryviews of the parameters, with no send buffer
    buffer_device: str = "cpu"  # where send buffers live: "cpu", or "cuda" (the parameters' GPU, when they are on one)
    range_limit: int | None = None  # the most bytes one range (bucket) may have, where the transport has a limit


@dataclass(frozen=True)
class RankContext:
    """What a rank of a job offers the transport it builds, whichever that is: each transport's
    options_for takes what it needs from here."""

    trainers: int  # the job's trainer ranks
    inferences: int  # the job's inference ranks
    device: Any = None  # this rank's torch.device (None: the host)
    store: Callable[[], Any] | None = None  # makes a client of the job's torch.distributed Store, when asked


class Filling:
    """Bytes handed to Sender.send before they, or their checksum, are ready: a producer (the
    cast, or another connection hashing the same bytes as it sends them) fills them front to
    back while the transport is already sending them. advance(n) says the first n bytes are
    ready, finish(checksum) that all are, with their xxh3_64; fail(error) abandons the buffer:
    result(), and every wait for bytes that are not ready yet, raises that error."""

    def __init__(self, length: int):
        self.length, self.ready, self.checksum = length, 0, None
        self.error: BaseException | None = None
        self.cond = threading.Condition()

    def advance(self, ready: int) -> None:
        with self.cond:
            self.ready = ready
            self.cond.notify_all()

    def finish(self, checksum: int) -> None:
        with self.cond:
            self.ready, self.checksum = self.length, checksum
            self.cond.notify_all()

    def fail(self, error: BaseException) -> None:
        with self.cond:
            if self.checksum is None:
                self.error = error
                self.cond.notify_all()

    def wait(self, n: int) -> int:
        """Block until at least n bytes are ready; returns how many are."""
        ready = self.ready
        if ready >= n:  # the producer is ahead (ready only grows): no lock, no wake-up
            return ready
        with self.cond:
            self.cond.wait_for(lambda: self.ready >= n or self.error is not None)
            self._raise_if_abandoned()
            return self.ready

    def result(self) -> int:
        """Block until the buffer is whole; returns its checksum."""
        with self.cond:
            self.cond.wait_for(lambda: self.checksum is not None or self.error is not None)
            self._raise_if_abandoned()
            return self.checksum

    def _raise_if_abandoned(self) -> None:
        if self.error is not None:
            raise RuntimeError(f"the send buffer was abandoned: {self.error}") from self.error


class Pieces:
    """A patch handed to Sender.send_patch while it is being made: put() adds its next pieces
    (bytes-like, in order), close() says that no more come, fail(error) abandons it (a wait for
    more then raises that error)."""

    def __init__(self):
        self.items: list = []
        self.ends: list[int] = []  # bytes in the pieces up to and including each
        self.closed = False
        self.error: BaseException | None = None
        self.cond = threading.Condition()

    def put(self, pieces: list) -> None:
        with self.cond:
            for piece in pieces:
                self.items.append(piece)
                self.ends.append((self.ends[-1] if self.ends else 0) + len(memoryview(piece).cast("B")))
            self.cond.notify_all()

    def close(self) -> None:
        with self.cond:
            self.closed = True
            self.cond.notify_all()

    def fail(self, error: BaseException) -> None:
        with self.cond:
            if not self.closed:
                self.error = error
                self.cond.notify_all()

    def wait(self, have: int, least: int = 1) -> list:
        """Block until the pieces beyond the first `have` hold at least `least` bytes, or no more
        will come; returns those pieces (none once it is closed and they were all taken)."""
        def beyond() -> int:
            return (self.ends[-1] if self.ends else 0) - (self.ends[have - 1] if have else 0)

        with self.cond:
            self.cond.wait_for(lambda: beyond() >= least or self.closed or self.error is not None)
            if self.error is not None:
                raise RuntimeError(f"the patch was abandoned: {self.error}") from self.error
            return self.items[have:]


class Tally:
    """What a sender has sent each peer for each version: the END frame that closes a version
    carries it, and the receiver checks it against what arrived."""

    def __init__(self):
        self.counts: dict[tuple[int, int], list[int]] = {}

    def add(self, version: int, peer: int, length: int) -> None:
        count = self.counts.setdefault((version, peer), [0, 0])
        count[0] += 1
        count[1] += length

    def pop(self, version: int, peer: int) -> tuple[int, int]:
        """(ranges, bytes) sent to `peer` for `version`; forgotten from then on."""
        frames, nbytes = self.counts.pop((version, peer), (0, 0))
        return frames, nbytes


class Patcher(Protocol):
    """What a receiver applies patches with (delta.Patcher): it holds the base and the buffer."""

    def apply(self, offset: int, length: int, payload: memoryview, checksum: int) -> bool:
        """Write the new bytes of the range [offset, offset + length) that `payload` makes of the
        base; True when they are in place and their xxh3_64 is `checksum`, else False (and the
        range must come whole)."""

    def begin(self, offset: int, length: int) -> Any:
        """Start applying the patch of the range [offset, offset + length) while its payload
        arrives: what it returns is fed (payload, bytes there so far) as they come, then given to
        end(); None where nothing can be fed."""

    def end(self, applying: Any, offset: int, length: int, payload: memoryview, checksum: int) -> bool:
        """apply() of a patch that begin() started, once all of `payload` is there."""

    def refuse(self, offset: int, length: int, reason: str) -> None:
        """Note a patch the transport refused (damaged in transit)."""


class Sender(abc.ABC):
    """One per trainer rank."""

    rank: int
    capabilities: Capabilities  # its transport's (send_patch() works where it says patches)

    @abc.abstractmethod
    def connect(self, peers: dict[int, str]) -> None:
        """Open (once) a connection to every inference rank: {inference rank: endpoint}."""

    def register(self, buffers: list) -> None:
        """Register the send buffers once (memory registration for RDMA; a no-op for sockets)."""

    def connected(self, peer: int) -> bool:
        """Whether a connection to `peer` is open."""
        return False

    def cut(self, peer: int) -> None:
        """From another thread: make what is being sent to `peer` fail at once (the sender counts
        the peer lost, and drop() closes the connection afterwards). A transport that cannot
        interrupt a send in progress leaves it to its own progress timeout."""

    def drop(self, peer: int) -> None:
        """Close the connection to a peer that went away (its process died or froze), so that
        connect() opens a new one, to the endpoint it has when it comes back."""
        raise TransportUnavailable(f"the {type(self).__name__} cannot take back an inference rank that restarted: "
                                   "its connections cannot be replaced one by one (use the tcp or uccl transport)")

    @abc.abstractmethod
    def send(self, peer: int, version: int, offset: int, data: Any, filling: Filling | None = None) -> Future:
        """Queue the bytes `data` (a buffer, a uint8 tensor or a list of memoryviews) for version
        byte offset `offset` on inference rank `peer`. Sends to one peer go out in order; sends to
        different peers run concurrently. Without `filling` the bytes are ready now and the
        sender computes their checksum; with it they become ready as the producer fills them, and
        the producer gives the checksum. The future's result is the checksum the peer was sent;
        it completes when the bytes have left `data` (which may then be reused)."""

    def send_patch(self, peer: int, version: int, offset: int, length: int, payload: list | Pieces,
                   checksum: int | Filling, whole: Callable[[], Any], trailer: int | None = None) -> Future:
        """Queue a patch of the range [offset, offset + length): `payload`, a list of byte pieces,
        or a Pieces while it is being made (its pieces go out as they come, so the wire carries
        the first while the last are encoded), whose new bytes hash to `checksum` (or to what
        that Filling gives once it is whole). If the peer cannot apply it, end_version() sends
        the range whole: `whole()` gives its new bytes then (they must stay valid until then).
        `trailer`: the patch's own xxh3_64 where the caller has it (a patch made whole before it
        is sent to several peers is hashed once)."""
        raise NotImplementedError(f"the {type(self).__name__} transport carries no patches")

    @abc.abstractmethod
    def end_version(self, version: int) -> None:
        """Tell every peer this rank has sent all it will send for `version`; waits for all of
        this version's sends and raises PeersFailed naming the peers that failed (any other
        failure, such as the producer's, is raised as it is)."""

    @abc.abstractmethod
    def close(self) -> None: ...


class Receiver(abc.ABC):
    """One per inference rank."""

    rank: int
    capabilities: Capabilities  # its transport's (receive() takes a patcher where it says patches)

    @abc.abstractmethod
    def listen(self, host: str, port: int) -> str:
        """Start accepting connections; return the endpoint senders connect to."""

    def register(self, buffers: list) -> None:
        """Register the staging buffers once (memory registration for RDMA; a no-op for sockets)."""

    def expect_trainers(self, trainers: int) -> None:
        """The plan has `trainers` trainer ranks: connections from no other rank are taken, and
        a socket transport sizes its cap on unauthenticated connections by it."""

    @abc.abstractmethod
    def receive(self, version: int, buffer: Any, expected: dict[int, list[tuple[int, int]]], timeout: float,
                patcher: Patcher | None = None, scatter: Mapping[int, Sequence[tuple[int, int]]] | None = None,
                ) -> dict[int, int]:
        """Block until every trainer rank in `expected` has delivered exactly its (offset, length)
        ranges of `version` into `buffer` and ended the version. Returns {offset: checksum}.
        A range may come as a patch, which `patcher` applies (without one, or when it cannot, the
        range is asked for again, whole; transports without patches take no patcher). A range
        whose offset is in `scatter` lands in those runs (offset, length) of `buffer` in turn
        instead of at its offset (only where capabilities.scatters; the others refuse it).
        Raises TransferError naming the trainer rank when it has not connected within `timeout`
        seconds, goes silent for longer than the transport's timeout, closes its connection,
        sends a bad checksum, or sends a range it was not expected to send."""

    @abc.abstractmethod
    def close(self) -> None: ...


class Transport(abc.ABC):
    """Makes the senders and receivers of one kind of transport. Each kind declares its name,
    what it can do, and its options: a frozen dataclass (Options) that its constructor takes
    after the job token and timeout, and that options_for builds from a rank's context."""

    name: ClassVar[str]
    capabilities: Capabilities
    Options: ClassVar[type]

    @classmethod
    @abc.abstractmethod
    def options_for(cls, context: RankContext) -> Any:
        """This transport's Options for a rank that offers `context`."""

    @abc.abstractmethod
    def sender(self, rank: int) -> Sender: ...

    @abc.abstractmethod
    def receiver(self, rank: int) -> Receiver: ...


def each_peer(peers: Iterable[int], work: Callable[[int], Any],
              on_error: Callable[[Exception], None] | None = None) -> dict[int, Any]:
    """Run work(peer) for every peer at once, one thread each, and wait for all of them; returns
    {peer: what work returned}. on_error(error) runs as soon as one fails (to unblock the
    others); once all have ended, the first failure is raised."""
    results: dict[int, Any] = {}
    errors: list[Exception] = []
    lock = threading.Lock()

    def run(peer: int) -> None:
        try:
            results[peer] = work(peer)
        except Exception as e:  # noqa: BLE001 - raised below, once every thread has ended
            with lock:
                errors.append(e)
            if on_error is not None:
                on_error(e)

    threads = [threading.Thread(target=run, args=(p,), daemon=True) for p in peers]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return results


def settle(pending: Iterable[tuple[int, Future]]) -> None:
    """Wait for every (peer, future) of a version's sends; raise PeersFailed naming every peer
    that failed, or the first other failure (the producer's) as it is."""
    failed: dict[int, TransferError] = {}
    other = None
    for peer, future in pending:
        e = future.exception()
        if isinstance(e, TransferError):
            failed.setdefault(peer, e)
        elif e is not None and other is None:
            other = e
    if other is not None:
        raise other
    if failed:
        raise PeersFailed(failed)


def bounded(work: Callable[[], Any], seconds: float, what: str) -> Any:
    """work() on a helper thread, waited for at most `seconds`, for library calls that block and
    take no deadline; TimeoutError when it has not returned by then (the thread is left to
    finish), else what it returned or raised."""
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["result"] = work()
        except BaseException as e:  # noqa: BLE001 - handed to the waiting thread
            box["error"] = e

    thread = threading.Thread(target=run, daemon=True, name=what)
    thread.start()
    thread.join(max(0.0, seconds))
    if thread.is_alive():
        raise TimeoutError(f"{what} did not complete within {seconds:.0f}s")
    if "error" in box:
        raise box["error"]
    return box["result"]


def cuda_unavailable_reason() -> str | None:
    """Why GPU memory cannot be used here (torch missing, or no CUDA GPU visible), or None."""
    try:
        import torch
    except ImportError as e:
        return f"torch is not installed ({e})"
    if not torch.cuda.is_available():
        return "no CUDA GPU is visible (torch.cuda.is_available() is False)"
    return None
