"""The controller's collection of a round's records never loses one: a receiver's applied record
set between the controller's look at its key and its look at the rank's seat is read at the next
look and its digest checked (at a thousand simulated receivers that happened once every few
versions, and on the final version the job never ended)."""

import pytest
from support.roster import one_of_each

from weightsync.rendezvous.messages import Applied
from weightsync.rendezvous.protocol import Keys

JOB = "default/collect"


@pytest.fixture()
def joined():
    with one_of_each(JOB) as got:
        yield got


def test_a_receivers_record_set_while_the_controller_looks_at_it_is_read_not_lost(joined, monkeypatch):
    host, members = joined
    inference = members["inference"]
    members["trainer"].ready(1, 10)
    assert host.next_version(1)
    rnd = host.start_round(1)
    key = Keys.applied(1, 0, inference.attempt)
    watch_of = host.store.arrivals

    def arrivals(keys):
        watch = watch_of(keys)
        take = watch.take

        def look(timeout: float) -> list[str]:
            come = take(timeout)
            if key not in come and not host.has(key):  # the record lands right after this look, before the roster's
                inference.set(key, Applied("digest-0"))
            return come

        watch.take = look
        return watch

    monkeypatch.setattr(host.store, "arrivals", arrivals)
    assert host.collect_applied(rnd, 10.0) == {0: Applied("digest-0")}
    assert not host.store._arrivals  # the controller's watch of the round's keys is gone with the round
