"""Sync.servers(): the vLLM servers a trainer's script sends its own requests to, read from what
the inference ranks proved when they joined (through a real rendezvous store, in one process):
each server once, in rank order, the workers of a tensor-parallel server naming one; a rank's
info that is not what it proved is refused."""

from __future__ import annotations

import pytest

from weightsync.job import Layout
from weightsync.publisher.peers import Connections
from weightsync.rendezvous.messages import RankInfo
from weightsync.rendezvous.policy import Policy
from weightsync.rendezvous.protocol import Keys, Member, ProofError
from weightsync.rendezvous.roster import Host

TOKEN = b"0123456789abcdef-job-token"
JOB = "default/servers"
A, B = "http://10.0.0.5:8000", "http://10.0.0.6:8000"


@pytest.fixture()
def trainer():
    """A job whose inference ranks 0 and 1 are one server's workers (A) and rank 2 another's (B),
    admitted with its plan published; its trainer rank's links to them."""
    layout = Layout(trainers=1, trainer_procs=1, inferences=3, inference_procs=1)
    host = Host(0, TOKEN, layout, Policy(silent_limit=5, away_limit=60), say=lambda m: None, address="127.0.0.1",
                job=JOB)

    def join(role, rank, info):
        m = Member("127.0.0.1", host.store.port, TOKEN, role, rank, timeout=10, job=JOB)
        m.join(f"127.0.0.1:{2000 + rank}", '{"layout": 1}', info, timeout=10)
        return m

    me = join("trainer", 0, RankInfo("tcp"))
    for rank, server in ((0, A), (1, A), (2, B)):
        join("inference", rank, RankInfo("tcp", engine="vllm", server=server))
    admitted = host.admit(timeout=10)
    host.publish_plan("{}", {r: admitted[("inference", r)].endpoint for r in range(3)})
    yield Connections(None, me, {r: p.endpoint for r, p in me.peers(0, 10).items()}, 10)  # no sender: servers() sends nothing
    host.store.close()


def test_each_server_once_in_rank_order(trainer):
    assert trainer.servers() == (A, B)


def test_an_info_that_is_not_what_the_rank_proved_is_refused(trainer):
    forged = RankInfo("tcp", engine="vllm", server="http://10.0.0.99:8000")
    trainer.member.set(Keys.published("info", "inference", 2, 1), forged)
    with pytest.raises(ProofError, match="inference rank 2"):
        trainer.servers()
