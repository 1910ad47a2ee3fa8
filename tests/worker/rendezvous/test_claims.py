"""External vLLM servers' claims of inference ranks (rendezvous/claims.py), against a real store: the
controller gives each server's workers the ranks of one replica, in order, and refuses with one line
a server for another model, one with another worker count, the same server twice while it is there,
and any server once the job is full; a server that went away gets its rank back, and a server
under another URL takes over a replica whose server is away."""

import threading

import pytest

from weightsync.job import Layout
from weightsync.model.flat import FlatLayout
from weightsync.rendezvous.channel import Channel, connect_store, host_store
from weightsync.rendezvous.claims import Claim, ClaimRefused, Claims, claim

TOKEN = b"0123456789abcdef-job-token"
JOB = "team/servers"
MODEL = FlatLayout.from_shapes([("embed.weight", (8, 4)), ("head.weight", (4, 8))], "bfloat16")
OTHER = FlatLayout.from_shapes([("embed.weight", (8, 6)), ("head.weight", (6, 8))], "bfloat16")


def claims(servers=2, workers=1, said=None, sizes=None):
    """The claims of a job with `servers` vLLM servers of `workers` workers each (or of `sizes`)."""
    sizes = tuple(sizes or (workers,) * servers)
    return Claims(Layout(1, 1, len(sizes), 1, sizes, servers=True), JOB, lambda: MODEL,
                  (said if said is not None else []).append)


def ask(server, worker=0, workers=1, layout=MODEL):
    return Claim(server, worker, workers, layout.to_json())


def test_claims_through_the_store_get_ranks_in_order_and_refusals_reach_the_claimant():
    store = host_store("127.0.0.1", 0, TOKEN, JOB, 4)
    controller = Channel(store)
    said: list[str] = []
    side = claims(servers=1, said=said)
    got: dict[str, object] = {}

    def join(url):
        channel = Channel(connect_store("127.0.0.1", store.port, TOKEN, JOB, 10))
        try:
            got[url] = claim(channel, ask(url), 10)
        except ClaimRefused as e:
            got[url] = e

    first = threading.Thread(target=join, args=("http://a:8000",))
    first.start()
    while "http://a:8000" not in got:
        side.serve(controller, lambda rank: True)
    first.join()
    second = threading.Thread(target=join, args=("http://b:8000",))
    second.start()
    while "http://b:8000" not in got:
        side.serve(controller, lambda rank: True)
    second.join()
    store.close()
    assert got["http://a:8000"] == 0
    assert isinstance(got["http://b:8000"], ClaimRefused)
    assert str(got["http://b:8000"]) == (f"job {JOB} is full: its 1 inference servers (spec.inference.replicas) have "
                                         "joined (http://a:8000) and are there; a server joins only in place of one "
                                         "that stopped")
    assert said == ["the vLLM server at http://a:8000 claimed inference rank 0",
                    f"refused the vLLM server at http://b:8000: {got['http://b:8000']}"]


def test_a_server_for_another_model_is_refused_naming_the_tensor():
    answer = claims().decide(ask("http://a:8000", layout=OTHER), lambda rank: True)
    assert answer.rank is None
    assert answer.refused.startswith(f"the vLLM server at http://a:8000 serves another model than job {JOB}: "
                                     "tensor #0 differs")
    assert answer.refused.endswith("serve spec.model (its config or checkpoint) in spec.model.dtype (--dtype)")
    dtype = FlatLayout.from_shapes([("embed.weight", (8, 4)), ("head.weight", (4, 8))], "float32")
    assert "dtype differs" in claims().decide(ask("http://a:8000", layout=dtype), lambda rank: True).refused


def test_the_workers_of_a_server_hold_one_replica_and_another_worker_count_is_refused():
    side = claims(servers=2, workers=2)
    assert side.decide(ask("http://a:8000", 1, 2), lambda rank: True).rank == 1
    assert side.decide(ask("http://b:8000", 0, 2), lambda rank: True).rank == 2
    assert side.decide(ask("http://a:8000", 0, 2), lambda rank: True).rank == 0
    assert side.decide(ask("http://b:8000", 1, 2), lambda rank: True).rank == 3
    refused = claims(servers=1, workers=2).decide(ask("http://c:8000", 0, 1), lambda rank: True).refused
    assert refused == (f"the vLLM server at http://c:8000 runs 1 workers, but job {JOB}'s servers run 2 "
                       "(spec.inference.tensorParallel, tensorParallelSizes): start it with --tensor-parallel-size 2")


def test_servers_of_different_sizes_get_a_replica_of_their_own_size():
    side = claims(sizes=(1, 2))  # inference rank 0 is one server, ranks 1 and 2 the other
    assert side.decide(ask("http://big:1", 1, 2), lambda rank: True).rank == 2
    assert side.decide(ask("http://small:1", 0, 1), lambda rank: True).rank == 0
    assert side.decide(ask("http://big:1", 0, 2), lambda rank: True).rank == 1
    assert side.decide(ask("http://other:1", 0, 2), lambda rank: True).refused.startswith(
        f"job {JOB} is full: its 1 inference servers of 2 workers (spec.inference.replicas) have joined (http://big:1)")
    assert "servers run 1 or 2" in side.decide(ask("http://odd:1", 0, 3), lambda rank: True).refused
    assert "servers run 2 " in side.decide(ask("http://big:1", 0, 1), lambda rank: True).refused


def test_the_same_server_twice_is_refused_while_it_is_there_and_gets_its_rank_back_once_away(monkeypatch):
    side = claims(servers=2)
    assert side.decide(ask("http://a:8000"), lambda rank: True).rank == 0
    refused = side.decide(ask("http://a:8000"), lambda rank: True).refused
    assert refused == (f"the vLLM server at http://a:8000 already joined job {JOB} as inference rank 0 and is still "
                       "there: a server joins a job once (is WEIGHTSYNC_VLLM_SERVER this server's own URL?)")
    # just given, its worker not yet admitted: still its own, even where the roster has it away
    assert side.decide(ask("http://a:8000"), lambda rank: False).refused == refused
    monkeypatch.setattr("weightsync.rendezvous.claims.ARRIVAL", 0.0)
    assert side.decide(ask("http://a:8000"), lambda rank: False).rank == 0  # it stopped: its restart rejoins


def test_a_full_job_refuses_new_servers_and_one_takes_over_a_replica_whose_server_is_away(monkeypatch):
    said: list[str] = []
    side = claims(servers=2, said=said)
    assert [side.decide(ask(url), lambda rank: True).rank for url in ("http://a:1", "http://b:1")] == [0, 1]
    assert "is full" in side.decide(ask("http://c:1"), lambda rank: True).refused
    monkeypatch.setattr("weightsync.rendezvous.claims.ARRIVAL", 0.0)
    assert side.decide(ask("http://c:1"), lambda rank: rank != 1).rank == 1
    assert said == ["the vLLM server at http://c:1 takes over replica 1 from http://b:1, which is away"]
    assert side.replicas == {"http://a:1": 0, "http://c:1": 1}


@pytest.mark.parametrize("broken", ["not json", '{"slots": []}'])
def test_a_layout_that_cannot_be_read_is_refused(broken):
    answer = claims().decide(Claim("http://a:8000", 0, 1, broken), lambda rank: True)
    assert answer.rank is None and "serves another model" in answer.refused


def test_before_a_trainer_joined_the_layout_is_read_but_not_compared():
    side = Claims(Layout(1, 1, 1, 1, (1,), servers=True), JOB, lambda: None, [].append)
    assert side.decide(ask("http://a:8000", layout=OTHER), lambda rank: True).rank == 0
