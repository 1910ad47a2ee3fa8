"""The messages the job's processes leave for each other in the store: each comes back from its
JSON as it was sent, with ranks and offsets as ints again."""
import json

from weightsync.rendezvous.messages import (
    Applied,
    End,
    Peer,
    PublishedPlan,
    RankInfo,
    Ready,
    Reference,
    ResumePoint,
    Round,
    SentReport,
    Staged,
    cut_from_json,
    cut_to_json,
    peers_from_json,
    peers_to_json,
)


def test_a_round_comes_back_as_it_was_announced():
    rnd = Round(7, again=2, receivers=(0, 3), epoch=4, bases={3: 5})
    assert Round.from_json(rnd.to_json()) == rnd
    assert rnd.name == "version 7 (sent again, 2)" and Round(1).name == "version 1"


def test_the_endpoints_of_an_epoch_come_back_keyed_by_rank():
    peers = {1: Peer("10.0.0.2:29600", 3), 0: Peer("10.0.0.1:29600", 1)}
    text = peers_to_json(peers)
    assert list(json.loads(text)) == ["0", "1"] and peers_from_json(text) == peers


def test_what_a_rank_tells_about_itself_leaves_out_what_it_has_not():
    info = RankInfo("tcp", "the network is not rdma", "cpu", "demo-inference-0", needs=[["w", [0], [4]]])
    assert RankInfo.from_json(info.to_json()) == info
    assert json.loads(RankInfo("nccl", pod="p").to_json()) == {"transport": "nccl", "why": "", "device": "", "pod": "p"}


def test_a_trainers_report_comes_back_with_int_keys():
    report = SentReport(4096, 0.25, {0: 11, 2048: 22}, {1: {0: 33}}, step=10, loss=2.5, lost={3: "connection reset"},
                        wire_bytes=8192, changed=5, compared=100)
    assert SentReport.from_json(report.to_json()) == report
    assert json.loads(report.to_json())["lost"] == {"3": "connection reset"}


def test_the_end_of_the_job_comes_back_as_the_controller_said_it():
    end = End("Failed", "inference rank 1 failed: boom", "RankFailed")
    assert End.from_json(end.to_json()) == end
    assert json.loads(end.to_json()) == {"state": "Failed", "reason": "RankFailed", "message": "inference rank 1 failed: boom"}


def test_a_ready_says_its_step_and_one_without_a_step_says_none():
    assert Ready.from_json(Ready(30).to_json()) == Ready(30)
    assert json.loads(Ready(None).to_json()) == {"step": None}
    assert Ready.from_json("1").step is None and Ready.from_json("not json").step is None


def test_where_the_trainers_resume_comes_back_with_int_ranks():
    point = ResumePoint(2, 5, delivered=4, step=40, attempts={0: 2, 1: 3})
    assert ResumePoint.from_json(point.to_json()) == point
    assert json.loads(point.to_json()) == {"resumes": 2, "version": 5, "delivered": 4, "step": 40,
                                           "attempts": {"0": 2, "1": 3}}
    assert ResumePoint.from_json(ResumePoint(1, 0).to_json()) == ResumePoint(1, 0)  # nothing delivered yet


def test_what_an_inference_rank_applied_comes_back_and_a_bare_digest_reads_as_nothing_else():
    applied = Applied("ab" * 32, 0.5, patched=3, refused=1, why_refused="base changed", verify_seconds=0.01,
                      load_seconds=0.2)
    assert Applied.from_json(applied.to_json()) == applied
    assert list(json.loads(applied.to_json())) == ["digest", "seconds", "patched", "refused", "why_refused",
                                                   "verify_seconds", "load_seconds"]
    assert Applied.from_json('{"digest": "d"}') == Applied("d")


def test_a_staged_record_says_its_session_and_its_shadow_load_only_with_load_ahead():
    staged = Staged("d", session_open=True, keep_session=True, prepare_seconds=0.3)
    assert Staged.from_json(staged.to_json()) == staged
    assert json.loads(Staged("d").to_json()) == {"digest": "d", "session_open": False, "keep_session": False}


def test_a_reference_is_the_versions_digest_or_each_receivers_own():
    whole = Reference.made("ab" * 32)
    assert whole.to_json() == "ab" * 32 and Reference.from_json(whole.to_json().encode()) == whole
    assert whole.of(7) == "ab" * 32
    sliced = Reference.made({10: "x", 2: "y"})
    assert sliced.to_json() == json.dumps({"10": "x", "2": "y"}, sort_keys=True)
    assert Reference.from_json(sliced.to_json()) == sliced
    assert (sliced.of(2), sliced.of(10), sliced.of(3)) == ("y", "x", None)  # 3: not in the round


def test_the_published_plan_carries_the_plans_own_json():
    published = PublishedPlan('{"kind": "slices"}')
    assert PublishedPlan.from_json(published.to_json()) == published
    assert json.loads(published.to_json()) == {"plan": '{"kind": "slices"}'}


def test_the_receivers_cut_off_come_back_in_rank_order():
    assert cut_to_json({3, 1}) == "[1, 3]" and cut_from_json(cut_to_json({3, 1})) == [1, 3]
