"""A rank's waits ask little of the controller's store, and still end at once: a wait with stops
(the keys on which its check raises: the job's end, its round dropped, its start counted away)
blocks in the store until its keys or a stop are set, and looks at the rest about once a second,
where every rank used to ask the store four or more times a second; at a thousand ranks those
looks were most of what the store served."""
import threading
import time

import pytest
from support.roster import make_host, one_of_each

from weightsync.job import Layout
from weightsync.rendezvous.channel import STOPPED_CHECK_EVERY
from weightsync.rendezvous.following import Dropped, FellBehind
from weightsync.rendezvous.messages import Text
from weightsync.rendezvous.protocol import JobEnded, Keys
from weightsync.rendezvous.store.table import StoreTimeout

JOB = "default/waits"
ONE = Layout(trainers=1, trainer_procs=1, inferences=1, inference_procs=1)


@pytest.fixture()
def joined():
    with one_of_each(JOB) as got:
        yield got


def test_a_store_wait_with_stops_ends_when_its_keys_or_a_stop_are_set():
    host = make_host(ONE, JOB, [], silent_limit=60.0, away_limit=60.0)
    store = host.store
    try:
        threading.Timer(0.2, lambda: store.set("stop", b"1")).start()
        assert store.wait_or(["never"], ["stop", "other"], 10.0) is False
        store.set("k", b"1")
        assert store.wait_or(["k"], ["stop"], 10.0) is True  # every key set: True, stops or not
        with pytest.raises(StoreTimeout, match="never not set"):
            store.wait_or(["never"], ["not-yet"], 0.1)
        assert store.waits == 0
    finally:
        store.close()


@pytest.mark.parametrize("stop,raised", [
    ("end", JobEnded), ("dropped", Dropped), ("away", FellBehind)])
def test_an_inference_rank_waiting_for_its_go_asks_the_store_twice_a_second_and_sees_a_stop_at_once(
        joined, stop, raised):
    host, members = joined
    inference = members["inference"]
    caught = []

    def wait_for_go() -> None:
        try:
            inference.round(1)
        except Exception as e:  # noqa: BLE001 - what ended the wait, checked below
            caught.append((e, time.monotonic()))

    thread = threading.Thread(target=wait_for_go, daemon=True)
    before = host.store.requests
    thread.start()
    time.sleep(2.0)
    asked = host.store.requests - before
    # a wait and a look (one peek) about every STOPPED_CHECK_EVERY: 4 in 2 s, where the look every
    # 0.25 s of five reads asked 48; a slow machine asks fewer, never more
    assert asked <= 2 * (2.0 / STOPPED_CHECK_EVERY + 2), asked
    assert thread.is_alive() and not caught
    set_at = time.monotonic()
    if stop == "end":
        host.end("Failed", "ended by the test", "RankFailed")
    elif stop == "dropped":
        host.set(Keys.dropped(1), Text("a trainer rank stopped"))
    else:
        host.set(Keys.away(0, inference.attempt), Text("silent for the test"))
    thread.join(10.0)
    assert caught and isinstance(caught[0][0], raised), caught
    assert caught[0][1] - set_at < STOPPED_CHECK_EVERY, "the stop did not end the wait before its next look"
