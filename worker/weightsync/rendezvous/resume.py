"""The controller's side of trainers that resume from their checkpoint.

Every training stack survives a lost node the same way: the trainers start again and load their
last checkpoint. A job whose trainers run the user's script (spec.trainer.command) takes that: when
a trainer rank stops between two versions (its process started again, or went silent, or the
others failed as their collective lost it), the controller does not end the job. It bumps
Keys.RESUMING, which ends the trainer processes of earlier starts that still wait on weightsync
(they start again too: a data-parallel group cannot take one new process), and waits for every
trainer rank to start again and prove the token over a fresh challenge, saying every few seconds
which ranks are back. Then it publishes where they resume (Keys.RESUME): the next version number,
which goes on from the last one said (never back, never a number reused for other bytes), and
the last delivered version and its step, for the script to check its checkpoint against. The
inference ranks serve the last version meanwhile, and get the next one whole (the trainers kept
no copy of the last to send a delta against).

A trainer that stops while a version is on its way, before every trainer rank reported it sent,
drops that version first (Keys.dropped): its bytes are half sent by processes that are gone, no
receiver verified it, and every receiver leaves it and keeps the version it serves; the resume's
next version is the one after it. One that stops once the version is sent is seen at the next
version, when the round has ended."""

from __future__ import annotations

import time
from typing import Callable, Protocol

from weightsync.job import TRAINER, Layout, reasons
from weightsync.rendezvous.join_phase import PROGRESS_EVERY, RankFailed, named
from weightsync.rendezvous.messages import Admission, ResumePoint
from weightsync.rendezvous.protocol import who

POLL = 0.05  # seconds between looks at the trainers' starts and proofs


class Host(Protocol):
    """What resuming asks of the controller's Host (roster.py): its verbs, and the layout it was
    built for, never the state it keeps."""

    layout: Layout

    def say(self, line: str) -> None: ...
    def begin_resume(self, version: int) -> int: ...
    def trainers_running(self) -> dict[int, int]: ...
    def attempt(self, role: str, rank: int) -> int: ...
    def challenge(self, role: str, rank: int, attempt: int) -> None: ...
    def started_again(self, role: str, rank: int) -> int | None: ...
    def proven(self, role: str, rank: int, attempt: int) -> Admission | None: ...
    def check_ranks(self, trainers: bool = True) -> None: ...
    def forget_failures(self, role: str) -> None: ...
    def resumed(self, point: ResumePoint) -> None: ...


def resume(host: Host, timeout: float, version: int, delivered: int | None, step: int | None,
           check: Callable[[int, Admission], None], every: float = PROGRESS_EVERY) -> dict[int, int]:
    """Take every trainer rank back at a later start; returns {trainer rank: its start}.
    `version`: the next version (no go was said for it); `delivered` and `step`: the last version
    delivered and its training step (None before the first); `check(rank, admission)` raises where
    a trainer comes back with another model or transport. RankFailed naming the ranks that did not
    start again within `timeout` seconds."""
    trainers = host.layout.world_size(TRAINER)
    resumes = host.begin_resume(version)  # before any challenge: a process of this start must not see it
    before = host.trainers_running()
    for t in range(trainers):
        if host.attempt(TRAINER, t) > before[t]:  # a start seen already: its challenge
            host.challenge(TRAINER, t, host.attempt(TRAINER, t))
    back: dict[int, int] = {}
    start = said = time.monotonic()
    while len(back) < trainers:
        host.forget_failures(TRAINER)  # the earlier processes' last words: they were to stop
        host.check_ranks(trainers=False)  # the inference ranks' roster goes on
        for t in range(trainers):
            started = host.started_again(TRAINER, t)
            if started is not None:  # (again): it joins with its latest start
                host.challenge(TRAINER, t, started)
                back.pop(t, None)
            attempt = host.attempt(TRAINER, t)
            if t not in back and attempt > before[t]:
                got = host.proven(TRAINER, t, attempt)
                if got is not None:
                    check(t, got)
                    back[t] = attempt
                    host.say(f"{who(TRAINER, t)} is back (start {attempt}, at {got.endpoint})")
        now = time.monotonic()
        missing = [t for t in range(trainers) if t not in back]
        if missing and now - start > timeout:
            raise RankFailed(f"{named(TRAINER, missing)} did not start again within {timeout:.0f}s "
                             "(spec.trainer.attachTimeoutSeconds) to resume the job: every trainer rank must start "
                             "again and attach (with torchrun: --max-restarts, so that it starts its processes again)",
                             reasons.TRAINER_STOPPED)
        if missing and now - said >= every:
            said = now
            host.say(f"the trainers resume: {named(TRAINER, sorted(back)) if back else 'no trainer rank'} back, "
                     f"{named(TRAINER, missing)} to start again ({max(timeout - (now - start), 0):.0f}s left)")
        time.sleep(POLL)
    host.forget_failures(TRAINER)
    host.resumed(ResumePoint(resumes, version, delivered, step, back))  # their silence counts from now
    return back
