"""The messages the job's processes leave for each other in the store: each comes back from its
JSON as it was sent, with ranks and offsets as ints again."""
import json

from weightsync.rendezvous.messages import Peer, RankInfo, Round, SentReport, peers_from_json, peers_to_json


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
