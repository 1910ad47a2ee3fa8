"""Why the controller says a job failed: every failure carries its reason, the one the Failed
condition shows, and an error that is no failure of the job's (a bug) is reported as a bug, never
as the user's mistake."""

import pytest

from weightsync.job import reasons
from weightsync.job.errors import JobFailed, TimedOut, failure_of
from weightsync.model.flat import LayoutMismatch
from weightsync.rendezvous.join_phase import RankFailed, TrainersRestart
from weightsync.rendezvous.protocol import ProofError
from weightsync.rendezvous.store.table import StoreError, StoreFull, StoreRefused, StoreTimeout


@pytest.mark.parametrize("error, reason", [
    (RankFailed("trainer rank 1 failed: boom"), reasons.RANK_FAILED),
    (RankFailed("trainer rank 1 is silent", reasons.RANK_SILENT), reasons.RANK_SILENT),
    (TrainersRestart("trainer rank 0 restarted"), reasons.TRAINER_RESTARTED),
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
