"""Simulated trainer and inference ranks for `weightsync bench --control-plane`: ranks that speak
the job's real protocol to its real controller, and move no weights.

What a job costs around its transfers (joins, the plan, heartbeats, the per-version records)
grows with its ranks, and a thousand real ranks need a thousand GPUs. These ranks are threads:
each holds a rendezvous Member of its own (its store connections, its heartbeat thread), joins
with the layout, holdings or needs a real rank publishes, reads the plan, and takes every round
through the code the real ranks run (an inference rank's whole side of a round is
runtime.inbound.receive_rounds; a trainer rank's is the few steps of the trainer API's publish).
Only the bytes are left out: a trainer reports, for each bucket the plan gives it, the checksum of
bytes it never made (a hash of the version and where the bucket lands), and a receiver computes
its digest from the same checksums of the buckets the plan sends it (Wire). The controller checks
those digests exactly as it checks real ones, so a round only completes when every receiver has
every bucket the plan gives it.
"""

from __future__ import annotations

import struct
import threading
import time
from dataclasses import dataclass, field

import xxhash

from weightsync.job import INFERENCE, TRAINER, Job
from weightsync.plan.interface import TransferPlan
from weightsync.rendezvous.messages import RankInfo, Round, SentReport
from weightsync.rendezvous.plan_shares import own_share
from weightsync.rendezvous.protocol import JobEnded, Keys, Member, ProofError
from weightsync.runtime.inbound import receive_rounds
from weightsync.runtime.rank import JOIN_TIMEOUT
from weightsync.transfer.receive import ReceivedVersion
from weightsync.transfer.sums import version_digest

ALL = -1  # the receiver of a bucket every inference rank receives (a plan of whole versions)


def bucket_checksum(version: int, receiver: int, offset: int) -> int:
    """The checksum a simulated trainer reports for the bucket landing at `offset` of `receiver`'s
    buffer (ALL: of every receiver's), standing in for the xxh3_64 of bytes that are never made."""
    return xxhash.xxh3_64_intdigest(struct.pack("<qqq", version, receiver, offset))


@dataclass(frozen=True)
class Wire:
    """The data plane the simulated ranks stand in for, read from the published plan once:
    each trainer's buckets by receiver, and the offsets each receiver gets."""

    sliced: bool
    sends: tuple  # per trainer rank: {receiver (ALL: every one): [bucket offsets]}
    sent_bytes: tuple  # per trainer rank: the bytes of its buckets
    receives: dict  # {receiver (ALL: every one): [bucket offsets]}
    receiver_bytes: tuple  # per inference rank: the bytes it receives

    @classmethod
    def of(cls, plan: TransferPlan, trainer_plans: list | None = None) -> "Wire":
        """From the whole plan, or where it was published in shares from every trainer's plan."""
        sends, sent, receives = [], [], {}
        for t in range(plan.trainers):
            mine: dict[int, list[int]] = {}
            total = 0
            for b in (trainer_plans[t] if trainer_plans else plan).buckets_of(t):
                r = ALL if b.receiver is None else b.receiver
                mine.setdefault(r, []).append(b.offset)
                receives.setdefault(r, []).append(b.offset)
                total += b.length
            sends.append(mine)
            sent.append(total)
        return cls(plan.sliced, tuple(sends), tuple(sent), receives,
                   tuple(plan.bytes_for(r) for r in range(plan.inferences)))

    def sent(self, trainer: int, rnd: Round, seconds: float) -> SentReport:
        """What trainer rank `trainer` reports of `rnd` once its buckets are out."""
        mine = self.sends[trainer]
        if not self.sliced:
            sums = {o: bucket_checksum(rnd.version, ALL, o) for o in mine.get(ALL, [])}
            return SentReport(self.sent_bytes[trainer], seconds, sums, wire_bytes=self.sent_bytes[trainer] * len(rnd.receivers))
        by_receiver = {r: {o: bucket_checksum(rnd.version, r, o) for o in mine[r]} for r in rnd.receivers if r in mine}
        return SentReport(self.sent_bytes[trainer], seconds, receiver_checksums=by_receiver,
                          wire_bytes=self.sent_bytes[trainer])

    def received(self, version: int, receiver: int, seconds: float) -> ReceivedVersion:
        """What inference rank `receiver` holds of `version` once every bucket of it came."""
        key = receiver if self.sliced else ALL
        sums = {o: bucket_checksum(version, key, o) for o in self.receives.get(key, [])}
        return ReceivedVersion(version, self.receiver_bytes[receiver], seconds, sums, version_digest(sums))


@dataclass
class Timeline:
    """When one simulated rank got where (time.monotonic()), and what it read."""

    started: float = 0.0
    joined: float | None = None  # its proof published
    plan_seen: float | None = None  # the plan's signature set: the controller published it
    plan_read: float | None = None  # the plan and the endpoints read and checked
    plan_bytes: int = 0  # what the store served it for them
    error: str | None = None


@dataclass
class Sim:
    """The simulated ranks of one job: what each publishes when it joins, and what the harness
    hands them once every rank read the plan (the Wire, then `go` for the versions)."""

    job: Job
    host: str
    port: int
    token: bytes
    layout: str  # the FlatLayout JSON every rank joins with
    holds: list  # per trainer rank: its Holdings JSON, or None (whole)
    needs: list  # per inference rank: its slices (needs_to_json), or None (the whole version)
    versions: int
    wire: Wire | None = None
    plan_text: str | None = None  # the plan as the first rank read it
    shares: dict = field(default_factory=dict)  # {(role, rank): its share of the plan}, where published in shares
    go: threading.Event = field(default_factory=threading.Event)
    times: dict = field(default_factory=dict)  # {(role, rank): Timeline}
    cond: threading.Condition = field(default_factory=threading.Condition)
    planned: int = 0  # ranks that read the plan

    def start(self) -> list[threading.Thread]:
        """Every rank on a thread of its own, started now."""
        threads = [threading.Thread(target=fn, args=(rank,), name=f"sim-{role}-{rank}", daemon=True)
                   for role, fn, n in ((TRAINER, self.trainer, len(self.holds)), (INFERENCE, self.inference, len(self.needs)))
                   for rank in range(n)]
        for t in threads:
            t.start()
        return threads

    def wait_planned(self, timeout: float) -> bool:
        """Wait until every rank read the plan (or one failed); whether every rank did."""
        ranks = len(self.holds) + len(self.needs)
        with self.cond:
            self.cond.wait_for(lambda: self.planned == ranks or any(t.error for t in self.times.values()), timeout)
            return self.planned == ranks

    def _joined(self, role: str, rank: int, info: RankInfo, endpoint: str) -> tuple[Member, Timeline]:
        times = self.times[(role, rank)] = Timeline(time.monotonic())
        member = Member(self.host, self.port, self.token, role, rank, JOIN_TIMEOUT, job=self.job.identity)
        member.arrive()
        member.start_heartbeat()
        member.join(endpoint, self.layout, info, JOIN_TIMEOUT)
        times.joined = time.monotonic()
        member.wait_for(Keys.PLAN_MAC, "the transfer plan", JOIN_TIMEOUT)
        times.plan_seen = time.monotonic()
        text = member.plan_text(JOIN_TIMEOUT)
        share = own_share(member, text, JOIN_TIMEOUT, ProofError)
        member.peers(0, JOIN_TIMEOUT)
        times.plan_read = time.monotonic()
        times.plan_bytes = member.plan_bytes(0) + len(share or "")
        with self.cond:
            self.planned += 1
            if self.plan_text is None:
                self.plan_text = text
            if share is not None:
                self.shares[(role, rank)] = share
            self.cond.notify_all()
        self.go.wait()
        return member, times

    def _ended(self, member: Member, times: Timeline, error: BaseException | None) -> None:
        if error is not None and not isinstance(error, JobEnded):
            times.error = f"{type(error).__name__}: {error}"
            with self.cond:
                self.cond.notify_all()
            try:
                member.fail(error)
            except Exception:  # noqa: BLE001 - the controller is gone: the harness reports the error itself
                pass
        member.stop_heartbeat()
        member.bye()
        member.close()

    def trainer(self, rank: int) -> None:
        """A trainer rank, as the trainer API publishes: ready, the previous version done, the go,
        its report of the round; then closed, answering repeats of the final version until the end."""
        def rounds(member) -> None:
            wire = self.wire
            for version in range(self.versions):
                member.ready(version, version)
                if version:
                    member.wait_for(Keys.done(version - 1), f"the controller to finish version {version - 1}")
                rnd = member.round(version, timeout=self.job.transfer.timeout)
                member.say_sent(rnd, wire.sent(rank, rnd, 0.0))
            member.closing(self.versions - 1)
            again = 1
            while True:
                rnd = member.round(self.versions - 1, again)  # JobEnded at the end
                member.say_sent(rnd, wire.sent(rank, rnd, 0.0))
                again += 1

        info = RankInfo("tcp", "simulated", "cpu", f"sim-trainer-{rank}", holds=self.holds[rank])
        self._life(TRAINER, rank, info, self.host, rounds)

    def inference(self, rank: int) -> None:
        """An inference rank: every round through receive_rounds, the real ranks' code."""
        info = RankInfo("tcp", "simulated", "cpu", f"sim-inference-{rank}", needs=self.needs[rank])
        self._life(INFERENCE, rank, info, f"{self.host}:{1 + rank}",
                   lambda member: receive_rounds(member, _Receiver(rank, self.wire), self.job, _Engine()))

    def _life(self, role: str, rank: int, info: RankInfo, endpoint: str, rounds) -> None:
        """One simulated rank from its join to its goodbye: `rounds(member)` between, and its error,
        if any, reported to the controller and kept for the harness."""
        member, times, error = None, None, None
        try:
            member, times = self._joined(role, rank, info, endpoint)
            rounds(member)
        except BaseException as e:  # noqa: BLE001 - reported to the controller, kept for the harness
            error = e
        if member is not None:
            self._ended(member, times, error)
        elif error is not None:
            self.times.setdefault((role, rank), Timeline()).error = f"{type(error).__name__}: {error}"


class _Receiver:
    """A simulated inference rank's end of the transport: every bucket the plan gives it has come."""

    def __init__(self, rank: int, wire: Wire):
        self.rank, self.wire = rank, wire

    def receive(self, version: int, staging, timeout: float, base=None) -> ReceivedVersion:
        return self.wire.received(version, self.rank, 0.0)


class _Engine:
    """A simulated inference rank's engine (inbound.Handover): it runs on staging, loading nothing."""

    def staging(self):
        return None

    def base(self, version: int | None):
        return None

    def offer(self, version: int, got: ReceivedVersion) -> None:
        return None
