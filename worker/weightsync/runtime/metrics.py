"""A job's figures for Prometheus, defined once: what the controller counts of every version, and
what each rank counts of its own bytes, in the text exposition format that every pod serves at
/metrics beside its probes (health.py).

Each process keeps its own CollectorRegistry, never prometheus_client's global default one: a
pod's endpoint shows weightsync's metrics and nothing that a library registered by importing.
Labels stay bounded: a rank, a receiver state, a failure reason (job/reasons.py); never a version.

The controller is one process, and its metrics live in it (ControllerMetrics). A rank pod's
endpoint is its first process, while its ranks are other processes: spawned ones (roles.supervise),
a vLLM server's workers, a user's training command. So a rank's figures live in a board of shared
memory that the pod's process creates (RankBoard) and its ranks write into (rank_counters()), each
rank in a slot of its own, found by the board's address in the environment that every child
process inherits. The board is a file of the memory file system that is unlinked as soon as it is
created: nothing is left behind, whichever way the pod's process ends, and the ranks open it
through the pod process's descriptor (/proc/<pid>/fd/<fd>), which lives exactly as long as it.
"""

from __future__ import annotations

import math
import mmap
import os
import struct
import tempfile

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from weightsync.job import TRAINER

BOARD_ENV = "WEIGHTSYNC_METRICS_BOARD"  # "<path>:<rank>,<rank>,...": the pod's board and its ranks' slots in order
# A round's seconds: from tens of milliseconds (a small model on one host) to minutes (a large one over TCP).
ROUND_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 25.0, 60.0, 120.0, 300.0, 600.0)
# A vLLM server's stall: its engine paused between two steps while it loads a version.
STALL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
# The states of the controller's receivers (rendezvous/roster.py's, as a user reads them).
CURRENT, BEHIND, AWAY, REJOINING, DROPPED = "current", "behind", "away", "rejoining", "dropped"
RECEIVER_STATES = (CURRENT, BEHIND, AWAY, REJOINING, DROPPED)
# A rank's slot on the board: float64s, in this order.
SENT, RECEIVED, CHECKSUM_FAILURES, SERVING = range(4)
SLOT = 4


def exposition(registry: CollectorRegistry) -> tuple[bytes, str]:
    """The registry's metrics as a scrape's body, and its content type."""
    return generate_latest(registry), CONTENT_TYPE_LATEST


class ControllerMetrics:
    """The controller's figures of the job, updated where it reports each version (roles/controller/records.py)
    and its end, in a registry of their own."""

    def __init__(self):
        self.registry = r = CollectorRegistry()
        self.versions = Counter("weightsync_versions_delivered", "Versions delivered to and verified on at least one "
                                "inference rank (a version sent again to a rank that rejoined counts once)", registry=r)
        self.round_seconds = Histogram("weightsync_version_seconds", "Seconds of each sending of a version, from the "
                                       "controller's go to the last inference rank running on it", registry=r,
                                       buckets=ROUND_BUCKETS)
        self.delivered_bytes = Counter("weightsync_delivered_bytes", "Bytes delivered: each version's size times the "
                                       "inference ranks that applied it", registry=r)
        self.wire_bytes = Counter("weightsync_wire_bytes", "Bytes the trainers put on the wire (fewer than delivered "
                                  "when versions go as deltas)", registry=r)
        self.version = Gauge("weightsync_version", "The latest version delivered", registry=r)
        self.receivers = Gauge("weightsync_receivers", "Inference ranks by state: current (holds the latest version), "
                               "behind (holds an older one), away (gone, expected back), rejoining (back, taking the "
                               "next version)", ["state"], registry=r)
        for state in RECEIVER_STATES:
            self.receivers.labels(state).set(0)
        self.rejoins = Counter("weightsync_rejoins", "Times an inference rank rejoined the running job", registry=r)
        self.failures = Counter("weightsync_failures", "Job failures, by reason (job/reasons.py)", ["reason"],
                                registry=r)
        self.stall = Histogram("weightsync_vllm_stall_seconds", "Seconds the slowest vLLM server's engine paused to "
                               "load each version", registry=r, buckets=STALL_BUCKETS)
        self.publish_to_serving = Histogram("weightsync_publish_to_serving_seconds", "Seconds from every trainer "
                                            "rank having published a version to the last inference rank serving it",
                                            registry=r, buckets=ROUND_BUCKETS)

    def delivered(self, version: int) -> None:
        """A version reached its first inference rank."""
        self.versions.inc()
        self.version.set(version)

    def round(self, delivered_bytes: int, wire_bytes: int, seconds: float, stall: float | None) -> None:
        """One sending of a version (a first one or a repeat to ranks that rejoined)."""
        self.delivered_bytes.inc(delivered_bytes)
        self.wire_bytes.inc(wire_bytes)
        self.round_seconds.observe(seconds)
        if stall is not None:
            self.stall.observe(stall)

    def states(self, counts: dict[str, int]) -> None:
        """How many receivers are in each of RECEIVER_STATES."""
        for state in RECEIVER_STATES:
            self.receivers.labels(state).set(counts.get(state, 0))


class RankBoard:
    """A rank pod's side: the board its ranks write into, and the collector that reads it for the
    pod's endpoint. Creating it names it in this process's environment (BOARD_ENV), for every
    rank process started from here on."""

    def __init__(self, role: str, ranks: list[int]):
        self.role, self.ranks = role, list(ranks)
        folder = "/dev/shm" if os.access("/dev/shm", os.W_OK) else tempfile.gettempdir()
        self.fd, path = tempfile.mkstemp(prefix="weightsync-metrics-", dir=folder)  # mode 0600
        os.unlink(path)
        os.ftruncate(self.fd, len(self.ranks) * SLOT * 8)
        self.memory = mmap.mmap(self.fd, len(self.ranks) * SLOT * 8)
        for index in range(len(self.ranks)):
            _put(self.memory, index, SERVING, math.nan)  # no version served yet
        self.address = f"/proc/{os.getpid()}/fd/{self.fd}:{','.join(map(str, self.ranks))}"
        os.environ[BOARD_ENV] = self.address
        self.registry = CollectorRegistry()
        self.registry.register(self)

    def describe(self):
        return []  # nothing to check against other collectors: the registry holds only this one

    def collect(self):
        """The metrics of this pod's ranks, read from the board at each scrape."""
        labels = ["rank"]
        families = {
            SENT: CounterMetricFamily("weightsync_sent_bytes", "Bytes this trainer rank put on the wire", labels=labels),
            RECEIVED: CounterMetricFamily("weightsync_received_bytes", "Bytes of versions this inference rank received",
                                          labels=labels),
            CHECKSUM_FAILURES: CounterMetricFamily("weightsync_checksum_failures", "Versions this inference rank "
                                                   "refused: their digest is not the one the trainers sent",
                                                   labels=labels),
            SERVING: GaugeMetricFamily("weightsync_serving_version", "The version this inference rank serves (absent "
                                       "until it serves one)", labels=labels),
        }
        fields = (SENT,) if self.role == TRAINER else (RECEIVED, CHECKSUM_FAILURES, SERVING)
        for index, rank in enumerate(self.ranks):
            for field in fields:
                value = _get(self.memory, index, field)
                if not math.isnan(value):
                    families[field].add_metric([str(rank)], value)
        return [families[field] for field in fields]

    def close(self) -> None:
        os.environ.pop(BOARD_ENV, None)
        self.memory.close()
        os.close(self.fd)


class RankCounters:
    """A rank's slot on its pod's board, in the rank's own process. Only this rank's process writes
    its slot, from one thread at a time (its sends, or its receiving thread)."""

    def __init__(self, memory: mmap.mmap | None, index: int):
        self.memory, self.index = memory, index

    def sent(self, nbytes: int) -> None:
        self._add(SENT, nbytes)

    def received(self, nbytes: int) -> None:
        self._add(RECEIVED, nbytes)

    def checksum_failed(self) -> None:
        self._add(CHECKSUM_FAILURES, 1)

    def serving(self, version: int) -> None:
        if self.memory is not None:
            _put(self.memory, self.index, SERVING, float(version))

    def _add(self, field: int, amount: float) -> None:
        if self.memory is not None:
            _put(self.memory, self.index, field, _get(self.memory, self.index, field) + amount)


_counters: dict[int, RankCounters] = {}


def rank_counters(rank: int) -> RankCounters:
    """This process's rank `rank`'s slot on its pod's board. In a process that is no rank of a
    worker pod (an external trainer or vLLM server, a test that drives a role directly) there is no
    endpoint to count for, and its counts go nowhere; a board that does not hold the rank is an
    error."""
    if rank not in _counters:
        address = os.environ.get(BOARD_ENV)
        if not address:
            _counters[rank] = RankCounters(None, 0)
        else:
            path, ranks = address.rsplit(":", 1)
            held = [int(r) for r in ranks.split(",")]
            if rank not in held:
                raise ValueError(f"this pod's metrics board holds ranks {held}, not rank {rank}")
            fd = os.open(path, os.O_RDWR)
            try:
                memory = mmap.mmap(fd, len(held) * SLOT * 8)
            finally:
                os.close(fd)  # the mapping keeps the memory
            _counters[rank] = RankCounters(memory, held.index(rank))
    return _counters[rank]


def _get(memory: mmap.mmap, index: int, field: int) -> float:
    return struct.unpack_from("d", memory, (index * SLOT + field) * 8)[0]


def _put(memory: mmap.mmap, index: int, field: int, value: float) -> None:
    struct.pack_into("d", memory, (index * SLOT + field) * 8, value)
