"""The controller's watch over the ranks (a mixin of roster.Host): their heartbeats, the restarts
of their processes and the failures they report. A trainer that restarts or goes silent fails the
job (or, where the trainers resume, has them resume: resume.py), an inference rank that does is
counted away and awaited (roster.py), and a rank that reports a failure fails the job.

A failure is blamed on the rank that failed first. When a rank reports a failure, the controller
first looks, for a few heartbeats, for a rank that stopped (its process started again, or its
heartbeat stopped): a survivor that saw its peer vanish reports first, but its peer is the cause.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Iterable, Sequence

from weightsync.job import INFERENCE, TRAINER, reasons
from weightsync.rendezvous.join_phase import RankFailed, TrainersRestart
from weightsync.rendezvous.messages import RankFailure
from weightsync.rendezvous.protocol import HEARTBEAT, Keys, who
from weightsync.rendezvous.seats import AWAY, DROPPED, JOINING, PARKED

BLAME_WINDOW = 3.5 * HEARTBEAT  # seconds to look for a rank that stopped before blaming the one that reported


@dataclass
class Beat:
    count: int
    seen: float  # when the count last changed


class Watching:
    """The roster's part that watches the ranks: mixed into roster.Host, whose ranks, seats,
    policy and store it reads, and whose seats it changes through the roster's moves (_away,
    _drop, _restarted, _readmit)."""

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
        if not self.look_due(now):
            return
        self.serve_claims()
        looked = self.look(self.ranks)
        for role, rank in self.ranks:
            if role == TRAINER and not trainers:
                continue
            started = self.started_since(role, rank, looked[(role, rank)][0])
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
            silent = self.silence(role, rank, looked[(role, rank)][1], now)
            if silent > self.limit_for(role):
                why = f"no heartbeat for {silent:.0f}s (its process died, froze, or lost the network)"
                if seat is None and self.resuming:
                    raise TrainersRestart(f"{who(role, rank)} is silent: {why}")
                if seat is None:
                    raise RankFailed(f"{who(role, rank)} is silent: {why}", reasons.TRAINER_STOPPED)
                self._away(rank, why)

    def look_due(self, now: float) -> bool:
        """Whether the ranks' starts and heartbeats are due a look (every HEARTBEAT / 4); if so,
        they count as looked at `now`."""
        if now - self.last_watch < HEARTBEAT / 4:
            return False
        self.last_watch = now
        return True

    def serve_claims(self) -> None:
        """Answer the claims of external vLLM servers' workers to inference ranks (claims.py), in a
        job whose inference ranks are external."""
        if self.claims is not None:
            self.claims.serve(self, self.there)

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

    def look(self, ranks: Sequence[tuple[str, int]]) -> dict[tuple[str, int], tuple[int, int | None]]:
        """{(role, rank): (its starts, its heartbeats, None where it never beat)}, every rank's in one
        read of the store: the watch looks at every rank four times a heartbeat, and a look per rank
        and counter (each a write of the counter, as add(key, 0) is) made the controller's CPU grow
        with the ranks faster than anything else it does between two versions."""
        keys = self._looks.get(tuple(ranks))
        if keys is None:
            if len(self._looks) >= 4:  # (the ranks looked at change only as pods are scaled: a few kept)
                self._looks.clear()
            keys = self._looks[tuple(ranks)] = [k for r in ranks for k in (Keys.join(*r), Keys.beat(*r))]
        values = self.peek(keys)
        return {r: (int(values[2 * i] or 0), None if values[2 * i + 1] is None else int(values[2 * i + 1]))
                for i, r in enumerate(ranks)}

    def silent_for(self, role: str, rank: int, now: float) -> float:
        key = Keys.beat(role, rank)
        return self.silence(role, rank, self.store.add(key, 0) if self.has(key) else None, now)

    def silence(self, role: str, rank: int, count: int | None, now: float) -> float:
        """Seconds (role, rank) has been silent, as of `now`, its heartbeats counted at `count`
        (None: it never beat, and is not silent)."""
        if count is None:
            return 0.0
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

    def forget_failures(self, role: str) -> None:
        """Forget the failures the ranks of `role` reported: the last words of processes that were
        to stop (the trainers' earlier starts, as they resume)."""
        for rank in range(self.layout.world_size(role)):
            self.store.delete_key(Keys.failed(role, rank))

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

    def limit_for(self, role: str) -> float:
        """Seconds without a heartbeat after which a rank of `role` counts as silent."""
        return self.policy.trainer_silent if role == TRAINER else self.policy.silent_limit
