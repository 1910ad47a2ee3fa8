"""What a vLLM server the user started needs to join a job by itself (vllm_backend.joining, which
the plugin's entry point checks before vLLM loads the model): the join variables and its own URL,
each missing or malformed one refused with one line naming the variable."""

import pytest

from weightsync.job import SpecError
from weightsync.vllm_backend import joining

JOIN = {"WEIGHTSYNC_CONTROLLER": "127.0.0.1:29500", "WEIGHTSYNC_JOB_ID": "team/servers",
        "WEIGHTSYNC_TOKEN": "0123456789abcdef0123456789abcdef"}


def test_a_pods_server_does_not_join_by_itself():
    assert joining({"WEIGHTSYNC_VLLM_SERVER": "http://10.0.0.5:8000"}) is None


def test_a_server_with_the_join_variables_joins_under_its_own_url():
    join, url = joining({**JOIN, "WEIGHTSYNC_VLLM_SERVER": "http://10.0.0.5:8000/"})
    assert url == "http://10.0.0.5:8000" and join.job_id == "team/servers" and join.store_port == 29500


def test_without_its_url_a_server_is_told_to_set_it():
    with pytest.raises(SpecError) as e:
        joining(JOIN)
    assert e.value.problems == ["WEIGHTSYNC_VLLM_SERVER is not set: a vLLM server that joins job team/servers needs its "
                                "own URL as the controller reaches it, for example http://10.0.0.5:8000 (this "
                                "machine's address and the server's --port)"]


@pytest.mark.parametrize("url", ["10.0.0.5:8000", "ftp://10.0.0.5:8000", "http://"])
def test_a_malformed_url_is_refused(url):
    with pytest.raises(SpecError, match="WEIGHTSYNC_VLLM_SERVER=.*expected this server's URL"):
        joining({**JOIN, "WEIGHTSYNC_VLLM_SERVER": url})


def test_an_incomplete_join_is_refused_naming_the_variable():
    with pytest.raises(SpecError, match="WEIGHTSYNC_TOKEN"):
        joining({k: v for k, v in JOIN.items() if k != "WEIGHTSYNC_TOKEN"} | {"WEIGHTSYNC_VLLM_SERVER": "http://a:1"})
