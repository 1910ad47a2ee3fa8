"""The rendezvous protocol through the controller's store, in one process: token proofs, the
signed plan, restarts, failures and silent ranks, and the version schedule."""
import json
import threading

import pytest

from weightsync import rendezvous
from weightsync.contract import Layout
from weightsync.rendezvous import Host, JobEnded, Member, ProofError, RankFailed, Restarted

TOKEN = b"0123456789abcdef-job-token"
LAYOUT = Layout(trainers=1, trainer_procs=1, inferences=1, inference_procs=1)


@pytest.fixture()
def host():
    return Host(0, TOKEN, LAYOUT, silent_limit=1.5)


def member(host, role="trainer", rank=0, token=TOKEN):
    return Member("127.0.0.1", host.store.port, token, role, rank, timeout=10)


def join_all(host, tokens=None):
    tokens = tokens or {}
    for role in ("trainer", "inference"):
        m = member(host, role, 0, tokens.get(role, TOKEN))
        m.join(f"127.0.0.1:{1000 + len(role)}", '{"layout": 1}', json.dumps({"transport": "tcp"}), timeout=10)


def test_versions_schedule():
    def spec(steps, every):
        return {"training": {"steps": steps}, "transfer": {"everySteps": every}}

    assert list(rendezvous.versions(spec(20, 10))) == [(0, 0), (1, 10), (2, 20)]
    assert list(rendezvous.versions(spec(25, 10))) == [(0, 0), (1, 10), (2, 20), (3, 25)]
    assert list(rendezvous.versions(spec(5, 10))) == [(0, 0), (1, 5)]
    endless = rendezvous.versions(spec(0, 7))
    assert [next(endless) for _ in range(4)] == [(0, 0), (1, 7), (2, 14), (3, 21)]


def test_ranks_that_prove_the_token_are_admitted_with_what_they_published(host):
    join_all(host)
    admitted = host.admit(timeout=5)
    assert admitted[("trainer", 0)] == ("127.0.0.1:1007", '{"layout": 1}', {"transport": "tcp"})
    assert admitted[("inference", 0)][0] == "127.0.0.1:1009"


def test_a_rank_with_another_token_is_refused_naming_it(host):
    join_all(host, {"inference": b"another-token-of-16-bytes"})
    with pytest.raises(ProofError, match="inference rank 0 failed the job token proof"):
        host.admit(timeout=5)


def test_a_forged_proof_for_changed_data_is_refused(host):
    join_all(host)
    host.set("endpoint/trainer/0", "10.0.0.66:1")  # someone rewrote the endpoint after the proof
    with pytest.raises(ProofError, match="trainer rank 0"):
        host.admit(timeout=5)


def test_members_accept_only_a_plan_signed_with_the_token(host):
    from weightsync.flat import FlatLayout
    from weightsync.plan import make_plan

    plan = make_plan(FlatLayout.from_shapes([("w", (10, 10))], "float32"), 1, 1, 1 << 20)
    host.publish_plan(plan.to_json(), {0: "127.0.0.1:5"})
    got, endpoints = member(host).plan(timeout=5)
    assert got == plan and endpoints == {0: "127.0.0.1:5"}
    with pytest.raises(ProofError, match="not signed with this job's token"):
        member(host, token=b"a-different-token-16b").plan(timeout=5)


def test_a_restarted_rank_is_told_so(host):
    join_all(host)
    with pytest.raises(Restarted, match="trainer rank 0 restarted"):
        member(host).join("x:1", "{}", "{}", timeout=5)


def test_a_reported_failure_fails_the_wait_naming_the_rank(host):
    join_all(host)
    host.admit(timeout=5)
    member(host, "inference", 0).fail("the GPU fell off the bus")
    with pytest.raises(RankFailed, match="inference rank 0 failed: the GPU fell off the bus"):
        host.wait_ranks(["ready/0/0"], "the trainers", timeout=10)


def test_a_rank_whose_heartbeat_stops_is_named(host):
    m = member(host, "trainer", 0)
    m.start_heartbeat()
    host.check_ranks()  # seen alive
    m.stop_heartbeat()
    with pytest.raises(RankFailed, match="trainer rank 0 is silent"):
        host.wait_ranks(["never"], "nothing", timeout=20)


def test_members_waiting_learn_of_the_end(host):
    m = member(host)
    errors = []

    def wait():
        try:
            m.wait_for("go/0", "go", timeout=20)
        except JobEnded as e:
            errors.append(e)

    t = threading.Thread(target=wait)
    t.start()
    host.end("Failed", "inference rank 1 failed: boom")
    t.join(10)
    assert errors and errors[0].state == "Failed" and "inference rank 1 failed: boom" in str(errors[0])


def test_waiting_times_out_naming_what_it_waited_for(host):
    with pytest.raises(TimeoutError, match=r"the trainers to send version 3 \(sent/3/0 not set\)"):
        host.wait_ranks(["sent/3/0"], "the trainers to send version 3", timeout=0.3)
