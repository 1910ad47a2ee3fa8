"""The transfer plan: coverage (every byte from exactly one trainer), balance, odd sizes, tied
weights, more trainers than tensors, JSON, and the table `weightsync plan` prints."""

import pytest

from weightsync.job import API_VERSION, KIND, load_job
from weightsync.model.flat import ALIGN, FlatLayout
from weightsync.plan.holders import Holdings, plan_by_holder
from weightsync.plan.interface import TransferBucket, TransferPlan
from weightsync.plan.segments import Plan, make_plan
from weightsync.plan.sliced_plan import SlicedPlan, needs_everything


def layout(shapes, dtype="float32"):
    return FlatLayout.from_shapes([(f"t{i}", s) for i, s in enumerate(shapes)], dtype)


def assert_covers_exactly_once(plan: Plan):
    """Every inference rank needs the whole version: the buckets tile [0, total) with no gap or
    overlap, each from one trainer, each trainer's buckets one contiguous run."""
    spans = sorted((b.offset, b.end, b.trainer) for b in plan.buckets)
    pos = 0
    for start, end, _ in spans:
        assert start == pos, f"gap or overlap at byte {pos}"
        assert start % ALIGN == 0 and 0 < end - start <= plan.bucket_bytes
        pos = end
    assert pos == plan.layout.total_bytes
    for t in range(plan.trainers):
        mine = plan.buckets_of(t)
        assert all(a.end == b.offset for a, b in zip(mine, mine[1:]))
    received = sorted(r for ranges in plan.expected().values() for r in ranges)
    assert sum(n for _, n in received) == plan.layout.total_bytes
    assert [b.index for b in plan.buckets] == list(range(len(plan.buckets)))


@pytest.mark.parametrize("trainers,inferences,bucket", [(1, 1, 1 << 20), (2, 3, 4096), (3, 2, 64), (7, 1, 640)])
def test_coverage_and_balance(trainers, inferences, bucket):
    lay = layout([(1000, 77), (3,), (50257, 13), (1,), (4096,)])
    plan = make_plan(lay, trainers, inferences, bucket)
    assert_covers_exactly_once(plan)
    shares = plan.bytes_by_trainer()
    assert max(shares) - min(shares) <= ALIGN  # near-equal integer shares of 64-byte units
    assert plan.balance() <= 1 + ALIGN * trainers / lay.total_bytes


def test_large_tensors_are_split_across_trainers_and_buckets():
    lay = layout([(4096, 1024)])  # one 16 MiB tensor
    plan = make_plan(lay, 4, 2, 1 << 20)
    assert_covers_exactly_once(plan)
    assert {b.trainer for b in plan.buckets} == {0, 1, 2, 3}
    assert len(plan.buckets) == 16 and plan.balance() == 1.0


def test_odd_sizes():
    lay = layout([(3,), (5, 7), (1,), (999,)], "bfloat16")
    for trainers in (1, 2, 3, 5):
        plan = make_plan(lay, trainers, 2, 128)
        assert_covers_exactly_once(plan)


def test_more_trainers_than_tensors_leaves_some_idle():
    lay = layout([(5,), (3,)])  # 128 bytes = two 64-byte units
    plan = make_plan(lay, 8, 2, 64)
    assert_covers_exactly_once(plan)
    busy = [t for t in range(8) if plan.buckets_of(t)]
    assert len(busy) == 2 and set(plan.expected()) == set(busy)
    assert plan.bytes_by_trainer().count(0) == 6
    assert plan.balance() == pytest.approx(4.0)  # 64 bytes against a mean of 16
    assert "balance (largest trainer share / mean): 4.000" in plan.table()


def test_tied_weights_appear_once():
    import torch
    import transformers

    config = transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=101, n_positions=16)
    with torch.device("meta"):
        model = transformers.GPT2LMHeadModel(config)
    assert model.lm_head.weight is model.transformer.wte.weight
    lay = FlatLayout.from_named_tensors(model.named_parameters(), "bfloat16")
    assert lay.names.count("transformer.wte.weight") == 1 and "lm_head.weight" not in lay.names
    # passing both names explicitly changes nothing on a real (non-meta) model either
    real = transformers.GPT2LMHeadModel(config)
    both = [("transformer.wte.weight", real.transformer.wte.weight), ("lm_head.weight", real.lm_head.weight)]
    assert FlatLayout.from_named_tensors(both, "float32").names == ["transformer.wte.weight"]
    plan = make_plan(lay, 2, 2, 4096)
    assert_covers_exactly_once(plan)


def test_json_round_trip():
    plan = make_plan(layout([(33, 3), (7,)], "bfloat16"), 3, 2, 128)
    again = Plan.from_json(plan.to_json())
    assert again == plan
    assert again.to_json() == plan.to_json()


def test_every_planner_makes_a_transfer_plan():
    """The whole plan, the plan by holder and the plan over slices all speak interface.TransferPlan
    (what the send pipeline and the receiver ask of a plan): every bucket goes to every inference
    rank, or over slices to its one receiver, and each receiver expects exactly those."""
    lay = layout([(10, 64), (7, 32)])
    held = tuple(Holdings.fsdp(lay, 2, t) for t in range(2))
    plans = [make_plan(lay, 2, 3, 4096), plan_by_holder(lay, dict(enumerate(held)), 3, 4096, bundle=True),
             SlicedPlan(lay, held, tuple(needs_everything(lay, r) for r in range(3)), 4096)]
    for plan in plans:
        assert isinstance(plan, TransferPlan)
        buckets = [b for t in range(plan.trainers) for b in plan.buckets_of(t)]
        assert buckets and all(isinstance(b, TransferBucket) for b in buckets)
        assert {b.receiver is None for b in buckets} == {not plan.sliced}
        for r in range(plan.inferences):
            expected = sorted(o for ranges in plan.expected_for(r).values() for o, _ in ranges)
            assert expected == sorted(b.offset for b in buckets if b.receiver in (None, r))
            assert plan.bytes_for(r) == lay.total_bytes


def test_bad_arguments_say_what_to_fix():
    lay = layout([(8,)])
    with pytest.raises(ValueError, match="multiple of 64"):
        make_plan(lay, 1, 1, 100)
    with pytest.raises(ValueError, match="at least one trainer"):
        make_plan(lay, 0, 1, 64)


def test_table_shows_every_trainer_and_the_balance():
    plan = make_plan(layout([(1000, 100)]), 3, 2, 64 << 10)
    text = plan.table()
    rows = [line for line in text.splitlines() if line.strip().split(" ")[0] in {"0", "1", "2"}]
    assert len(rows) == 3
    assert "3 trainer rank(s) -> 2 inference rank(s)" in text
    assert f"balance (largest trainer share / mean): {plan.balance():.3f}" in text


def test_job_plan_uses_the_jobs_ranks_dtype_and_bucket_size():
    from weightsync.cli import job_plan

    job = load_job({"apiVersion": API_VERSION, "kind": KIND, "metadata": {"name": "p"},
                             "spec": {"model": {"config": {"model_type": "gpt2", "n_layer": 2, "n_embd": 64,
                                                           "n_head": 2, "vocab_size": 500}, "dtype": "bfloat16"},
                                      "trainer": {"replicas": 2, "procsPerPod": 2},
                                      "inference": {"replicas": 3}, "transfer": {"bucketMB": 1}}})
    plan = job_plan(job)
    assert isinstance(plan, Plan)
    assert (plan.trainers, plan.inferences, plan.bucket_bytes, plan.layout.dtype) == (4, 3, 1 << 20, "bfloat16")
    assert "lm_head.weight" not in plan.layout.names
    assert_covers_exactly_once(plan)
    assert "balance" in plan.table()
