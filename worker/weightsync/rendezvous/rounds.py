"""The rounds of a running job, on the controller's side of the rendezvous (a mixin of
roster.Host): the go that says which inference ranks receive a version, and under which set of
their endpoints; the trainers' readiness for the next version, or their close; the reports of the
trainers that sent it and of the inference ranks that received, staged or applied it; which rank
holds which version; and forgetting a round's keys once no rank reads them, so that an endless
job's store stays bounded. A receiver that vanishes meanwhile is counted away (roster.py), and
the round goes on without it.
"""

from __future__ import annotations

import time
from typing import Callable, Iterable, Mapping

from weightsync.job import INFERENCE, TRAINER, reasons
from weightsync.job.errors import JobFailed, TimedOut
from weightsync.rendezvous.join_phase import RankFailed
from weightsync.rendezvous.last_word import hear_out
from weightsync.rendezvous.messages import (
    Applied,
    Done,
    Mark,
    Number,
    Ready,
    Reference,
    Round,
    SentReport,
    Staged,
    Text,
)
from weightsync.rendezvous.protocol import Keys, who
from weightsync.rendezvous.seats import DROPPED, PARKED, SERVING, WAITING

BACK_POLL = 0.02  # seconds between looks for an inference rank that came back
COLLECT_WAIT = 0.05  # seconds a collecting round waits for a report before it looks at the roster again
RECORDS_KEPT = 16  # rounds' records (done) kept in the store; older ones are deleted, so an endless job's keys stay bounded


class _AllClosed(Exception):
    """Every trainer rank closed: there is no next version."""


class Rounds:
    """The roster's part that runs the rounds: mixed into roster.Host, whose seats, epoch, store
    and watch (check_ranks) it uses."""

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
                self.set(Keys.welcome(r, seat.attempt), rnd)
                seat.state, seat.since = SERVING, time.monotonic()
        self.set(Keys.go(version, again), rnd)
        if not again:
            self.set(Keys.LATEST, Number(version))
        return rnd

    def say_dropped(self, version: int, why: str) -> None:
        """`version` is dropped on its way: its receivers take none of it (Following.check_dropped)."""
        self.set(Keys.dropped(version), Text(why))

    def say_unloaded(self, version: int, rank: int) -> None:
        """Inference rank `rank`'s server does not load `version`: the rank discards what it staged."""
        self.set(Keys.unloaded(version, rank, self.in_round[rank]), Mark())

    def say_done(self, rnd: Round, record: dict) -> None:
        """`rnd` is done: the controller's record of it (status.transfer's fields), what a trainer waits for."""
        self.set(Keys.done(rnd.version, rnd.again), Done(record))

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

    def applied_of(self, rnd: Round, rank: int) -> Applied | None:
        """What receiver `rank` of the round on its way said became of it (applied, or its load
        failed), with the start it receives with; None before it said."""
        key = Keys.applied(rnd.version, rank, self.in_round[rank])
        return Applied.from_json(self.get(key)) if self.has(key) else None

    def receiving(self) -> dict[int, int]:
        """{receiver of the round on its way: the start it receives with}."""
        return dict(self.in_round)

    def _collect(self, rnd: Round, key_of, read, what: str, timeout: float) -> dict:
        """Each pending receiver's record, read once as it is set: the store hands the controller
        the keys set since its last look (Table.arrivals), and the wait blocks in the store until one
        is (at most COLLECT_WAIT, to keep the roster). Neither every rank's key polled in a loop,
        which at a thousand receivers took the CPU the store needs to serve them, nor every pending
        key looked at again at each record's arrival, which made a round's collection grow with the
        square of its receivers."""
        pending = dict(self.in_round)
        records = {key_of(rnd.version, r, attempt): r for r, attempt in pending.items()}
        # staged: a load ahead that failed says so as applied, which ends the wait for that rank
        ahead = {} if key_of is Keys.applied else \
            {Keys.applied(rnd.version, r, attempt): r for r, attempt in pending.items()}
        got = {}
        start = looked = time.monotonic()
        with self.store.arrivals([*records, *ahead]) as arrivals:
            come = arrivals.take(0.0)
            while True:
                for key in come:
                    if (r := records.get(key)) is not None and r in pending:
                        got[r] = read(self.get(key))
                        del pending[r]
                for key in come:  # after the records: a rank's staged record stands where both came
                    if (r := ahead.get(key)) is not None:
                        pending.pop(r, None)  # (its applied record is read next)
                if pending and (not come or time.monotonic() - looked >= COLLECT_WAIT):
                    looked = time.monotonic()  # the roster, at most every COLLECT_WAIT while records come
                    for r, attempt in list(pending.items()):
                        if self.seats[r].attempt != attempt or self.seats[r].state != SERVING:
                            del pending[r]  # a record set since the take above stays pending: read at the next
                if not pending:
                    return got
                self.check_ranks(trainers=not self.resuming)  # sent: the round needs them no more
                if time.monotonic() - start > timeout:
                    raise TimedOut(f"waited {timeout:.0f}s for the inference ranks to {what} {rnd.name} "
                                   f"({', '.join(who(INFERENCE, r) for r in sorted(pending))} did not)")
                come = arrivals.take(COLLECT_WAIT)

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

    def publish_reference(self, rnd: Round, reference: Reference, carried: bool) -> None:
        """Publish what `rnd`'s receivers check their digests against: each receiver's own digest
        under a key of its own (Keys.ref_of), the whole reference (Keys.ref) for the controller's
        repeats. The first sending that reached a rank (carried) sets it; a repeat must carry the
        same digest to every receiver that had one, and gives theirs to the others.
        JobFailed (VERIFICATION_FAILED) where a repeat carries another digest."""
        first = Reference.from_json(self.get(Keys.ref(rnd.version))) if self.has(Keys.ref(rnd.version)) else None
        if first is None and not carried:
            return
        for r in rnd.receivers if first is not None else ():
            was, now = first.of(r), reference.of(r)
            if was is not None and was != now:
                raise JobFailed(f"the trainers sent {rnd.name} to {who(INFERENCE, r)} with digest {now[:16]}, not "
                                f"the {was[:16]} they sent the first time", reasons.VERIFICATION_FAILED)
        own = [(r, reference.of(r)) for r in rnd.receivers if reference.of(r) is not None]
        self.store.multi_set([Keys.ref_of(rnd.version, r) for r, _ in own], [d for _, d in own])
        if first is None:
            self.set(Keys.ref(rnd.version), reference)

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
        keys += [Keys.ref_of(version, r) for r in self.seats]
        if version >= RECORDS_KEPT:  # a record is read by the trainers the version after it, by a bench later
            keys.append(Keys.done(version - RECORDS_KEPT))
        for key in keys:
            self.store.delete_key(key)
