"""The reasons a job's status and Events give: each declared once, with what it means, in the form
Kubernetes and the CRD take."""
import re

import pytest

from weightsync.job import VERSION, reasons
from weightsync.job.schema import openapi_schema

# A condition's reason, as the Kubernetes API conventions define it.
CONDITION_REASON = r"^[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?$"


def test_every_reason_is_a_camel_case_word_with_a_description():
    assert reasons.DESCRIPTIONS
    for name, description in reasons.DESCRIPTIONS.items():
        assert re.match(CONDITION_REASON, name) and name[0].isupper(), name
        assert description and description == reasons.describe(name)


def test_the_controllers_reasons_fit_the_status_schema():
    pattern = openapi_schema(VERSION)["properties"]["status"]["properties"]["completion"]["properties"]["reason"]["pattern"]
    for name in (reasons.RANK_FAILED, reasons.RANK_LOST, reasons.TRAINER_STOPPED, reasons.CONTROLLER_RESTARTED,
                 reasons.VERIFICATION_FAILED, reasons.TIMED_OUT, reasons.TOKEN_PROOF_FAILED, reasons.NO_VERSIONS,
                 reasons.CONTROLLER_ERROR):
        assert re.match(pattern, name), name


def test_the_reasons_that_fail_a_job_at_once_are_declared_and_an_unknown_reason_is_not_described():
    assert all(reason in reasons.DESCRIPTIONS for reason in reasons.PERMANENT)
    with pytest.raises(KeyError):
        reasons.describe("SomethingElse")
