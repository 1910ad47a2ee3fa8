"""Why the controller says a job failed: every failure carries its reason, the one the Failed
condition shows, and an error that is no failure of the job's (a bug) is reported as a bug, never
as the user's mistake."""

import urllib.error

import pytest
import torch

from weightsync.job import reasons
from weightsync.job.errors import JobFailed, TimedOut, failure_of
from weightsync.model.flat import LayoutMismatch
from weightsync.rendezvous.join_phase import RankFailed, TrainersRestart
from weightsync.rendezvous.messages import RankFailure
from weightsync.rendezvous.protocol import ProofError
from weightsync.rendezvous.store.table import StoreError, StoreFull, StoreRefused, StoreTimeout
from weightsync.runtime.inbound import VerificationError
from weightsync.transport.base import ChecksumMismatch, TransferError


@pytest.mark.parametrize("error, reason", [
    (RankFailed("trainer rank 1 failed: boom"), reasons.RANK_FAILED),
    (RankFailed("trainer rank 1 is silent", reasons.TRAINER_STOPPED), reasons.TRAINER_STOPPED),
    (TrainersRestart("trainer rank 0 restarted"), reasons.TRAINER_STOPPED),
    (ProofError("inference rank 2 failed the job token proof"), reasons.TOKEN_PROOF_FAILED),
    (LayoutMismatch("dtype differs"), reasons.RANKS_DISAGREE),
    (StoreFull("the store holds its limit of keys"), reasons.STORE_FULL),
    (StoreTimeout("keys not set within 5s"), reasons.TIMED_OUT),
    (StoreRefused("its token differs"), reasons.TOKEN_PROOF_FAILED),
    (TimedOut("2 ranks did not join within 60s"), reasons.TIMED_OUT),
    (JobFailed("every trainer rank closed without publishing a version", reasons.NO_VERSIONS), reasons.NO_VERSIONS),
])
def test_a_failure_of_the_job_carries_its_reason_and_its_message(error, reason):
    assert failure_of(error) == (reason, str(error))


@pytest.mark.parametrize("error", [ValueError("invalid literal for int() with base 10: 'x'"),
                                   StoreError("a timeout of nan seconds is no number of seconds"),
                                   KeyError("meta")])
def test_an_error_that_is_no_failure_of_the_job_is_reported_as_a_bug_naming_its_type(error):
    reason, message = failure_of(error)
    assert reason == reasons.CONTROLLER_ERROR != reasons.RANKS_DISAGREE
    assert message.startswith(f"{type(error).__name__}: ") and "a bug in weightsync" in message


def test_a_timeout_of_the_standard_library_is_a_timeout():
    assert failure_of(TimeoutError("could not connect"))[0] == reasons.TIMED_OUT


def test_failures_stay_what_their_callers_catch():
    assert isinstance(LayoutMismatch("x"), ValueError)
    assert isinstance(StoreTimeout("x"), TimeoutError) and isinstance(StoreTimeout("x"), StoreError)
    assert isinstance(StoreFull("x"), StoreError) and isinstance(RankFailed("x"), RuntimeError)
    assert isinstance(ProofError("x"), RuntimeError) and isinstance(TimedOut("x"), TimeoutError)


@pytest.mark.parametrize("error", [KeyError("meta"), AttributeError("'NoneType' object has no attribute 'version'")])
def test_an_error_the_controller_does_not_expect_ends_the_job_as_a_bug_not_as_a_restart(monkeypatch, error):
    """Controller.run ends the job through fail() (ControllerError, its traceback in the log) for
    any exception of its steps, where one that escaped would restart the controller's pod."""
    from types import SimpleNamespace

    from support.cli import EXAMPLE

    from weightsync.job import load_job
    from weightsync.roles.controller import driver

    controller = object.__new__(driver.Controller)
    controller.ctx = SimpleNamespace(job=load_job(EXAMPLE), pod_ip="127.0.0.1", store_port=0)
    controller.host, controller.external, controller.scale, controller.admissions = SimpleNamespace(running=1), {}, None, None
    ended = []
    monkeypatch.setattr(driver.Controller, "say", lambda self, message: None)
    monkeypatch.setattr(driver.Controller, "fail", lambda self, e: ended.append(failure_of(e)) or 1)

    def versions(self):
        raise error

    monkeypatch.setattr(driver.Controller, "versions", versions)
    assert controller.run(1, {}) == 1
    assert [reason for reason, _ in ended] == [reasons.CONTROLLER_ERROR], ended


@pytest.mark.parametrize("error, reason", [
    (ChecksumMismatch("trainer rank 0", "bucket 3 of version 2: checksum mismatch"), reasons.CHECKSUM_MISMATCH),
    (VerificationError("version 2 failed verification"), reasons.VERIFICATION_FAILED),
    (TransferError("trainer rank 1", "connection reset part-way"), reasons.TRANSPORT_ERROR),
    (MemoryError("cannot allocate 4 GiB"), reasons.OUT_OF_MEMORY),
    (torch.OutOfMemoryError("CUDA out of memory"), reasons.OUT_OF_MEMORY),
    (TimeoutError("no answer within 30s"), reasons.TIMED_OUT),
    (RankFailed("trainer rank 1 is silent", reasons.TRAINER_STOPPED), reasons.TRAINER_STOPPED),
    (urllib.error.URLError("refused"), reasons.RANK_FAILED),  # a reason of another kind: not the job's
    (ValueError("a bug"), reasons.RANK_FAILED),
])
def test_a_ranks_failure_travels_as_a_record_with_the_reason_its_error_gives(error, reason):
    failure = RankFailure.made(error)
    assert failure == RankFailure(reason, f"{type(error).__name__}: {error}")
    assert RankFailure.from_json(failure.to_json()) == failure
    assert RankFailure.made("the trainer command exited") == RankFailure(reasons.RANK_FAILED, "the trainer command exited")
