"""An external rank's way in (rendezvous/external_rank.py) against a real controller's store in this
process: it reads the job the controller published, signed, and builds its context from it; a
wrong token, a wrong job id, a controller that is not there, a forged job, a role the job's own
pods hold and a rank outside the job are each refused with one line that says what to fix; a
second process claiming an external trainer's rank is refused while the job goes on."""

import json
import socket

import pytest

from weightsync.job import API_VERSION, KIND, Join, external_roles, join_env, load_job
from weightsync.rendezvous.external_rank import JoinError, fetch_job, joined_context
from weightsync.rendezvous.messages import RankInfo, Text
from weightsync.rendezvous.policy import Policy
from weightsync.rendezvous.protocol import Keys, Member, Restarted
from weightsync.rendezvous.roster import Host, RankFailed

TOKEN = b"0123456789abcdef-job-token"


def make_job(external=True, name="joined"):
    return load_job({"apiVersion": API_VERSION, "kind": KIND,
                              "metadata": {"name": name, "namespace": "team"},
                              "spec": {"model": {"config": {"model_type": "gpt2", "n_layer": 2}},
                                       "trainer": {"external": external, "replicas": 2},
                                       "transfer": {"timeoutSeconds": 42}}})


def serve(job, say=lambda m: None):
    host = Host(0, TOKEN, job.layout, Policy(silent_limit=2, away_limit=60, external=frozenset(external_roles(job))),
                say=say, address="127.0.0.1", job=job.identity)
    host.publish_job(job, "rdma")
    return host


@pytest.fixture()
def host():
    host = serve(make_job())
    yield host
    host.store.close()


def join_of(host, job=None, token=TOKEN, **env):
    return Join.from_environ({**join_env(job or make_job(), "127.0.0.1", host.store.port, token), **env})


def test_a_joiner_reads_the_job_the_controller_published(host):
    job, channel = fetch_job(join_of(host), timeout=10)
    assert job == make_job() and job.transfer.timeout_seconds == 42 and job.trainer.external
    assert channel.has(Keys.JOB_MAC)
    ctx, _ = joined_context(join_of(host), "trainer", 1, timeout=10)
    assert (ctx.job, ctx.role, ctx.ordinal, ctx.network_mode, ctx.pod_ip) == (job, "trainer", 2, "rdma", "127.0.0.1")
    assert ctx.token == TOKEN and ctx.store_port == host.store.port


def test_a_wrong_token_or_job_id_is_refused_in_one_line(host):
    for join in (join_of(host, token=b"another-job's-token-entirely"), join_of(host, job=make_job(name="other"))):
        with pytest.raises(JoinError) as err:
            fetch_job(join, timeout=10)
        assert str(err.value) == (f"the controller at 127.0.0.1:{host.store.port} refused this process: the job token "
                                  f"in WEIGHTSYNC_TOKEN is not job {join.job_id}'s (or that controller runs another job "
                                  "than WEIGHTSYNC_JOB_ID names)")


def test_a_controller_that_is_not_there_is_waited_for_then_named():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens there once it closes
    join = Join.from_environ(join_env(make_job(), "127.0.0.1", port, TOKEN))
    said = []
    with pytest.raises(JoinError) as err:
        fetch_job(join, timeout=1, say=said.append)
    assert str(err.value).startswith(f"waited 1s for the controller of job team/joined to accept connections at "
                                     f"127.0.0.1:{port} (WEIGHTSYNC_CONTROLLER); is the job running")
    assert said == [f"waiting (up to 1s) for the controller of job team/joined at 127.0.0.1:{port}"]


def test_a_job_not_signed_with_the_token_is_refused(host):
    host.set(Keys.JOB, Text(json.dumps(make_job(name="forged").to_object())))
    with pytest.raises(JoinError, match="the job published at .* is not signed with the token in WEIGHTSYNC_TOKEN"):
        fetch_job(join_of(host), timeout=10)


def test_a_rank_the_jobs_own_pods_hold_or_outside_the_job_is_refused():
    host = serve(make_job(external=False))
    try:
        with pytest.raises(JoinError) as err:
            joined_context(join_of(host), "trainer", 0, timeout=10)
        assert str(err.value) == ("job team/joined's trainers are not external (spec.trainer.external is false): its own "
                                  "pods hold every trainer rank; set spec.trainer.external: true to start them yourself")
    finally:
        host.store.close()
    host = serve(make_job())
    try:
        with pytest.raises(JoinError, match=r"trainer rank 2 is not one of job team/joined's 2 trainer ranks"):
            joined_context(join_of(host), "trainer", 2, timeout=10)
    finally:
        host.store.close()


def test_a_second_process_claiming_a_live_external_trainers_rank_is_refused_and_the_job_goes_on():
    """Before the holder proved the token (it still builds its model): the holder is the one admitted."""
    for external in (True, False):
        job = make_job(external=external)
        said = []
        host = serve(job, said.append)
        try:
            first = Member("127.0.0.1", host.store.port, TOKEN, "trainer", 0, timeout=10, job=job.identity)
            assert first.arrive() == 1
            first.start_heartbeat()
            second = Member("127.0.0.1", host.store.port, TOKEN, "trainer", 0, timeout=10, job=job.identity)
            with pytest.raises(Restarted, match="trainer rank 0 restarted after it had joined the job"):
                second.arrive()
            if external:
                host.check_ranks()
                assert said == ["a second process claimed trainer rank 0 (start 2) while the one that holds it is "
                                "alive; it was refused, and the job goes on"]
                assert first.join("127.0.0.1", "{}", RankInfo("tcp"), timeout=10) == 1
                admitted = host.proven("trainer", 0, host.attempt("trainer", 0))
                assert admitted is not None and admitted.endpoint == "127.0.0.1"
                host.check_ranks()  # the refused start is not seen again
                assert len(said) == 1
            else:  # the job's own trainer pod started again: its rank is gone
                with pytest.raises(RankFailed, match="trainer rank 0 restarted"):
                    host.check_ranks()
            first.stop_heartbeat()
        finally:
            host.store.close()
