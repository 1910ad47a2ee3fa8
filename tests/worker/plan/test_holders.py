"""Planning by holder: every byte of a version comes from a trainer rank that holds it (FSDP2's
dim-0 shards, uneven ones included, and replicas of shards), balanced among the ranks that hold
the same rows; rows nobody holds, or held in overlapping pieces, are refused naming the tensor."""

import pytest

from weightsync.model.flat import FlatLayout
from weightsync.plan.holders import Holdings, plan_by_holder

SHAPES = [("embed", (101, 48)), ("bias", (7,)), ("scale", ()), ("proj", (48, 70)), ("empty", (0, 3))]


def chunks(rows: int, world: int) -> list[tuple[int, int]]:
    """torch.chunk's split, as FSDP2 shards dim 0: the last shards shorter or empty."""
    size = -(-rows // world)
    return [(min(r * size, rows), min(r * size + size, rows)) for r in range(world)]


def fsdp(layout: FlatLayout, world: int) -> dict[int, Holdings]:
    per_tensor = [chunks(s.shape[0] if s.shape else 1, world) for s in layout.slots]
    return {r: Holdings(tuple(c[r] for c in per_tensor)) for r in range(world)}


def covered(plan, layout) -> dict[int, int]:
    """{byte: trainer} for every byte the plan sends; asserts no byte is sent twice."""
    owner = {}
    for b in plan.buckets:
        assert sum(n for _, n in b.spans) == b.length and b.spans[0][0] == b.offset
        for offset, length in b.spans:
            for x in range(offset, offset + length):
                assert x not in owner, f"byte {x} sent twice"
                owner[x] = b.trainer
    return owner


def held_bytes(layout, holdings: Holdings) -> set[int]:
    out = set()
    for (a, e), s in zip(holdings.rows, layout.slots):
        row = s.nbytes // (s.shape[0] if s.shape else 1) if s.nbytes else 0
        out.update(range(s.offset + a * row, s.offset + e * row))
    return out


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("bundle", [False, True])
def test_each_fsdp_rank_sends_exactly_the_rows_it_holds(world, dtype, bundle):
    layout = FlatLayout.from_shapes(SHAPES, dtype)
    holdings = fsdp(layout, world)
    plan = plan_by_holder(layout, holdings, inferences=2, bucket_bytes=1024, bundle=bundle)
    owner = covered(plan, layout)
    assert set(owner) == {x for s in layout.slots for x in range(s.offset, s.offset + s.nbytes)}  # every tensor byte, no padding
    for t in range(world):
        assert {x for x, o in owner.items() if o == t} == held_bytes(layout, holdings[t])
    assert max(b.length for b in plan.buckets) <= 1024
    item = 2 if dtype == "bfloat16" else 4
    assert all(n % item == 0 for b in plan.buckets for _, n in b.spans)
    assert plan.to_json() and type(plan).from_json(plan.to_json()) == plan
    if bundle:  # as few buckets as the rank's bytes need, each runs in layout order that never touch
        for t, share in enumerate(plan.bytes_by_trainer()):
            assert len(plan.buckets_of(t)) == -(-share // 1024)
        for b in plan.buckets:
            ends = [o + n for o, n in b.spans]
            assert all(end < o for end, (o, _) in zip(ends, b.spans[1:]))
        assert plan.scatter_for(0) == {b.offset: b.parts for b in plan.buckets if b.parts} != {}
    else:
        assert not any(b.parts for b in plan.buckets) and plan.scatter_for(0) == {}


def test_replicas_of_shards_split_their_rows_among_the_holders():
    # HSDP: ranks 0 and 2 hold the first half of every tensor, 1 and 3 the second
    layout = FlatLayout.from_shapes([("w", (64, 16)), ("v", (30, 8))], "float32")
    halves = fsdp(layout, 2)
    holdings = {r: halves[r % 2] for r in range(4)}
    plan = plan_by_holder(layout, holdings, inferences=1, bucket_bytes=4096)
    owner = covered(plan, layout)
    for t in range(4):
        assert {x for x, o in owner.items() if o == t} <= held_bytes(layout, holdings[t])
    shares = plan.bytes_by_trainer()
    assert max(shares) - min(shares) <= 16 * 4 + 8 * 4  # at most a row of each tensor apart
    assert plan.balance() < 1.05


def test_a_tensor_left_whole_on_every_rank_is_split_among_them():
    layout = FlatLayout.from_shapes([("sharded", (10, 4)), ("whole", (9, 4))], "float32")
    holdings = {r: Holdings((chunks(10, 3)[r], (0, 9))) for r in range(3)}
    plan = plan_by_holder(layout, holdings, inferences=1, bucket_bytes=1024)
    owner = covered(plan, layout)
    whole = layout.slots[1]
    assert sorted({owner[x] for x in range(whole.offset, whole.offset + whole.nbytes)}) == [0, 1, 2]


def test_rows_nobody_holds_or_overlapping_rows_are_refused_naming_the_tensor():
    layout = FlatLayout.from_shapes([("a", (10, 4)), ("b", (6,))], "float32")
    gap = {0: Holdings(((0, 4), (0, 3))), 1: Holdings(((5, 10), (3, 6)))}
    with pytest.raises(ValueError, match=r"tensor a: rows \[4, 5\) are held by no trainer rank"):
        plan_by_holder(layout, gap, 1, 1024)
    overlap = {0: Holdings(((0, 6), (0, 3))), 1: Holdings(((4, 10), (3, 6)))}
    with pytest.raises(ValueError, match="tensor a: trainer ranks hold overlapping rows"):
        plan_by_holder(layout, overlap, 1, 1024)
    short = {0: Holdings(((0, 10), (0, 3))), 1: Holdings(((0, 10), (0, 3)))}
    with pytest.raises(ValueError, match=r"tensor b: rows \[3, 6\) are held by no trainer rank"):
        plan_by_holder(layout, short, 1, 1024)
    with pytest.raises(ValueError, match="trainer rank 0 says it holds rows \\[0, 11\\) of a, which has 10"):
        plan_by_holder(layout, {0: Holdings(((0, 11), (0, 6)))}, 1, 1024)
