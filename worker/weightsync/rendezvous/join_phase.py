"""The join phase of the controller's rendezvous: every rank proves the job token for its latest
start, and the controller says every few seconds who joined and who is still missing.

Pods start in any order, and one can die while the others join (an OOM kill while it loads its
model, a preemption at start): its kubelet starts it again, and it must join with that start, not
leave the job waiting for the dead one's proof. So while the ranks join the controller follows
each rank's starts and heartbeat as it does once the job runs (roster.py): an inference rank
joins with its new start over a fresh challenge, a trainer that restarts or goes silent fails the
job. The ranks of an external role (processes the user starts) have their role's deadline, and the
job fails naming the ones that never came. The parked inference ranks (beyond
spec.inference.replicas, roster.py) are not waited for: they join once the job runs.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Mapping, Protocol

from weightsync.job import TRAINER, reasons
from weightsync.job.errors import JobFailed, TimedOut
from weightsync.rendezvous.messages import Admission
from weightsync.rendezvous.policy import Policy
from weightsync.rendezvous.protocol import Keys, who

PROGRESS_EVERY = 5.0  # seconds between two lines, while the ranks join, about the ones still missing


class RankFailed(JobFailed, RuntimeError):
    """A rank failed or went silent; the message names it, `reason` says how (job/reasons.py)."""

    reason = reasons.RANK_FAILED


class TrainersRestart(RankFailed):
    """A trainer rank of a script that resumes from its checkpoint stopped (its process started
    again, or went silent): the trainers resume (resume.py); where they cannot, the job fails."""

    reason = reasons.TRAINER_STOPPED


@dataclass(frozen=True)
class Deadline:
    """How long the ranks of an external role have to join, and what to tell the user."""

    seconds: float
    setting: str  # the spec's field that sets it
    how: str  # how such a rank is started (what it needs besides the three variables)


def named(role: str, ranks: list[int]) -> str:
    """"trainer rank 3", or "trainer ranks 0-3, 6"."""
    runs: list[list[int]] = []
    for r in ranks:
        if runs and runs[-1][-1] == r - 1:
            runs[-1].append(r)
        else:
            runs.append([r])
    text = ", ".join(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]) for run in runs)
    return f"{role} rank{'s' if len(ranks) > 1 else ''} {text}"


def progress(ranks: list[tuple[str, int]], admitted: Mapping, limits: Mapping[str, Deadline], waited: float,
              notes: Mapping[tuple[str, int], str]) -> str:
    """One line: which ranks of each role joined, which are still missing and for how long more
    (and the spec's field that says so, for an external role), and what is known of a missing one."""
    parts = []
    for role, limit in limits.items():
        joined = [k for r, k in ranks if r == role and (r, k) in admitted]
        missing = [k for r, k in ranks if r == role and (r, k) not in admitted]
        if missing:
            setting = f", {limit.setting}" if limit.setting else ""
            parts.append(f"{named(role, joined) if joined else f'no {role} rank'} joined, {named(role, missing)} "
                         f"missing ({max(limit.seconds - waited, 0):.0f}s left{setting})")
        else:
            parts.append(f"every {role} rank joined")
    parts += [f"{who(*r)} {note}" for r, note in sorted(notes.items()) if r not in admitted]
    return f"waiting for the ranks to join: {'; '.join(parts)}"


class Host(Protocol):
    """What the join phase asks of the controller's Host (roster.py): its verbs, and the rules and
    ranks it was built with, never the state it keeps."""

    ranks: list[tuple[str, int]]
    policy: Policy

    def say(self, line: str) -> None: ...
    def waits_for(self) -> list[tuple[str, int]]: ...
    def attempt(self, role: str, rank: int) -> int: ...
    def challenge(self, role: str, rank: int, attempt: int) -> None: ...
    def look_due(self, now: float) -> bool: ...
    def serve_claims(self) -> None: ...
    def limit_for(self, role: str) -> float: ...
    def check_failures(self, trainers: bool = True) -> None: ...
    def proven(self, role: str, rank: int, attempt: int) -> Admission | None: ...
    def peek(self, keys: list[str]) -> list[bytes | None]: ...
    def look(self, ranks: list[tuple[str, int]]) -> dict[tuple[str, int], tuple[int, int | None]]: ...
    def started_since(self, role: str, rank: int, started: int) -> int | None: ...
    def trainer_started(self, rank: int, started: int, now: float) -> None: ...
    def follow_scale(self) -> None: ...
    def silence(self, role: str, rank: int, count: int | None, now: float) -> float: ...


class Joining:
    """One join phase: run() waits for every rank's proof and returns {(role, rank): what it
    published}. A rank's latest start is the one admitted: an inference rank whose process started
    again while the ranks joined joins with its new start (_follow). The ranks of an `external`
    role each have their role's Deadline, from now: the job fails naming those that did not join by
    then; the others have `timeout`. Meanwhile a line every `every` seconds says which ranks joined
    and which are still missing."""

    def __init__(self, host: Host, timeout: float, external: Mapping[str, Deadline], every: float = PROGRESS_EVERY):
        self.host, self.timeout, self.external, self.every = host, timeout, dict(external), every
        self.limits = {role: self.external.get(role, Deadline(timeout, "", ""))
                       for role in dict.fromkeys(r for r, _ in host.ranks)}
        self.admitted: dict[tuple[str, int], Admission] = {}
        self.notes: dict[tuple[str, int], str] = {}  # what is known of a rank that has not joined

    def run(self) -> dict[tuple[str, int], Admission]:
        host, external, admitted, notes = self.host, self.external, self.admitted, self.notes
        start = time.monotonic()
        deadline, said = start + self.timeout, start
        pause = 0.001
        while not all(r in admitted for r in self.expected()):
            host.check_failures()
            host.serve_claims()
            now = time.monotonic()
            if host.look_due(now):
                host.follow_scale()
                self._follow(now)
            waiting = [r for r in self.expected() if r not in admitted]
            proofs = host.peek([Keys.published("proof", *r, host.attempt(*r)) for r in waiting])
            for (role, rank), proof in zip(waiting, proofs):  # every proof looked for in one read of the store
                if proof is not None:
                    got = host.proven(role, rank, host.attempt(role, rank))
                    if got is not None:
                        admitted[(role, rank)] = got
                        if role in external or (role, rank) in notes:
                            attempt = host.attempt(role, rank)
                            host.say(f"{who(role, rank)} joined ({'external, ' if role in external else ''}"
                                     f"{f'start {attempt}, ' if attempt > 1 else ''}at {got.endpoint})")
            now = time.monotonic()
            for role, limit in external.items():
                missing = [k for r, k in self.expected() if r == role and (r, k) not in admitted]
                if missing and now - start > limit.seconds:
                    raise RankFailed(f"{named(role, missing)} did not join within {limit.seconds:.0f}s "
                                     f"({limit.setting}): start {'them' if len(missing) > 1 else 'it'} with the join "
                                     f"variables ({limit.how})", reasons.TIMED_OUT)
            if now - said >= self.every:
                said = now
                host.say(progress(self.expected(), admitted, self.limits, now - start, notes))
            if now > deadline:
                missing = [who(r, k) for r, k in self.expected() if (r, k) not in admitted]
                raise TimedOut(f"{len(missing)} ranks did not join within {self.timeout:.0f}s: {', '.join(missing[:6])}")
            time.sleep(pause)
            pause = min(pause * 1.5, 0.1)
        return {r: got for r, got in admitted.items() if r in self.expected()}

    def expected(self) -> list[tuple[str, int]]:
        """The ranks the job waits for: all but the parked inference ranks."""
        return self.host.waits_for()

    def _follow(self, now: float) -> None:
        """While the ranks join: follow each rank's starts (its process started again: an inference
        rank joins with its new start, over a fresh challenge, and what an earlier start published
        is dropped; a trainer fails the job as check_ranks has it) and its heartbeat (a trainer
        that went silent, joined or not, fails the job within its limit, naming it; an inference
        rank that has not joined has away_limit to start again)."""
        host, admitted, notes = self.host, self.admitted, self.notes
        expected = self.expected()
        looked = host.look(expected)  # every rank's starts and heartbeats in one read of the store
        for role, rank in expected:
            started = host.started_since(role, rank, looked[(role, rank)][0])
            if started is not None:
                if role == TRAINER:
                    host.trainer_started(rank, started, now)
                    continue
                host.challenge(role, rank, started)
                admitted.pop((role, rank), None)
                if started > 1:  # else a rank parked at first, its pod scaled up to: its first start
                    notes[(role, rank)] = f"started again (start {started}) while the ranks joined: it joins with that start"
                    host.say(f"{who(role, rank)} {notes[(role, rank)]}")
            if (role, rank) in admitted and role != TRAINER:
                continue  # an inference rank that stops now is seen by its start again, or in the first round
            silent = host.silence(role, rank, looked[(role, rank)][1], now)
            if silent > host.limit_for(role):
                when = "after it joined, while the others join" if (role, rank) in admitted else "while joining"
                why = f"no heartbeat for {silent:.0f}s {when} (its process died, froze, or lost the network)"
                if role == TRAINER:
                    raise RankFailed(f"{who(role, rank)} is silent: {why}", reasons.TRAINER_STOPPED)
                if silent > host.policy.away_limit:
                    raise RankFailed(f"{who(role, rank)} did not start again within {host.policy.away_limit:.0f}s after it "
                                     f"went silent while joining", reasons.RANK_LOST)
                notes[(role, rank)] = f"is silent: {why}; waiting for it to start again (within {host.policy.away_limit:.0f}s)"
            elif notes.get((role, rank), "").startswith("is silent"):
                del notes[(role, rank)]  # it beats again
