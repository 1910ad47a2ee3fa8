"""The controller's decisions, one case a row: what a rank does at a version (goes silent, reports
a failure, starts again, fails to load, closes early), and what the controller made of it: the
job's end and its reason, which rounds went to how many inference ranks, who was counted away,
dropped or taken back, and the status it wrote. The controller is the real one, over a real Host
on loopback, and its ranks speak the real protocol to it (support/controller_scene.py); only the
heartbeat and away limits are seconds, so that the whole table runs in the unit tier."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
from support.controller_scene import (
    BACK,
    CLOSES,
    FAILS,
    LOAD_FAILS,
    RESTARTS,
    SENDING,
    SILENT,
    Act,
    Scene,
    Spec,
    context,
    job_of,
)
from support.paths import Path as Traced
from support.roster import make_host

from weightsync.job import INFERENCE, TRAINER, Layout, reasons
from weightsync.job.states import FAILED, SUCCEEDED
from weightsync.rendezvous.protocol import Keys
from weightsync.roles.controller.driver import Controller
from weightsync.roles.controller.records import Reporter


@dataclass(frozen=True)
class Case:
    name: str
    spec: Spec
    acts: tuple[Act, ...]
    state: str
    reason: str | None  # the Failed condition's reason; None where the job succeeded
    message: str  # a part of the completion's message
    rounds: list[tuple[int, int, int]]  # (version, again, inference ranks that applied it), in order
    said: tuple[str, ...] = ()  # parts of the controller's lines, each in one of them
    rejoins: dict | None = None  # status.rejoins; None: none written
    record: dict = field(default_factory=dict)  # {version: fields its transfer record has}


CASES = [
    Case("every rank does its part", Spec(), (),
         SUCCEEDED, None, "3 versions delivered to and verified on 2 inference ranks", [(0, 0, 2), (1, 0, 2), (2, 0, 2)]),
    Case("a silent inference rank is counted away, then dropped, and the job goes on with minAvailable",
         Spec(min_available=1), (Act(INFERENCE, 1, 1, SILENT),),
         SUCCEEDED, None, "3 versions delivered", [(0, 0, 2), (1, 0, 1), (2, 0, 1)],
         said=("inference rank 1 is away: no heartbeat", "inference rank 1 dropped: away for more than 1s")),
    Case("a silent inference rank fails the job once away too long, where every rank is needed",
         Spec(), (Act(INFERENCE, 1, 1, SILENT),),
         FAILED, reasons.RANK_LOST, "inference rank 1 did not come back within 1s after it went away",
         [(0, 0, 2), (1, 0, 1), (2, 0, 1)], said=("inference rank 1 is away: no heartbeat",)),
    Case("a silent trainer fails the job, naming it", Spec(), (Act(TRAINER, 0, 1, SILENT),),
         FAILED, reasons.TRAINER_STOPPED, "trainer rank 0 is silent: no heartbeat", [(0, 0, 2)]),
    Case("a rank that reports a failure fails the job with its reason, blamed on it",
         Spec(), (Act(INFERENCE, 0, 1, FAILS),),
         FAILED, reasons.TRANSPORT_ERROR, "inference rank 0 failed: TransferError: the connection reset at version 1",
         [(0, 0, 2)]),
    Case("an inference rank that restarts is counted away, rejoins, and gets the next version whole",
         Spec(), (Act(INFERENCE, 1, 1, RESTARTS), Act(TRAINER, 0, 2, BACK)),
         SUCCEEDED, None, "3 versions delivered to and verified on 2 inference ranks (1 rejoins)",
         [(0, 0, 2), (1, 0, 1), (2, 0, 2)], said=("inference rank 1 is away: its process started again (start 2)",
                                                   "inference rank 1 rejoined (start 2"),
         rejoins={INFERENCE: 1, TRAINER: 0}),
    Case("an inference rank that restarts in the final round gets the final version again",
         Spec(), (Act(INFERENCE, 1, 2, RESTARTS),),
         SUCCEEDED, None, "(1 rejoins)", [(0, 0, 2), (1, 0, 2), (2, 0, 1), (2, 1, 1)],
         rejoins={INFERENCE: 1, TRAINER: 0}),
    Case("a trainer that restarts fails the job where the trainers do not resume",
         Spec(), (Act(TRAINER, 0, 1, RESTARTS),),
         FAILED, reasons.TRAINER_STOPPED, "trainer rank 0 restarted (its process started again, start 2)", [(0, 0, 2)]),
    Case("trainers that resume from their checkpoint: the next version goes on, whole",
         Spec(resumes=True), (Act(TRAINER, 0, 1, RESTARTS),),
         SUCCEEDED, None, "3 versions delivered", [(0, 0, 2), (1, 0, 2), (2, 0, 2)],
         said=("trainer rank 0 started again (start 2): the trainers resume from their checkpoint (resume 1)",
               "every trainer rank resumed; version 1 comes next"),
         rejoins={INFERENCE: 0, TRAINER: 1}),
    Case("a trainer that restarts while a version is on its way: the version is dropped, its number not reused",
         Spec(resumes=True), (Act(TRAINER, 0, 1, SENDING),),
         SUCCEEDED, None, "2 versions delivered", [(0, 0, 2), (2, 0, 2)],
         said=("version 1 is dropped (its bytes are half sent, none was verified)", "version 2 comes next"),
         rejoins={INFERENCE: 0, TRAINER: 1}),
    Case("a load that fails part-way with onLoadFailure rollBack: the rank is behind, and the job goes on",
         Spec(), (Act(INFERENCE, 1, 1, LOAD_FAILS),),
         SUCCEEDED, None, "3 versions delivered", [(0, 0, 2), (1, 0, 1), (2, 0, 2)],
         said=("inference rank 1 failed to load version 1: the engine failed part-way",),
         record={1: {"load_failed": [1]}}),
    Case("a load that fails part-way with onLoadFailure failJob fails the job",
         Spec(on_load_failure="failJob"), (Act(INFERENCE, 1, 1, LOAD_FAILS),),
         FAILED, reasons.LOAD_FAILED, "inference rank 1 failed: LoadFailed: the engine failed part-way", [(0, 0, 2)]),
    Case("a trainer that closes while another goes on: the trainers disagree", Spec(trainers=2),
         (Act(TRAINER, 1, 1, CLOSES),),
         FAILED, reasons.TRAINERS_DISAGREE, "trainer rank 1 closed after version 0, but trainer rank 0 is ready for "
                                            "version 1", [(0, 0, 2)]),
    Case("trainers that close before any version", Spec(versions=0), (),
         FAILED, reasons.NO_VERSIONS, "every trainer rank closed without publishing a version", []),
    Case("a controller that starts again cannot resume the rendezvous", Spec(starts=2), (),
         FAILED, reasons.CONTROLLER_RESTARTED, "the controller started again (start 2)", []),
]


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_the_controller_decides(case: Case, tmp_path):
    got = Scene(case.spec, case.acts, tmp_path).run()
    completion = got.completion
    assert (got.code, completion["state"], completion.get("reason")) == \
        (0 if case.state == SUCCEEDED else 1, case.state, case.reason), completion
    assert case.message in completion["message"], completion["message"]
    assert got.transfers() == case.rounds, got.said[-8:]
    for part in case.said:
        assert any(part in line for line in got.said), (part, got.said)
    assert got.status.get("rejoins") == case.rejoins
    for version, fields in case.record.items():
        record = next(r for r in got.records if r["event"] == "transfer" and r["version"] == version)
        assert fields.items() <= record.items(), record
    if case.rounds:  # status.transfer: the last round's record
        assert got.status["transfer"]["version"] == case.rounds[-1][0]


def test_a_host_laid_out_for_another_job_is_refused_at_once():
    job = job_of(Spec())
    host = make_host(Layout(trainers=1, trainer_procs=1, inferences=1, inference_procs=1), job.identity, [],
                     silent_limit=3.0, away_limit=1.0)
    try:
        with pytest.raises(ValueError, match="laid out for .*inferences=1.*not for the job's .*inferences=2"):
            Controller(context(job, host.store.port), Reporter(job, False), host=host)
        assert not host.has(Keys.JOB), "the refused controller published the job"
    finally:
        host.store.close()


def test_the_controllers_context_takes_few_steps_between_modules(tmp_path):
    """The context given to the controller, followed through its construction and its run while
    every rank does its part: at most 20 steps between modules, none back up a layer."""
    path = Traced()
    got = Scene(CASES[0].spec, (), tmp_path, traced=path).run()
    assert got.code == 0
    assert path.steps and len(path.steps) <= 20 and not path.up, str(path)
    print(path)
