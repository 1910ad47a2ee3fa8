"""An inference rank's side of the rounds (a mixin of protocol.Member): the controller's go it
waits for, and what it learns on the way of a round that goes on without it. A rank that was
frozen or cut off meanwhile, and counted away, learns it (FellBehind) instead of waiting for a key
that will never come; one whose round was dropped, as a trainer rank stopped mid-way and the
trainers resume, leaves it (Dropped); and one that rejoins waits for its welcome, the round that
takes it back (roster.py is the controller's side).
"""

from __future__ import annotations

import time
from typing import Callable, Mapping

from weightsync.job import INFERENCE
from weightsync.rendezvous.channel import CHECK_EVERY, JobEnded
from weightsync.rendezvous.keys import Keys
from weightsync.rendezvous.messages import End, Round


class FellBehind(RuntimeError):
    """An inference rank waits for the go of a version the controller sent without it (it was
    frozen or cut off meanwhile, and counted away): it must start again and rejoin."""


class Dropped(RuntimeError):
    """The controller dropped the round this inference rank receives: a trainer rank stopped while
    it was on its way and the trainers resume from their checkpoint. Its bytes are half sent, never
    verified, and the rank goes on to the next version on the weights it serves."""


def dropped_on_its_way(version: int, why: bytes) -> Dropped:
    """What a receiver of `version` raises once the controller dropped it (Keys.dropped says why)."""
    return Dropped(f"version {version} was dropped on its way: {why.decode()}")


class Following:
    """The rounds as an inference rank follows them: mixed into protocol.Member, whose store,
    role, rank, attempt and waits it uses."""

    def round(self, version: int, again: int = 0, timeout: float | None = None) -> Round:
        """Wait for the controller's go for that round (TimeoutError past `timeout` seconds). An
        inference rank that waits for a version whose go the controller has already said, and
        deleted (it forgets a round's keys two versions on), was left behind: FellBehind, instead
        of a wait for a key that will never come back."""
        return Round.from_json(self.awaited(version, Keys.go(version, again), f"the controller's go for version {version}",
                                            timeout, again))

    def awaited(self, version: int, key: str, what: str, timeout: float | None = None, again: int = 0) -> bytes:
        """The value of `key` of round `version` (of its repeat `again`), once the controller set
        it: handed over with the end of the wait, and what the wait's check looks at with each of
        its steps (Channel.wait's looks), so that a waiting rank asks the store once a second and
        once more for the value. A repeat's wait ends at the job's end; a first sending's as
        behind(version, key) says."""
        if again:
            return self.wait([key], what, timeout, self.check_end, stops=[Keys.END], looks=[])[0]
        return self.wait([key], what, timeout, self.behind(version, key), stops=self.stops(version),
                         looks=[Keys.LATEST] if self.role == INFERENCE else [])[0]

    def behind(self, version: int, key: str) -> Callable[..., None]:
        """A check for an inference rank's wait for `key` of round `version`: the job's end, and
        FellBehind once the controller has gone on to a later version and the key is gone (its
        round's keys are deleted two versions on), so that a rank that was frozen or cut off
        meanwhile does not wait for a key that will never come back; and FellBehind once the
        controller counted this start away, whatever it waits for (after the final version no later
        one comes to tell it, and the controller waits for it to rejoin). Given what the wait just
        read (`seen`, Channel.wait's looks), it looks there instead of asking the store again."""
        def check(seen: Mapping[str, bytes | None] | None = None) -> None:
            if self.role != INFERENCE:
                self.check_end(seen)
                return
            wanted = [Keys.END, Keys.dropped(version), Keys.away(self.rank, self.attempt), Keys.LATEST, key]
            folded = seen is not None and all(k in seen for k in wanted)
            end, dropped, why, latest, there = [seen[k] for k in wanted] if folded else self.peek(wanted)
            if end is not None:
                ended = End.from_json(end)
                raise JobEnded(ended.state, ended.message)
            if dropped is not None:
                raise dropped_on_its_way(version, dropped)
            if why is not None:
                raise FellBehind(f"the controller counted this rank away while it waited for {key} of version "
                                 f"{version} ({why.decode()})")
            if latest is not None and int(latest) > version and there is None:
                raise FellBehind(f"waited for {key} of version {version}, but the controller went on to "
                                 f"version {int(latest)} without this rank: it was frozen or cut off")
        return check

    def stops(self, version: int) -> list[str]:
        """The keys on which behind(version, ...)'s check raises at once (Channel.wait's stops): the
        job's end, and for an inference rank `version` dropped and this start counted away."""
        if self.role != INFERENCE:
            return [Keys.END]
        return [Keys.END, Keys.dropped(version), Keys.away(self.rank, self.attempt)]

    def check_dropped(self, version: int) -> None:
        """Dropped where the controller dropped `version` (a trainer rank stopped mid-way)."""
        if self.has(Keys.dropped(version)):
            raise dropped_on_its_way(version, self.get(Keys.dropped(version)))

    def verdict(self, rnd: Round, timeout: float) -> None:
        """An inference rank whose receive of `rnd` failed in a job whose trainers resume: wait up
        to `timeout` seconds for the controller to say what became of the round, as it may have
        lost a sender that stopped. Dropped where it dropped the round; returns where it went on
        without this rank, or said nothing in time (the caller's error stands)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.check_end()
            self.check_dropped(rnd.version)
            if self.counted_away(rnd):
                return
            time.sleep(CHECK_EVERY)

    def away(self) -> str | None:
        """Why the controller counted this start of an inference rank away; None where it did not."""
        key = Keys.away(self.rank, self.attempt)
        return self.get(key).decode() if self.has(key) else None

    def replica_epoch(self, start: int) -> int:
        """How many times the controller counted the tensor-parallel replica whose first inference
        rank is `start` away: its ranks form their process group under that number."""
        return int(self.get(Keys.replica(start))) if self.has(Keys.replica(start)) else 0

    def latest(self) -> int | None:
        """The latest version the controller announced, None before the first."""
        return int(self.get(Keys.LATEST)) if self.has(Keys.LATEST) else None

    def counted_away(self, rnd: Round) -> bool:
        """Whether the controller went on without this inference rank in round `rnd`: it cut it off
        (the trainers stopped sending to it), or it is at a later version already, which it only
        is once every receiver of the round applied it or was counted away."""
        if self.rank in self.cut_off(rnd):
            return True
        latest = self.latest()
        return latest is not None and latest > rnd.version

    def joins_late(self, timeout: float) -> bool:
        """Whether this inference rank joins the running job, taken in at a later round than the
        first (its welcome says which): its process started again, or its pod was scaled up to
        after the ranks joined (the plan's endpoints, epoch 0, do not name it)."""
        return self.attempt > 1 or self.rank not in self.peers(0, timeout)

    def welcome(self) -> Round:
        """A rejoined inference rank: the round it receives first (the controller says it at the
        next version, or at once when the trainers are done)."""
        key = Keys.welcome(self.rank, self.attempt)

        def check() -> None:  # counted away again meanwhile (frozen, or its replica went): never taken back
            self.check_end()
            if (why := self.away()) is not None:
                raise FellBehind(f"the controller counted this rank away while it waited to be taken back ({why})")
        self.wait([key], "the controller to take this rank back at the next version", None, check)
        return Round.from_json(self.get(key))
