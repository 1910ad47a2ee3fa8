"""The controller's side of the rendezvous: it hosts the store, admits the ranks that prove the
job token, and keeps the roster of inference ranks from one round to the next.

Inference pods are StatefulSet pods: one that dies (an OOM kill, a node drain, a preemption) is
started again under the same name and ordinal. So an inference rank that vanishes does not end
the job: it is "away" and the versions go on to the others; when its process starts again it
joins anew (a fresh challenge for its new attempt, a new endpoint), waits, and is taken back at
the next round, which it receives in full and verifies before it serves. A rank away for longer
than `away_limit` fails the job. The same holds while the ranks join (join_phase.py): the
controller admits each rank's latest start, so an inference pod killed while it loads its model
joins with its next start, and the first round takes it back. Trainers do not come back: a
trainer that restarts, or goes silent, fails the job, while the ranks join as later (the built-in
trainer keeps no checkpoint to resume from; see the README). The inference pods of a running job
may be scaled: the ranks beyond the pods it runs are parked (parking.py). A tensor-parallel
replica of the built-in engine goes away and comes back as a whole (policy.tp_replicas): its ranks
compute over a process group formed when they start, which takes back no single rank; so the
others are counted away with the first (each start learns it, ends and starts again), and the
replica is taken back once every rank of it joined with its new start, under a new group.

A failure is blamed on the rank that failed first. When a rank reports a failure, the controller
first looks, for a few heartbeats, for a rank that stopped (its process started again, or its
heartbeat stopped): a survivor that saw its peer vanish reports first, but its peer is the cause.
"""

from __future__ import annotations

import json
import secrets
import sys
import time
from dataclasses import dataclass
from typing import Callable, Iterable, Mapping

from weightsync.job import ANNOTATION_NETWORK_MODE, INFERENCE, TRAINER, Job, Layout, reasons
from weightsync.job.errors import TimedOut
from weightsync.job.token import same
from weightsync.model.flat import FlatLayout
from weightsync.rendezvous.channel import Channel, host_store
from weightsync.rendezvous.claims import Claims
from weightsync.rendezvous.ending import Ending
from weightsync.rendezvous.join_phase import PROGRESS_EVERY, Deadline, Joining, RankFailed, TrainersRestart
from weightsync.rendezvous.last_word import hear_out
from weightsync.rendezvous.messages import (
    Admission,
    Applied,
    Peer,
    PublishedPlan,
    RankFailure,
    RankInfo,
    Ready,
    Round,
    SentReport,
    Staged,
    cut_to_json,
    peers_to_json,
)
from weightsync.rendezvous.parking import Parking
from weightsync.rendezvous.policy import Policy
from weightsync.rendezvous.proofs import job_mac, peers_mac, plan_mac, rank_proof
from weightsync.rendezvous.protocol import HEARTBEAT, Keys, ProofError, ranks_of, who
from weightsync.rendezvous.seats import AWAY, DROPPED, JOINING, PARKED, SERVING, WAITING, Seat

BLAME_WINDOW = 3.5 * HEARTBEAT  # seconds to look for a rank that stopped before blaming the one that reported
BACK_POLL = 0.02  # seconds between looks for an inference rank that came back
COLLECT_WAIT = 0.05  # seconds a collecting round waits for a report before it looks at the roster again
RECORDS_KEPT = 16  # rounds' records (done) kept in the store; older ones are deleted, so an endless job's keys stay bounded
class _AllClosed(Exception):
    """Every trainer rank closed: there is no next version."""


@dataclass
class Beat:
    count: int
    seen: float  # when the count last changed


class Host(Ending, Channel, Parking):  # Ending's end() says the end, where a Channel's reads it
    """The controller's side: hosts the store, admits ranks, keeps the roster, watches ranks."""

    def __init__(self, port: int, token: bytes, layout: Layout, policy: Policy,
                 say: Callable[[str], None] = lambda m: print(m, file=sys.stderr, flush=True), *, address: str, job: str):
        super().__init__(host_store(address, port, token, job, len(ranks_of(layout))))
        self.token, self.layout, self.say, self.policy = token, layout, say, policy
        self.ranks = ranks_of(layout)
        # the inference ranks of the pods it runs (spec.inference.replicas'); the rest are parked
        self.running = layout.world_size(INFERENCE) if policy.running is None else policy.running
        self.wanted: int | None = None  # the running ranks as last read from the job, where it can be scaled
        self.parked = set(range(self.running, layout.world_size(INFERENCE)))
        # a parked rank has not started: its first start is one more than none
        self.attempts = {(role, rank): 0 if role == INFERENCE and rank in self.parked else 1 for role, rank in self.ranks}
        # the latest start of a rank that was refused (a second process claiming an external trainer's
        # rank while the one that holds it is alive): counted, but not the rank's attempt
        self.refused: dict[tuple[str, int], int] = {}
        self.seats: dict[int, Seat] = {}
        self.epoch = 0
        self.in_round: dict[int, int] = {}  # receivers of the current round: {rank: attempt}
        self.round: Round | None = None  # the current round
        self.cut: set[int] = set()  # receivers of the current round counted away during it
        # what a rank that rejoins the running job must match (the plan's model, transport and
        # slices): given with the plan (publish_plan)
        self.check_rejoin: Callable[[int, str, RankInfo], None] = lambda rank, meta, info: None
        self.published = False  # the plan: the ranks joined, and the versions may start
        # where the trainers resume (policy.resumable): {trainer rank: the start it runs}
        self.trainers_run: dict[int, int] = {}
        self.resumes = 0  # the times they resumed
        # external vLLM servers: their workers claim inference ranks (claims.py)
        self.claims = Claims(layout, job, self.trainer_layout, say) if INFERENCE in policy.external else None
        self.failures_seen = 0
        self.deferred = False  # a trainer rank's failure seen while only the inference ranks were checked
        self.beats: dict[tuple[str, int], Beat] = {}
        self.departures: dict[int, int] = {}  # {a TP replica's first rank: the times it went away} (Keys.replica)
        self.last_watch = 0.0
        for role, rank in self.ranks:
            if self.attempts[(role, rank)]:  # a parked rank's challenge is made when it starts
                self.set(Keys.nonce(role, rank, 1), secrets.token_hex(16))

    @property
    def resuming(self) -> bool:
        """Whether a trainer rank that stops is resumed from (policy.resumable) rather than failing
        the job: once the plan is published; while the ranks join, a trainer that stops fails it."""
        return self.policy.resumable and self.published

    @property
    def needed(self) -> int:
        """Inference ranks the job cannot go on without: minAvailable, or every running one."""
        return self.running if self.policy.min_available is None else self.policy.min_available

    # ------------------------------------------------------------ admission

    def publish_job(self, job: Job, network_mode: str) -> None:
        """The defaulted job and its resolved network mode, signed: what an external rank reads
        instead of the spec file a pod mounts (rendezvous/external_rank.py). Before any rank is admitted."""
        obj = job.to_object()
        obj["metadata"]["annotations"] = {ANNOTATION_NETWORK_MODE: network_mode}
        text = json.dumps(obj, sort_keys=True)
        self.set(Keys.JOB, text)
        self.set(Keys.JOB_MAC, job_mac(self.token, job.identity, text))  # last: a reader waits for it

    def proven(self, role: str, rank: int, attempt: int) -> Admission | None:
        """What the rank published for `attempt`, once it proved the token over it; None before."""
        if not self.has(Keys.published("proof", role, rank, attempt)):
            return None
        endpoint, meta, info = (self.get(Keys.published(k, role, rank, attempt)).decode() for k in ("endpoint", "meta", "info"))
        expect = rank_proof(self.token, self.get(Keys.nonce(role, rank, attempt)), role, rank, endpoint, meta, info)
        if not same(self.get(Keys.published("proof", role, rank, attempt)).decode(), expect):
            raise ProofError(f"{who(role, rank)} failed the job token proof (its token file differs from the job's Secret)")
        return Admission(endpoint, meta, RankInfo.from_json(info))

    def admit(self, timeout: float, external: Mapping[str, Deadline] | None = None,
              every: float = PROGRESS_EVERY) -> dict[tuple[str, int], Admission]:
        """Wait for every rank's proof; return {(role, rank): what it published} (join_phase.py)."""
        return Joining(self, timeout, external or {}, every).run()

    def started_again(self, role: str, rank: int) -> int | None:
        """The rank's start count where its process started again since the last look (recorded
        as its attempt), else None."""
        started = self.store.add(Keys.join(role, rank), 0)
        if started <= self.counted(role, rank):
            return None
        self.attempts[(role, rank)] = started
        return started

    def counted(self, role: str, rank: int) -> int:
        """The starts of the rank seen so far: its attempt's, or a refused later one's."""
        return max(self.attempts[(role, rank)], self.refused.get((role, rank), 0))

    def publish_plan(self, plan_json: str, endpoints: Mapping[int, str], infos: Mapping[int, RankInfo] | None = None,
                     check_rejoin: Callable[[int, str, RankInfo], None] | None = None) -> None:
        """The plan and the endpoints the ranks joined at; `check_rejoin(rank, meta, info)`: what a
        rank that rejoins the running job must match (it raises where the rank does not)."""
        if check_rejoin is not None:
            self.check_rejoin = check_rejoin
        self.published = True
        text = PublishedPlan(plan_json).to_json()
        self.set(Keys.PLAN, text)
        self.set(Keys.PLAN_MAC, plan_mac(self.token, text))
        now = time.monotonic()
        # a rank admitted with a later start (its process started again while the ranks joined) is
        # a rejoined one: it waits for its welcome, which the first round says
        self.trainers_run = {t: self.attempts[(TRAINER, t)] for t in range(self.layout.world_size(TRAINER))}
        self.seats = {r: Seat(attempt=self.attempts[(INFERENCE, r)], endpoint=endpoints.get(r, ""), since=now,
                              info=(infos or {}).get(r))
                      for r in range(self.layout.world_size(INFERENCE))}
        for r, seat in self.seats.items():
            if r in self.parked or r not in endpoints:
                seat.state = PARKED
            elif seat.attempt > 1:
                seat.state, seat.rejoins = WAITING, 1
        self._publish_peers()

    def _publish_peers(self) -> None:
        text = peers_to_json({r: Peer(s.endpoint, s.attempt) for r, s in self.seats.items() if s.state != PARKED})
        self.set(Keys.peers(self.epoch), text)
        self.set(Keys.peers(self.epoch) + "/mac", peers_mac(self.token, self.epoch, text))

    # ------------------------------------------------------------ rounds

    def start_round(self, version: int, again: int = 0,
                    bases: Callable[[Mapping[int, int | None]], Mapping[int, int | None]] | None = None) -> Round:
        """Say go for a round to every inference rank that is there (taking back the ones that
        rejoined); a repeat (again > 0) goes only to those that do not hold the version yet.
        bases({receiver: the version it holds, or None}) says which receivers get the version as a
        delta, against which version (delta versions); returns the round."""
        receivers = sorted(r for r, s in self.seats.items() if s.state in (SERVING, WAITING)
                           and not (again and s.holds == version))
        named = bases({r: self.seats[r].holds for r in receivers}) if bases is not None else {}
        rnd = Round(version, again, tuple(receivers), self.epoch, {r: b for r, b in named.items() if b is not None})
        self.in_round = {r: self.seats[r].attempt for r in receivers}
        self.round, self.cut = rnd, set()
        for r in receivers:
            seat = self.seats[r]
            if seat.state == WAITING:
                self.set(Keys.welcome(r, seat.attempt), rnd.to_json())
                seat.state, seat.since = SERVING, time.monotonic()
        self.set(Keys.go(version, again), rnd.to_json())
        if not again:
            self.set(Keys.LATEST, str(version))
        return rnd

    def next_version(self, version: int) -> bool:
        """Wait until every trainer rank is ready for `version` (True) or has closed after
        version - 1 (False). RankFailed when they disagree: one closed after another version, or
        one closed while another is ready to go on."""
        trainers = self.layout.world_size(TRAINER)

        def check() -> None:
            self.check_ranks()
            if self.store.add(Keys.CLOSED, 0):
                closed = {t: int(self.get(Keys.closed(t))) for t in range(trainers) if self.has(Keys.closed(t))}
                ready = [t for t in range(trainers) if self.has(Keys.ready(version, t))]
                wrong = {t: v for t, v in closed.items() if v != version - 1}
                if wrong or ready:
                    t, v = next(iter(wrong.items())) if wrong else next(iter(closed.items()))
                    goes_on = f"{who(TRAINER, ready[0])} is ready for version {version}" if ready else \
                        f"the others published version {version - 1}"
                    raise RankFailed(f"{who(TRAINER, t)} closed after version {v}, but {goes_on}: every trainer rank "
                                     "must publish the same versions", reasons.TRAINERS_DISAGREE)
                if len(closed) == trainers:
                    raise _AllClosed

        try:
            self.wait([Keys.ready(version, t) for t in range(trainers)], f"the trainers to be ready for version {version}",
                      check=check)
        except _AllClosed:
            return False
        steps = {t: step for t in range(trainers) if (step := Ready.from_json(self.get(Keys.ready(version, t))).step) is not None}
        if len(set(steps.values())) > 1:
            told = ", ".join(f"{who(TRAINER, t)} at step {s}" for t, s in steps.items())
            raise RankFailed(f"the trainer ranks publish version {version} at different steps ({told}): every trainer "
                             "rank must publish the same versions (and resume from the same checkpoint)",
                             reasons.TRAINERS_DISAGREE)
        return True

    def collect_sent(self, rnd: Round, timeout: float) -> list[SentReport]:
        """Every trainer's report of the round; receivers a trainer lost count as away, once they
        had their grace to say why (last_word.py: a receiver that refused corrupted bytes fails the job)."""
        trainers = self.layout.world_size(TRAINER)
        self.wait_ranks([Keys.sent(rnd.version, rnd.again, t) for t in range(trainers)],
                        f"the trainers to send {rnd.name}", timeout)
        reports = [SentReport.from_json(self.get(Keys.sent(rnd.version, rnd.again, t))) for t in range(trainers)]
        hear_out(self, [r for r in sorted({r for report in reports for r in report.lost}) if not self.left_round([r])])
        for t, report in enumerate(reports):
            for r, why in report.lost.items():
                self._lost(r, f"{who(TRAINER, t)} lost it while sending {rnd.name}: {why}")
        return reports

    def collect_applied(self, rnd: Round, timeout: float) -> dict[int, Applied]:
        """{inference rank: what it applied} from every receiver of the round that is still there;
        one that vanished meanwhile is away, and the round goes on without it. Where the trainers
        resume, a trainer rank that stops now (every byte of the round sent) is seen at the next
        version, between two versions, and the round goes on."""
        return self._collect(rnd, Keys.applied, Applied.from_json, "apply", timeout)

    def collect_staged(self, rnd: Round, timeout: float) -> dict[int, Staged]:
        """{inference rank: its staged record} from every receiver of the round still there that has the
        version received and verified, waiting for its vLLM server to load it."""
        return self._collect(rnd, Keys.staged, Staged.from_json, "receive and verify", timeout)

    def _collect(self, rnd: Round, key_of, read, what: str, timeout: float) -> dict:
        """Each pending receiver's key, read as it is set: the wait blocks in the store until one of
        them is (at most COLLECT_WAIT, to keep the roster), never polling every rank's key in a loop,
        which at a thousand receivers took the CPU the store needs to serve them."""
        pending = dict(self.in_round)
        got = {}
        start = time.monotonic()
        while True:
            for r, attempt in list(pending.items()):
                key = key_of(rnd.version, r, attempt)
                if self.has(key):
                    got[r] = read(self.get(key))
                    del pending[r]
                elif self.seats[r].attempt != attempt or self.seats[r].state != SERVING or \
                        (key_of is not Keys.applied and self.has(Keys.applied(rnd.version, r, attempt))):
                    del pending[r]  # staged: its load ahead failed (an applied key set meanwhile is read next)
            if not pending:
                return got
            self.check_ranks(trainers=not self.resuming)  # sent: the round needs them no more
            if time.monotonic() - start > timeout:
                raise TimedOut(f"waited {timeout:.0f}s for the inference ranks to {what} {rnd.name} "
                                   f"({', '.join(who(INFERENCE, r) for r in sorted(pending))} did not)")
            keys = [key_of(rnd.version, r, attempt) for r, attempt in pending.items()]
            if key_of is not Keys.applied:  # (staged: a load ahead that failed says so as applied)
                keys += [Keys.applied(rnd.version, r, attempt) for r, attempt in pending.items()]
            self.store.wait_any(keys, COLLECT_WAIT)

    def gone(self, ranks: Iterable[int], within: float) -> bool:
        """Whether every inference rank of `ranks` left the round on its way (counted away, or
        started again) within `within` seconds: a vLLM server that stopped answering may have died
        with its workers, which their heartbeats tell (check_ranks keeps the roster meanwhile). A
        rank that beats twice more is alive, which ends the wait early: a rank is counted away only
        once the roster has seen it silent for silent_limit, from its first look, so `within` is
        a bound for busy machines, not the time it takes."""
        ranks = list(ranks)
        beats = {r: self.store.add(Keys.beat(INFERENCE, r), 0) for r in ranks}
        deadline = time.monotonic() + within
        while True:
            if self.left_round(ranks):
                return True
            if time.monotonic() > deadline:
                return False
            if any(self.store.add(Keys.beat(INFERENCE, r), 0) >= beats[r] + 2 for r in ranks):
                return False
            self.check_ranks(trainers=not self.resuming)  # sent: as in _collect
            time.sleep(BACK_POLL)

    def left_round(self, ranks: Iterable[int]) -> bool:
        """Whether every inference rank of `ranks` left the round on its way, as the roster has it
        now (counted away, or started again)."""
        return all(self.seats[r].state != SERVING or self.seats[r].attempt != self.in_round.get(r) for r in ranks)

    def holding(self, version: int, applied: Iterable[int]) -> None:
        for r in applied:
            self.seats[r].holds = version

    def behind(self, version: int) -> list[int]:
        """The inference ranks the job waits for that do not hold `version` (not the dropped, nor
        the parked)."""
        return [r for r, s in sorted(self.seats.items()) if s.holds != version and s.state not in (DROPPED, PARKED)]

    def wait_back(self, version: int, skip: Iterable[int] = ()) -> None:
        """Wait until an inference rank lacking `version` (but those in `skip`) is admitted again, or none is
        waited for (away_limit bounds it: past it, check_ranks drops the rank or fails the job)."""
        while (behind := [r for r in self.behind(version) if r not in skip]) and \
                not any(self.seats[r].state == WAITING for r in behind):
            self.check_ranks()
            time.sleep(BACK_POLL)

    def rejoins(self) -> int:
        return sum(s.rejoins for s in self.seats.values())

    def forget(self, version: int) -> None:
        """Delete the keys of `version`'s first sending but its record (done), and the record of
        the version RECORDS_KEPT before it: the store bounds what it holds, and an endless job must
        not fill it. Only for a version no rank still reads (two versions back: every inference
        rank that is there has applied a later one)."""
        trainers = self.layout.world_size(TRAINER)
        keys = [Keys.go(version), Keys.ref(version), Keys.cut(version), Keys.dropped(version)]
        keys += [k for t in range(trainers) for k in (Keys.ready(version, t), Keys.sent(version, 0, t))]
        keys += [key(version, r, a) for r, seat in self.seats.items() for a in range(1, seat.attempt + 1)
                 for key in (Keys.staged, Keys.applied, Keys.unloaded)]
        if version >= RECORDS_KEPT:  # a record is read by the trainers the version after it, by a bench later
            keys.append(Keys.done(version - RECORDS_KEPT))
        for key in keys:
            self.store.delete_key(key)

    # ------------------------------------------------------------ watching

    def wait_ranks(self, keys: Iterable[str], what: str, timeout: float | None = None) -> None:
        self.wait(keys, what, timeout, self.check_ranks)

    def check_ranks(self, trainers: bool = True) -> None:
        """Raise RankFailed for a rank that reported a failure, a trainer that restarted or went
        silent (TrainersRestart where the trainers resume), or an inference rank away for too
        long; keep the roster of inference ranks. Without `trainers`: the inference ranks only
        (while the trainers resume, resume.py follows them)."""
        self.check_failures(trainers)
        self.follow_scale()
        now = time.monotonic()
        if now - self.last_watch < HEARTBEAT / 4:
            return
        self.last_watch = now
        if self.claims is not None:
            self.claims.serve(self, self.there)
        for role, rank in self.ranks:
            if role == TRAINER and not trainers:
                continue
            started = self.started_again(role, rank)
            if started is not None and role == TRAINER:
                self.trainer_started(rank, started, now)
            elif started is not None:
                self._restarted(rank, started)
        for role, rank in self.ranks:
            seat = self.seats.get(rank) if role == INFERENCE else None
            if seat is not None and (seat.state in (AWAY, JOINING) or (seat.state == DROPPED and seat.late)):
                if seat.state in (JOINING, DROPPED):  # a start that joins late is taken back all the same
                    self._readmit(rank)
                if seat.state in (AWAY, JOINING) and now - seat.since > self.policy.away_limit:
                    self._drop(rank)
                continue
            if (seat is not None and seat.state in (DROPPED, PARKED)) or (role == TRAINER and not trainers):
                continue
            silent = self.silent_for(role, rank, now)
            if silent > self.limit_for(role):
                why = f"no heartbeat for {silent:.0f}s (its process died, froze, or lost the network)"
                if seat is None and self.resuming:
                    raise TrainersRestart(f"{who(role, rank)} is silent: {why}")
                if seat is None:
                    raise RankFailed(f"{who(role, rank)} is silent: {why}", reasons.TRAINER_STOPPED)
                self._away(rank, why)

    def trainer_started(self, rank: int, started: int, now: float) -> None:
        """A trainer rank's process started again (start `started`): RankFailed, trainers do not
        rejoin; but an external rank whose process still beats was claimed by a second process,
        which was refused (it refuses itself: Sync._restarted), and the job goes on with the
        process that holds the rank, joined or still joining: an external trainer never resumes,
        so that is its first start."""
        if TRAINER in self.policy.external and self.silent_for(TRAINER, rank, now) <= self.policy.trainer_silent:
            self.refused[(TRAINER, rank)], self.attempts[(TRAINER, rank)] = started, 1
            self.say(f"a second process claimed {who(TRAINER, rank)} (start {started}) while the one that holds it "
                     "is alive; it was refused, and the job goes on")
            return
        if self.resuming:
            raise TrainersRestart(f"{who(TRAINER, rank)} started again (start {started})")
        raise RankFailed(f"{who(TRAINER, rank)} restarted (its process started again, start {started}); trainers "
                         "do not rejoin a running job", reasons.TRAINER_STOPPED)

    def trainer_layout(self) -> FlatLayout | None:
        """The layout trainer rank 0 joined with (proven), None before it joined: what an external
        vLLM server's claim is checked against (claims.py)."""
        got = self.proven(TRAINER, 0, 1)
        return None if got is None else FlatLayout.from_json(got.meta)

    def there(self, rank: int) -> bool:
        """Whether the worker holding inference rank `rank` is there: admitted (or, before the plan,
        on its way) and not counted away."""
        seat = self.seats.get(rank)
        return seat is None or seat.state not in (AWAY, DROPPED, PARKED)

    def silent_for(self, role: str, rank: int, now: float) -> float:
        key = Keys.beat(role, rank)
        if not self.has(key):
            return 0.0
        count = self.store.add(key, 0)
        seen = self.beats.get((role, rank))
        if seen is None or seen.count != count:
            self.beats[(role, rank)] = Beat(count, now)
            return 0.0
        return now - seen.seen

    def check_failures(self, trainers: bool = True) -> None:
        """RankFailed for a rank that reported a failure; without `trainers`, a trainer rank's
        report waits for the next check with them."""
        failures = self.store.add(Keys.FAILURES, 0)
        if failures > self.failures_seen or (trainers and self.deferred):
            self.failures_seen, self.deferred = failures, False
            for role, rank in self.ranks:
                if self.has(Keys.failed(role, rank)):
                    if role == TRAINER and not trainers:
                        self.deferred = True
                        continue
                    raise self.blame(role, rank, RankFailure.from_json(self.get(Keys.failed(role, rank))))

    def blame(self, role: str, rank: int, failure: RankFailure) -> RankFailed:
        """The failure to report when (role, rank) reported `failure`, with its reason: another
        rank's, if one stopped first (started again, or no heartbeat through the whole window: a
        trainer's stop is TrainerStopped, as the watch names it).
        Bytes that changed on the way are no other rank's doing: counted as a failed verification,
        and blamed on the rank that found them."""
        message = failure.message
        if failure.reason in (reasons.CHECKSUM_MISMATCH, reasons.VERIFICATION_FAILED):
            if failure.reason == reasons.CHECKSUM_MISMATCH:  # (a digest's is counted by the rank that compared it)
                self.verification_failed()
            return RankFailed(f"{who(role, rank)} failed: {message}", failure.reason)
        # A rank that never beat cannot have stopped, nor one that reported a failure itself (its
        # pod reports for each rank its command had not ended)
        others = [r for r in self.ranks if r != (role, rank) and not self.has(Keys.failed(*r))]
        counts = {r: self.store.add(Keys.beat(*r), 0) for r in others}
        others = [r for r in others if counts[r] or self.store.add(Keys.join(*r), 0) > self.counted(*r)]
        deadline = time.monotonic() + BLAME_WINDOW
        stopped = None
        while stopped is None:
            for r in others:
                if self.store.add(Keys.join(*r), 0) > self.counted(*r):
                    stopped = r, "its process started again"
            if time.monotonic() > deadline:
                # (not one that reported a failure meanwhile: it stopped beating as it failed)
                quiet = [r for r in others if self.store.add(Keys.beat(*r), 0) == counts[r]
                         and not self.has(Keys.failed(*r))]
                if quiet:
                    stopped = quiet[0], f"no heartbeat for {BLAME_WINDOW:.0f}s: its process died or froze"
                break
            time.sleep(0.1)
        if stopped is None:
            return RankFailed(f"{who(role, rank)} failed: {message}", failure.reason)
        (srole, srank), how = stopped
        if srole == TRAINER and self.resuming:
            return TrainersRestart(f"{who(srole, srank)} stopped ({how}), and {who(role, rank)} failed with it: {message}")
        return RankFailed(f"{who(srole, srank)} stopped first ({how}); then {who(role, rank)} failed: {message}",
                          reasons.TRAINER_STOPPED if srole == TRAINER else reasons.RANK_FAILED)

    # ------------------------------------------------------------ the roster

    def _away(self, rank: int, why: str) -> None:
        seat, replica = self.seats[rank], self.policy.replica_of(rank) or range(0)
        if seat.state in (SERVING, WAITING):
            if replica and all(self.seats[r].state not in (AWAY, JOINING) for r in replica if r != rank):
                # the first of its replica to go: the group its ranks form when they start again is a new one
                self.departures[replica.start] = self.departures.get(replica.start, 0) + 1
                self.set(Keys.replica(replica.start), str(self.departures[replica.start]))
            seat.state, seat.since = AWAY, time.monotonic()
            self.set(Keys.away(rank, seat.attempt), why)  # a start that is alive learns it from there
            self.say(f"{who(INFERENCE, rank)} is away: {why}; the job goes on without it until it rejoins "
                     f"(within {self.policy.away_limit:.0f}s)")
            if self.in_round.get(rank) == seat.attempt:
                self._cut(rank)
            for peer in replica:  # a replica goes as a whole: its process group cannot take back one rank
                self._away(peer, f"{who(INFERENCE, rank)} of its tensor-parallel replica is away")

    def _drop(self, rank: int) -> None:
        """An inference rank away past away_limit: dropped from the versions while at least
        min_available others remain (taken back if its process starts again, or once the start it
        was joining with joins), else RankFailed."""
        remaining = sum(1 for r, s in self.seats.items() if r != rank and s.state not in (DROPPED, PARKED))
        if remaining < self.needed:
            raise RankFailed(f"{who(INFERENCE, rank)} did not come back within {self.policy.away_limit:.0f}s after it went "
                             f"away, and the job needs {self.needed} inference ranks "
                             f"(spec.inference.minAvailable) with {remaining} left", reasons.RANK_LOST)
        seat = self.seats[rank]
        seat.late = seat.state == JOINING
        seat.state, seat.since = DROPPED, time.monotonic()
        self.say(f"{who(INFERENCE, rank)} dropped: away for more than {self.policy.away_limit:.0f}s; the job goes on with "
                 f"{remaining} inference ranks (it needs {self.needed}, spec.inference.minAvailable) and takes it "
                 f"back {'once its start joins, or ' if seat.late else ''}if its process starts again")

    def _lost(self, rank: int, why: str) -> None:
        if self.in_round.get(rank) == self.seats[rank].attempt:
            self._away(rank, why)

    def _cut(self, rank: int) -> None:
        """Tell the trainers that a receiver of the round on its way is gone: a receiver whose pod
        vanished may leave their sends to it hanging (no reset ever comes) until their timeout."""
        if self.round is not None and rank in self.in_round and rank not in self.cut:
            self.cut.add(rank)
            self.set(Keys.cut(self.round.version, self.round.again), cut_to_json(self.cut))

    def _restarted(self, rank: int, attempt: int) -> None:
        seat = self.seats.get(rank)
        if seat is None:  # before the plan: the first admission takes the latest attempt
            raise RankFailed(f"{who(INFERENCE, rank)} restarted before the job started; it cannot be admitted twice")
        self._away(rank, f"its process started again (start {attempt})")
        if seat.state in (DROPPED, PARKED):  # back after it was dropped, or its pod scaled up to: away_limit to join in
            seat.since = time.monotonic()
        seat.attempt, seat.state, seat.holds = attempt, JOINING, None
        self.set(Keys.nonce(INFERENCE, rank, attempt), secrets.token_hex(16))

    def _readmit(self, rank: int) -> None:
        """Take the rank back once its latest start proved the token: a rank of a tensor-parallel
        replica (policy.tp_replicas) once every rank of the replica did, each with a new start."""
        members = self.policy.replica_of(rank) or range(rank, rank + 1)
        proofs = {r: self.proven(INFERENCE, r, seat.attempt) if seat.state == JOINING or (seat.state == DROPPED and seat.late)
                  else None for r, seat in ((r, self.seats[r]) for r in members)}
        if all(got is not None for got in proofs.values()):
            for r, got in proofs.items():
                self._take_back(r, got)

    def _take_back(self, rank: int, got: Admission) -> None:
        seat = self.seats[rank]
        self.check_rejoin(rank, got.meta, got.info)
        seat.endpoint, seat.state, seat.since, seat.info = got.endpoint, WAITING, time.monotonic(), got.info
        seat.late = False
        first = seat.attempt == 1  # a pod scaled up to, starting for the first time
        seat.rejoins += 0 if first else 1
        self.epoch += 1
        self._publish_peers()
        self.say(f"{who(INFERENCE, rank)} {'joined the running job' if first else 'rejoined'} (start {seat.attempt}, "
                 f"pod {got.info.pod}, at {got.endpoint}); it receives the next round in full and serves once it has "
                 "verified it")

    def limit_for(self, role: str) -> float:
        """Seconds without a heartbeat after which a rank of `role` counts as silent."""
        return self.policy.trainer_silent if role == TRAINER else self.policy.silent_limit
