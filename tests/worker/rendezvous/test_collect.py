"""The controller's collection of a round's records never loses one: a receiver's applied record
set between the controller's look at its key and its look at the rank's seat is read at the next
look and its digest checked (at a thousand simulated receivers that happened once every few
versions, and on the final version the job never ended)."""

import pytest
from support import roster
from support.roster import join, make_host

from weightsync.job import Layout
from weightsync.rendezvous.messages import Applied
from weightsync.rendezvous.protocol import Keys

JOB = "default/collect"
ONE = Layout(trainers=1, trainer_procs=1, inferences=1, inference_procs=1)


@pytest.fixture()
def joined():
    """A controller's Host with its trainer and inference rank joined and the plan published,
    before any go."""
    host = make_host(ONE, JOB, [], silent_limit=60.0, away_limit=60.0)
    members = {role: roster.member(host, role, 0, job=JOB) for role in ("trainer", "inference")}
    for m in members.values():
        join(m, "127.0.0.1:1001")
    admitted = host.admit(timeout=10)
    host.publish_plan("{}", {0: admitted[("inference", 0)].endpoint})
    yield host, members
    host.store.close()


def test_a_receivers_record_set_while_the_controller_looks_at_it_is_read_not_lost(joined, monkeypatch):
    host, members = joined
    inference = members["inference"]
    members["trainer"].ready(1, 10)
    assert host.next_version(1)
    rnd = host.start_round(1)
    key = Keys.applied(1, 0, inference.attempt)
    looked = host.has

    def has(k: str) -> bool:
        there = looked(k)
        if k == key and not there:  # the record lands right after this look
            inference.set(key, Applied("digest-0").to_json())
        return there

    monkeypatch.setattr(host, "has", has)
    assert host.collect_applied(rnd, 10.0) == {0: Applied("digest-0")}
