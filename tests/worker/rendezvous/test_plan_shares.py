"""The plan over slices published in shares (rendezvous/plan_shares.py): every rank's share under a
key of its own, signed with the job token; a rank reads the header and its own share and gets the
plan it would have derived from the whole one; a share not signed with the token is refused; a
plan that is not over slices is published whole, as before."""

import pytest

from weightsync.model.flat import FlatLayout
from weightsync.plan.boxes import Box, RankSlices, Slice
from weightsync.plan.job import fsdp_holdings
from weightsync.plan.rank_plan import RankPlan
from weightsync.plan.segments import Plan, make_plan
from weightsync.plan.sliced_plan import SlicedPlan
from weightsync.rendezvous.plan_shares import own_plan, publish_shares, share_key
from weightsync.rendezvous.protocol import ProofError

TOKEN = b"t" * 32


class Store:
    """A member's view of the store: set, get, wait_for (the key is there already or never)."""

    def __init__(self, role: str = "trainer", rank: int = 0, token: bytes = TOKEN):
        self.keys: dict[str, bytes] = {}
        self.role, self.rank, self.token = role, rank, token

    def set(self, key, record):  # a record, as Channel.set takes it
        self.keys[key] = record.to_json().encode()

    def get(self, key):
        return self.keys[key]

    def wait_for(self, key, what, timeout=None, say=False):
        assert key in self.keys, what


def halves_plan() -> SlicedPlan:
    layout = FlatLayout.from_shapes([("a", (6, 4)), ("b", (5, 8))], "float32", align=16)
    needs = tuple(RankSlices(r, (Slice("a", Box((0, 2 * r), (6, 2 * r + 2))), Slice("b", Box((0, 4 * r), (5, 4 * r + 4)))))
                  for r in range(2))
    return SlicedPlan(layout, tuple(fsdp_holdings(layout, 3, 3)), needs, 64)


def test_each_rank_reads_its_own_share_and_gets_its_part_of_the_whole_plan():
    plan, store = halves_plan(), Store()
    header = publish_shares(store, TOKEN, plan)
    assert len(header) < len(plan.to_json()) and sorted(k for k in store.keys if not k.endswith("/mac")) == \
        sorted([share_key("trainer", t) for t in range(3)] + [share_key("inference", r) for r in range(2)])
    for role, rank in [("trainer", t) for t in range(3)] + [("inference", r) for r in range(2)]:
        store.role, store.rank = role, rank
        mine = own_plan(store, header, 1.0)
        assert isinstance(mine, RankPlan) and (mine.role, mine.rank) == (role, rank)
        if role == "trainer":
            assert list(mine.buckets_of(rank)) == plan.buckets_of(rank)
        else:
            assert mine.expected_for(rank) == plan.expected_for(rank) and mine.bytes_for(rank) == plan.bytes_for(rank)


def test_a_share_not_signed_with_the_jobs_token_is_refused():
    plan, store = halves_plan(), Store("inference", 1)
    header = publish_shares(store, b"u" * 32, plan)
    with pytest.raises(ProofError, match="not signed with this job's token"):
        own_plan(store, header, 1.0, ProofError)


def test_a_plan_not_over_slices_is_published_whole():
    layout = FlatLayout.from_shapes([("a", (8, 8))], "float32")
    plan, store = make_plan(layout, 2, 2, 1 << 20), Store()
    text = publish_shares(store, TOKEN, plan)
    assert text == plan.to_json() and store.keys == {}
    assert isinstance(own_plan(store, text, 1.0), Plan)
