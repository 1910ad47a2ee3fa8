"""The rendezvous protocol through the controller's store, in one process: token proofs, the
signed plan and endpoints, restarts and rejoins, failures, silent ranks and who is blamed, and the
version schedule."""
import dataclasses
import json
import socket
import threading
import time

import pytest

from weightsync.job import API_VERSION, KIND, Layout, load_job, reasons
from weightsync.job.errors import JobFailed
from weightsync.rendezvous import protocol as rendezvous
from weightsync.rendezvous.messages import (
    Admission,
    Applied,
    Done,
    Mark,
    Peer,
    RankInfo,
    Ready,
    Reference,
    Round,
    SentReport,
    Text,
)
from weightsync.rendezvous.policy import Policy
from weightsync.rendezvous.protocol import JobEnded, Keys, Member, ProofError, Restarted
from weightsync.rendezvous.roster import AWAY, DROPPED, JOINING, SERVING, WAITING, Host, RankFailed
from weightsync.transport.base import ChecksumMismatch

TOKEN = b"0123456789abcdef-job-token"
JOB = "default/rendezvous"
LAYOUT = Layout(trainers=1, trainer_procs=1, inferences=1, inference_procs=1)
TWO = Layout(trainers=2, trainer_procs=1, inferences=2, inference_procs=1)


def make_host(layout=LAYOUT, silent_limit=1.5, away_limit=60.0, min_available=None, say=lambda m: None):
    return Host(0, TOKEN, layout, Policy(silent_limit=silent_limit, away_limit=away_limit, min_available=min_available),
                say=say, address="127.0.0.1", job=JOB)


@pytest.fixture()
def host():
    host = make_host()
    yield host
    host.store.close()


def member(host, role="trainer", rank=0, token=TOKEN):
    return Member("127.0.0.1", host.store.port, token, role, rank, timeout=10, job=JOB)


def join(host, role, rank, endpoint=None, token=TOKEN):
    m = member(host, role, rank, token)
    m.join(endpoint or f"127.0.0.1:{1000 + 10 * len(role) + rank}", '{"layout": 1}', RankInfo("tcp", pod=f"p{rank}"),
           timeout=10)
    return m


def join_all(host, tokens=None, layout=LAYOUT):
    tokens = tokens or {}
    return {(role, r): join(host, role, r, token=tokens.get(role, TOKEN))
            for role in ("trainer", "inference") for r in range(layout.world_size(role))}


def started(layout=TWO, **kwargs):
    """A host with every rank admitted and the plan published."""
    host = make_host(layout, **kwargs)
    members = join_all(host, layout=layout)
    admitted = host.admit(timeout=5)
    host.publish_plan("{}", {r: admitted[("inference", r)].endpoint for r in range(layout.world_size("inference"))})
    return host, members


def test_versions_schedule():
    def spec(steps, every):
        return load_job({"apiVersion": API_VERSION, "kind": KIND, "metadata": {"name": "v"},
                         "spec": {"model": {"config": {"model_type": "gpt2"}}, "training": {"steps": steps},
                                  "transfer": {"everySteps": every}}})

    assert list(rendezvous.versions(spec(20, 10))) == [(0, 0), (1, 10), (2, 20)]
    assert list(rendezvous.versions(spec(25, 10))) == [(0, 0), (1, 10), (2, 20), (3, 25)]
    assert list(rendezvous.versions(spec(5, 10))) == [(0, 0), (1, 5)]
    endless = rendezvous.versions(spec(0, 7))
    assert [next(endless) for _ in range(4)] == [(0, 0), (1, 7), (2, 14), (3, 21)]


def test_ranks_that_prove_the_token_are_admitted_with_what_they_published(host):
    join_all(host)
    admitted = host.admit(timeout=5)
    assert admitted[("trainer", 0)] == Admission("127.0.0.1:1070", '{"layout": 1}', RankInfo("tcp", pod="p0"))
    assert admitted[("inference", 0)].endpoint == "127.0.0.1:1090"


def test_a_rank_with_another_token_is_refused_naming_it(host):
    with pytest.raises(ProofError, match="inference rank 0 failed the job token proof: .* refused this client's proof"):
        member(host, "inference", 0, b"another-token-of-16-bytes")


def test_a_forged_proof_for_changed_data_is_refused(host):
    join_all(host)
    host.set(Keys.published("endpoint", "trainer", 0, 1), Text("10.0.0.66:1"))  # rewritten after the proof
    with pytest.raises(ProofError, match="trainer rank 0"):
        host.admit(timeout=5)


def test_members_accept_only_a_plan_and_endpoints_signed_with_the_token(host):
    from weightsync.model.flat import FlatLayout
    from weightsync.plan.segments import make_plan

    plan = make_plan(FlatLayout.from_shapes([("w", (10, 10))], "float32"), 1, 1, 1 << 20)
    host.publish_plan(plan.to_json(), {0: "127.0.0.1:5"})
    got, endpoints = member(host).plan(timeout=5)
    assert got == plan and endpoints == {0: "127.0.0.1:5"}
    host.set(Keys.PLAN, Text(host.get(Keys.PLAN).decode() + " "))  # the plan rewritten after it was signed
    with pytest.raises(ProofError, match="not signed with this job's token"):
        member(host).plan(timeout=5)
    host.set(Keys.peers(0), Text(json.dumps({"0": {"endpoint": "10.0.0.66:1", "attempt": 1}})))  # rewritten after it was signed
    with pytest.raises(ProofError, match="endpoints of epoch 0 are not signed"):
        member(host).peers(0, timeout=5)


def test_a_restarted_trainer_is_told_so_and_fails_the_job_naming_it():
    host, _ = started()
    with pytest.raises(Restarted, match="trainer rank 1 restarted"):
        member(host, "trainer", 1).join("x:1", "{}", RankInfo("tcp"), timeout=5)
    with pytest.raises(RankFailed, match="trainer rank 1 restarted") as failed:
        host.wait_ranks(["never"], "nothing", timeout=10)
    assert failed.value.reason == reasons.TRAINER_STOPPED


def test_a_restarted_inference_rank_is_away_then_taken_back_at_the_next_round_at_its_new_endpoint():
    host, members = started()
    assert host.start_round(0).receivers == (0, 1)
    again = member(host, "inference", 1)
    ready = threading.Event()

    def rejoin():
        assert again.join("127.0.0.1:7777", '{"layout": 1}', RankInfo("tcp", pod="p1"), timeout=10) == 2
        ready.set()

    t = threading.Thread(target=rejoin)
    t.start()
    deadline = time.monotonic() + 10
    while not ready.is_set() and time.monotonic() < deadline:  # the controller issues its challenge while it watches
        host.check_ranks()
        time.sleep(0.05)
    t.join(5)
    assert ready.is_set()
    assert host.seats[1].state in (JOINING, WAITING)
    while host.seats[1].state != WAITING and time.monotonic() < deadline:
        host.check_ranks()
        time.sleep(0.05)
    assert host.seats[1].state == WAITING and host.seats[1].rejoins == 1
    rnd = host.start_round(1)
    assert rnd == Round(1, 0, (0, 1), 1)
    assert again.welcome() == rnd and host.seats[1].state == SERVING
    assert members[("trainer", 0)].peers(1, timeout=5) == {0: Peer("127.0.0.1:1090", 1), 1: Peer("127.0.0.1:7777", 2)}
    assert members[("trainer", 0)].round(1) == rnd


def test_a_rejoining_rank_must_prove_the_token_over_its_new_challenge():
    host, _ = started()
    # without the token a process cannot even reach the store
    with pytest.raises(ProofError, match="inference rank 0 failed the job token proof: .* refused this client's proof"):
        member(host, "inference", 0, token=b"another-token-of-16-bytes")
    # a second start that publishes the first start's proof is refused
    replay = member(host, "inference", 0)
    first = {what: host.get(Keys.published(what, "inference", 0, 1)) for what in ("endpoint", "meta", "info", "proof")}
    assert replay.store.add(Keys.join("inference", 0), 1) == 2
    for what, value in first.items():
        replay.set(Keys.published(what, "inference", 0, 2), Text(value.decode()))
    with pytest.raises(ProofError, match="inference rank 0 failed the job token proof"):
        host.wait_ranks(["never"], "nothing", timeout=10)


def test_receivers_a_trainer_lost_are_away_and_not_in_the_next_round():
    host, _ = started()
    rnd = host.start_round(0)
    for t in range(2):
        host.set(Keys.sent(0, 0, t), SentReport(0, 0.0, lost={1: "connection reset"} if t == 1 else {}))
    host.collect_sent(rnd, timeout=5)
    assert host.seats[1].state == AWAY
    host.set(Keys.applied(0, 0, 1), Applied("d"))
    assert host.collect_applied(rnd, timeout=5) == {0: Applied("d")}  # the round goes on without it
    assert host.start_round(1).receivers == (0,)


def test_the_final_version_sent_again_goes_only_to_the_ranks_that_do_not_hold_it():
    host, _ = started()
    host.start_round(2)
    host.holding(2, [0, 1])
    host.seats[1].holds, host.seats[1].state = None, WAITING  # came back after the final version
    assert host.behind(2) == [1]
    assert host.start_round(2, again=1).receivers == (1,)


def test_an_inference_rank_away_for_too_long_fails_the_job():
    host, _ = started(away_limit=0.5)
    host._away(1, "gone")
    with pytest.raises(RankFailed, match="inference rank 1 did not come back within 0s") as failed:
        host.wait_ranks(["never"], "nothing", timeout=10)
    assert failed.value.reason == reasons.RANK_LOST


def test_an_inference_rank_away_past_its_grace_is_dropped_while_enough_remain_and_taken_back_if_it_returns():
    said = []
    host, _ = started(away_limit=0.3, min_available=1, say=said.append)
    host.start_round(0)
    host.holding(0, [0, 1])
    host._away(1, "gone")
    deadline = time.monotonic() + 10
    while host.seats[1].state != DROPPED and time.monotonic() < deadline:
        host.check_ranks()
        time.sleep(0.05)
    assert host.seats[1].state == DROPPED
    assert any("inference rank 1 dropped: away for more than 0s; the job goes on with 1 inference ranks (it needs 1, "
               "spec.inference.minAvailable)" in line for line in said), said
    assert host.start_round(1).receivers == (0,)
    host.holding(1, [0])
    assert host.behind(1) == []  # the end does not wait for it
    host.wait_back(1)  # returns at once: nothing is waited for
    host._away(0, "gone too")  # the last one: past its grace the job needs it
    with pytest.raises(RankFailed, match="the job needs 1 inference ranks .* with 0 left") as failed:
        while time.monotonic() < deadline:
            host.check_ranks()
            time.sleep(0.05)
    assert failed.value.reason == reasons.RANK_LOST

    # a dropped rank whose process starts again rejoins (a new grace to join in)
    host, _ = started(away_limit=0.3, min_available=1)
    host._away(1, "gone")
    while host.seats[1].state != DROPPED and time.monotonic() < deadline:
        host.check_ranks()
        time.sleep(0.05)
    time.sleep(0.4)  # longer than the grace since it was dropped
    again = member(host, "inference", 1)
    joined = threading.Thread(target=again.join, args=("127.0.0.1:7777", '{"layout": 1}', RankInfo("tcp", pod="p1")),
                              kwargs={"timeout": 10})
    joined.start()
    while host.seats[1].state != WAITING and time.monotonic() < deadline:
        host.check_ranks()
        time.sleep(0.02)
    joined.join(5)
    assert host.seats[1].state == WAITING and host.start_round(1).receivers == (0, 1)


def test_a_start_slower_to_join_than_the_grace_is_dropped_and_taken_back_once_it_joins():
    said = []
    host, _ = started(away_limit=0.3, min_available=1, say=said.append)
    again = member(host, "inference", 1)
    again.arrive()  # its process started again: it builds its model, longer than the grace
    deadline = time.monotonic() + 10
    while host.seats[1].state != DROPPED and time.monotonic() < deadline:
        host.check_ranks()
        time.sleep(0.05)
    assert host.seats[1].state == DROPPED
    assert any("takes it back once its start joins, or if its process starts again" in line for line in said), said
    assert host.start_round(1).receivers == (0,)  # not waited for meanwhile
    again.join("127.0.0.1:7777", '{"layout": 1}', RankInfo("tcp", pod="p1"), timeout=10)
    while host.seats[1].state != WAITING and time.monotonic() < deadline:
        host.check_ranks()
        time.sleep(0.02)
    assert host.seats[1].state == WAITING and host.start_round(2).receivers == (0, 1)
    assert any("inference rank 1 rejoined (start 2" in line for line in said), said


def test_a_silent_inference_rank_is_away_a_silent_trainer_fails_the_job():
    host, members = started(silent_limit=1.0)
    for m in members.values():
        m.start_heartbeat()
    host.check_ranks()
    members[("inference", 1)].stop_heartbeat()
    deadline = time.monotonic() + 15
    while host.seats[1].state != AWAY and time.monotonic() < deadline:
        host.check_ranks()
        time.sleep(0.1)
    assert host.seats[1].state == AWAY
    members[("trainer", 0)].stop_heartbeat()
    with pytest.raises(RankFailed, match="trainer rank 0 is silent"):
        host.wait_ranks(["never"], "nothing", timeout=20)
    for m in members.values():
        m.stop_heartbeat()


@pytest.mark.parametrize("how", ["froze", "started again"])
def test_the_rank_that_stopped_first_is_blamed_not_the_survivor_that_reported(how):
    host, members = started()
    for m in members.values():
        m.start_heartbeat()
    host.check_ranks()
    members[("trainer", 1)].stop_heartbeat()  # trainer 1 stopped; trainer 0 saw its peer vanish
    if how == "started again":  # its pod started it again; the new process refuses itself (trainers do not rejoin)
        with pytest.raises(Restarted):
            member(host, "trainer", 1).arrive()
    members[("trainer", 0)].fail("gloo: Connection closed by peer")
    said = "its process started again" if how == "started again" else "no heartbeat for 4s: its process died or froze"
    with pytest.raises(RankFailed, match=rf"trainer rank 1 stopped first \({said}\); then trainer rank 0 "
                                         r"failed: gloo: Connection closed by peer") as e:
        host.wait_ranks(["never"], "nothing", timeout=20)
    assert e.value.reason == reasons.TRAINER_STOPPED  # as the watch names a trainer's stop, however noticed
    for m in members.values():
        m.stop_heartbeat()


def test_a_reported_failure_with_every_rank_alive_is_blamed_on_the_reporter(host):
    members = join_all(host)
    host.admit(timeout=5)
    for m in members.values():
        m.start_heartbeat()
    members[("inference", 0)].fail("the GPU fell off the bus")
    with pytest.raises(RankFailed, match="^inference rank 0 failed: the GPU fell off the bus"):
        host.wait_ranks(["ready/0/0"], "the trainers", timeout=20)
    for m in members.values():
        m.stop_heartbeat()


def test_a_heartbeat_that_failed_once_goes_on_with_a_new_client():
    """One call that fails (a busy store, a reset connection) must not silence a rank that lives:
    the rank would be counted away for good, and end itself when the next version comes."""
    host, members = started()
    rank = members[("inference", 0)]
    rank.start_heartbeat()
    first = rank.beating
    first.store._sock.shutdown(socket.SHUT_RDWR)  # the heartbeat's connection, reset
    before = host.store.add(Keys.beat("inference", 0), 0)
    deadline = time.monotonic() + 20
    while (rank.beating is first or host.store.add(Keys.beat("inference", 0), 0) <= before + 1) \
            and time.monotonic() < deadline:
        time.sleep(0.1)
    assert rank.beating is not first and host.store.add(Keys.beat("inference", 0), 0) > before + 1
    rank.stop_heartbeat()


def test_a_checksum_mismatch_is_the_reporters_own_failure_counted_as_a_failed_verification():
    """Bytes changed on the way are no other rank's doing: not blamed on a rank that went quiet
    as it failed of the same version a moment later, and counted in the job's summary."""
    host, members = started()
    for m in members.values():
        m.start_heartbeat()
    host.check_ranks()
    members[("inference", 1)].stop_heartbeat()  # it fails of the same corruption, 18 ms later
    members[("inference", 0)].fail(ChecksumMismatch("trainer rank 0", "bucket 2 of version 3: checksum mismatch"))
    with pytest.raises(RankFailed, match="^inference rank 0 failed: ChecksumMismatch: trainer rank 0: bucket 2") as failed:
        host.wait_ranks(["never"], "nothing", timeout=20)
    assert failed.value.reason == reasons.CHECKSUM_MISMATCH
    assert host.verification_failures() == 1
    for m in members.values():
        m.stop_heartbeat()


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


def test_a_versions_keys_are_forgotten_but_not_its_record():
    host, _ = started()
    host.seats[1].attempt = 2  # inference rank 1 restarted once: both its attempts' keys go
    keys = [Keys.go(0), Keys.ref(0), Keys.ref_of(0, 1), Keys.ready(0, 1), Keys.sent(0, 0, 1), Keys.applied(0, 0, 1),
            Keys.applied(0, 1, 1), Keys.applied(0, 1, 2), Keys.done(0), Keys.go(1), Keys.ref_of(1, 1), Keys.ready(1, 0)]
    for key in keys:
        host.set(key, Mark())
    host.forget(0)
    assert [host.has(k) for k in keys] == [False] * 8 + [True] * 4


def test_an_endless_job_keeps_a_bounded_number_of_keys():
    """Rounds go on for ever (training.steps 0): the store holds the same number of keys at the
    four-hundredth version as at the hundredth, the records of old rounds included."""
    from weightsync.rendezvous.rounds import RECORDS_KEPT

    host, _ = started()
    counts = {}
    for version in range(400):
        rnd = host.start_round(version)
        for t in range(2):
            host.set(Keys.ready(version, t), Ready())
            host.set(Keys.sent(version, 0, t), SentReport(0, 0.0))
        host.publish_reference(rnd, Reference("0" * 64), carried=True)
        for r in rnd.receivers:
            host.set(Keys.applied(version, r, 1), Applied(""))
        host.set(Keys.done(version), Done({}))
        if version >= 2:
            host.forget(version - 2)
        counts[version] = host.store.num_keys()
    assert counts[399] == counts[100] and counts[100] < 100
    assert host.has(Keys.done(399)) and host.has(Keys.done(397 - RECORDS_KEPT + 1))
    assert not host.has(Keys.done(397 - RECORDS_KEPT))
    host.store.close()


def test_a_receiver_silent_during_a_round_is_cut_and_the_sending_trainers_hear_of_it():
    host, members = started(silent_limit=1.0)
    for m in members.values():
        m.start_heartbeat()
    host.check_ranks()
    rnd = host.start_round(0)
    trainer = members[("trainer", 0)]
    told = []
    with trainer.cuts(rnd, told.append, every=0.05):
        members[("inference", 1)].stop_heartbeat()
        deadline = time.monotonic() + 15
        while not told and time.monotonic() < deadline:
            host.check_ranks()  # what the controller does while it waits for the trainers' reports
            time.sleep(0.05)
    assert told == [1] and host.seats[1].state == AWAY
    assert json.loads(host.get(Keys.cut(0))) == [1]
    # the next round does not name it, and nothing is cut in it
    rnd = host.start_round(1)
    assert rnd.receivers == (0,) and not host.has(Keys.cut(1))


def test_the_versions_end_once_every_trainer_closed_and_go_on_while_all_are_ready():
    host, members = started()
    trainers = [members[("trainer", t)] for t in range(2)]
    for m in trainers:
        m.set(Keys.ready(0, m.rank), Ready())
    assert host.next_version(0) is True
    trainers[0].closing(0)
    result = []
    waiter = threading.Thread(target=lambda: result.append(host.next_version(1)))
    waiter.start()
    waiter.join(1.0)
    assert waiter.is_alive(), "one trainer rank closed, the other may still publish: the controller waits"
    trainers[1].closing(0)
    waiter.join(10)
    assert result == [False]


def test_trainers_that_publish_different_versions_fail_the_job_naming_them():
    host, members = started()
    trainers = [members[("trainer", t)] for t in range(2)]
    trainers[0].closing(0)
    trainers[1].set(Keys.ready(1, 1), Ready())
    with pytest.raises(RankFailed, match=r"trainer rank 0 closed after version 0, but trainer rank 1 is ready for "
                                         r"version 1: every trainer rank must publish the same versions") as err:
        host.next_version(1)
    assert err.value.reason == "TrainersDisagree"


def test_a_trainer_that_attached_another_model_is_the_rank_blamed_not_the_inference_rank():
    from weightsync.model.build import build, layout_of, meta_layout
    from weightsync.model.flat import LayoutMismatch
    from weightsync.roles.controller.planning import same_models

    job = load_job({"apiVersion": API_VERSION, "kind": KIND, "metadata": {"name": "models"},
                    "spec": {"model": {"config": {"model_type": "gpt2", "n_layer": 1, "n_embd": 32, "n_head": 2,
                                                  "vocab_size": 64, "n_positions": 16}}}})
    right = meta_layout(job.model).to_json()
    other = dataclasses.replace(job.model, config={**job.model.config, "n_embd": 16})
    wrong = layout_of(build(other, dtype="float32", device="meta", load_weights=False), job.model.dtype).to_json()
    info = RankInfo("tcp")
    with pytest.raises(LayoutMismatch) as err:
        same_models(job, {("trainer", 0): Admission("t", wrong, info), ("inference", 0): Admission("i", right, info)})
    assert str(err.value).startswith("trainer rank 0 holds another model than spec.model: tensor #0 differs: spec.model "), err
    assert str(err.value).endswith("; attach the model spec.model describes, in spec.model.dtype")
    with pytest.raises(LayoutMismatch, match=r"^inference rank 0 holds another model than spec\.model: .*; serve the"):
        same_models(job, {("trainer", 0): Admission("t", right, info), ("inference", 0): Admission("i", wrong, info)})
    assert same_models(job, {("trainer", 0): Admission("t", right, info), ("inference", 0): Admission("i", right, info)}) \
        .to_json() == right


def test_each_receiver_reads_its_own_reference_and_a_repeat_must_carry_the_same_digests():
    host, _ = started()
    rnd = host.start_round(0)
    assert host.publish_reference(rnd, Reference(receivers={0: "a" * 64}), carried=False) is None
    assert not host.has(Keys.ref(0)) and not host.has(Keys.ref_of(0, 0))  # the round reached no one
    host.publish_reference(rnd, Reference(receivers={0: "a" * 64, 1: "b" * 64}), carried=True)
    assert [host.get(Keys.ref_of(0, r)) for r in (0, 1)] == [b"a" * 64, b"b" * 64]
    assert Reference.from_json(host.get(Keys.ref(0))).receivers == {0: "a" * 64, 1: "b" * 64}
    again = dataclasses.replace(rnd, again=1, receivers=(1,))
    host.publish_reference(again, Reference(receivers={1: "b" * 64}), carried=True)
    with pytest.raises(JobFailed, match="inference rank 1 with digest cccc.* not the bbbb") as failed:
        host.publish_reference(again, Reference(receivers={1: "c" * 64}), carried=True)
    assert failed.value.reason == reasons.VERIFICATION_FAILED
    assert host.get(Keys.ref_of(0, 1)) == b"b" * 64
