"""Each rank's share of a sliced plan (plan/shares.py, plan/rank_plan.py): the union of the shares
is the whole assignment, piece for piece, and each rank derives from its own share exactly what it
derived from the whole plan: a trainer its buckets in their order, an inference rank what it
receives from whom, its local layout and its buffer's size. On simulated mixtures of experts
(expert parallelism, tensor parallelism, HSDP replicas, buckets small enough to cut pieces) in the
unit tier, and on Kimi-K2 on 384 GPUs (4xEP32) in the slow tier."""

import json

import numpy as np
import pytest

from weightsync.bench.control_plane import setup
from weightsync.model.flat import FlatLayout
from weightsync.plan.holders import Holdings
from weightsync.plan.job import fsdp_holdings
from weightsync.plan.rank_plan import RankPlan, is_shares, pack
from weightsync.plan.shares import BOX, NBYTES, OFFSET, PEER, SLOT_END, TENSOR, decode, share_out
from weightsync.plan.sliced_plan import SlicedPlan, needs_everything, needs_from_json, plan_from_json

MOE = dict(model_type="deepseek_v3", num_hidden_layers=3, first_k_dense_replace=1, hidden_size=64,
           intermediate_size=128, moe_intermediate_size=36, n_routed_experts=8, num_experts_per_tok=2,
           num_attention_heads=4, num_key_value_heads=4, vocab_size=100, q_lora_rank=16, kv_lora_rank=16,
           qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, n_group=1, topk_group=1, max_position_embeddings=64,
           tie_word_embeddings=False)


def moe_plan(tmp_path, ranks: int, inference: str, bucket_bytes: int, shard: int | None = None) -> SlicedPlan:
    config = tmp_path / "config.json"
    config.write_text(json.dumps(MOE))
    built = setup(str(config), ranks, inference, versions=1)
    trainers = len(built.holds)
    holdings = fsdp_holdings(built.layout, trainers, shard or trainers)
    needs = tuple(needs_from_json(r, n) if n is not None else needs_everything(built.layout, r)
                  for r, n in enumerate(built.needs))
    return SlicedPlan(built.layout, tuple(holdings), needs, bucket_bytes)


def pieces_of(plan: SlicedPlan, sender: int) -> np.ndarray:
    """The whole assignment's pieces `sender` sends, as (sender, receiver, tensor, lo, hi), sorted."""
    out = []
    for c in plan.assignment.classes:
        a, b = np.searchsorted(c.sender, [sender, sender + 1])  # a class's pieces are sorted by sender
        m, n, nd = len(c.tensors), b - a, c.lo.shape[1]
        rows = np.empty((m, n, 3 + 2 * nd), dtype=np.int64)
        rows[:, :, 0], rows[:, :, 1], rows[:, :, 2] = sender, c.receiver[a:b], c.tensors[:, None]
        rows[:, :, 3:3 + nd], rows[:, :, 3 + nd:] = c.lo[a:b], c.hi[a:b]
        out.append(rows.reshape(m * n, 3 + 2 * nd))
    return _sorted(np.concatenate(out))


def trainer_runs(text: str) -> np.ndarray:
    """A trainer's share's runs as (sender, receiver, tensor, lo, hi, offset, slot end), sorted."""
    s = json.loads(text)
    runs = decode(s["runs"], BOX + 2 * s["nd"])
    sender = np.full((len(runs), 1), s["rank"], dtype=np.int64)
    return _sorted(np.concatenate([sender, runs[:, [PEER, TENSOR]], runs[:, BOX:], runs[:, [OFFSET, SLOT_END]]], axis=1))


def received(plan: SlicedPlan, trainer_texts, receiver: int) -> np.ndarray:
    """What the trainers' shares send `receiver`: (sender, offset, slot end, bytes), sorted."""
    items = np.array([it.itemsize for it in plan.assignment.tensors], dtype=np.int64)
    rows = np.concatenate([runs[runs[:, 1] == receiver] for runs in (trainer_runs(t) for t in trainer_texts)])
    nd = (rows.shape[1] - 5) // 2
    nbytes = np.prod(rows[:, 3 + nd:3 + 2 * nd] - rows[:, 3:3 + nd], axis=1) * items[rows[:, 2]]
    return _sorted(np.stack([rows[:, 0], rows[:, -2], rows[:, -1], nbytes], axis=1))


def receiver_runs(text: str) -> np.ndarray:
    s = json.loads(text)
    return _sorted(decode(s["runs"], NBYTES + 1))


def _sorted(rows: np.ndarray) -> np.ndarray:
    return rows[np.lexsort(rows.T[::-1])]


def check_shares(plan: SlicedPlan) -> None:
    shares = share_out(plan)
    assert is_shares(shares.header) and not is_shares(plan.to_json())
    assert len(shares.trainers) == plan.trainers and len(shares.inferences) == plan.inferences
    for t, text in enumerate(shares.trainers):
        assert np.array_equal(trainer_runs(text)[:, :-2], pieces_of(plan, t)), t
    for r, text in enumerate(shares.inferences):
        assert np.array_equal(receiver_runs(text), received(plan, shares.trainers, r)), r
    for t, text in enumerate(shares.trainers):
        mine = RankPlan.from_json(shares.header, text)
        assert list(mine.buckets_of(t)) == plan.buckets_of(t), t
        assert mine.sent_bytes(t) == plan.sent_bytes(t)
        assert mine.holdings[t] == plan.holdings[t] and mine.layout == plan.layout
    for r, text in enumerate(shares.inferences):
        mine = RankPlan.from_json(shares.header, text)
        assert mine.expected_for(r) == plan.expected_for(r), r
        assert mine.local_of(r) == plan.local_of(r) and mine.bytes_for(r) == plan.bytes_for(r)
        assert mine.bytes_by_receiver() == plan.bytes_by_receiver() and mine.scatter_for(r) == {}


@pytest.mark.parametrize("inference,bucket_bytes,shard", [
    ("2xTP2xEP4", 1 << 20, None), ("2xTP2xEP4", 4096, None), ("1xEP8", 2048, None), ("2xTP2xEP4", 4096, 3),
    ("3xTP2", 1 << 12, 2)], ids=["tp2xep4", "tp2xep4-small-buckets", "ep8", "tp2xep4-hsdp", "tp2-hsdp"])
def test_the_shares_of_a_simulated_moe_job_are_the_whole_plan_rank_by_rank(tmp_path, inference, bucket_bytes, shard):
    check_shares(moe_plan(tmp_path, 14, inference, bucket_bytes, shard))


def test_a_whole_replica_beside_tensor_parallel_ones_and_a_rank_asked_about_another_rank(tmp_path):
    plan = moe_plan(tmp_path, 8, "2xTP2", 4096)
    needs = plan.needs[:2] + (needs_everything(plan.layout, 2),)  # two TP2 ranks and a whole replica
    plan = SlicedPlan(plan.layout, plan.holdings, needs, plan.bucket_bytes)
    check_shares(plan)
    shares = share_out(plan)
    trainer = RankPlan.from_json(shares.header, shares.trainers[1])
    receiver = RankPlan.from_json(shares.header, shares.inferences[2])
    with pytest.raises(ValueError, match="trainer rank 1's share alone"):
        trainer.buckets_of(0)
    with pytest.raises(ValueError, match="inference rank 2's share alone"):
        receiver.expected_for(0)
    with pytest.raises(ValueError, match="share alone"):
        trainer.local_of(2)
    assert receiver.bytes_for(2) == plan.layout.total_bytes  # a whole replica's buffer is the flat layout


def test_a_trainer_with_nothing_to_send_has_an_empty_share():
    layout = FlatLayout.from_shapes([("a", (2, 4))], "float32")
    holdings = fsdp_holdings(layout, 3, 3)  # torch.chunk: 1 row each for two ranks, none for the third
    assert holdings[2] == Holdings(((2, 2),))
    plan = SlicedPlan(layout, tuple(holdings), (needs_everything(layout, 0),), 1 << 20)
    check_shares(plan)
    shares = share_out(plan)
    assert len(RankPlan.from_json(shares.header, shares.trainers[2]).buckets_of(2)) == 0


def test_runs_join_a_bucket_only_across_padding_and_within_its_size():
    offset = np.array([0, 64, 128, 200, 256, 320])
    nbytes = np.array([64, 60, 64, 56, 64, 64])
    slot_end = np.array([64, 124, 192, 256, 320, 384])  # the second ends its slot; the third does not
    assert pack(offset, nbytes, slot_end, 1 << 20).tolist() == [0, 3]  # 192..200 is inside the third's slot
    assert pack(offset, nbytes, slot_end, 128).tolist() == [0, 2, 3, 5]  # at most 128 bytes a bucket
    assert pack(offset[:0], nbytes[:0], slot_end[:0], 128).tolist() == []


def test_a_plan_that_is_not_over_slices_is_published_whole():
    from weightsync.plan.segments import make_plan

    layout = FlatLayout.from_shapes([("a", (8, 8))], "float32")
    text = make_plan(layout, 2, 2, 1 << 20).to_json()
    assert not is_shares(text) and plan_from_json(text).buckets_of(0)


@pytest.mark.slow
def test_kimi_k2_on_384_gpus_each_ranks_share_is_its_part_of_the_whole_assignment():
    built = setup("kimi-k2", 384, "4xEP32", versions=1)
    holdings = tuple(Holdings.from_json(h) for h in built.holds)
    needs = tuple(needs_from_json(r, n) for r, n in enumerate(built.needs))
    plan = SlicedPlan(built.layout, holdings, needs, built.job.transfer.bucket_bytes)
    shares = share_out(plan)
    pieces = 0
    for t, text in enumerate(shares.trainers):
        whole = pieces_of(plan, t)
        assert np.array_equal(trainer_runs(text)[:, :-2], whole), t
        pieces += len(whole)
    # every piece is in its sender's share and in its receiver's, and in no other
    assert pieces == len(plan.assignment)
    assert sum(len(receiver_runs(text)) for text in shares.inferences) == len(plan.assignment)
    want = plan.assignment.bytes_by_receiver()
    for r, text in enumerate(shares.inferences):
        assert int(receiver_runs(text)[:, NBYTES].sum()) == want[r], r
    assert np.array_equal(receiver_runs(shares.inferences[0]), received(plan, shares.trainers, 0))
    # trainer 0's buckets for receiver 0 are the ones receiver 0 expects from it, and each rank's
    # bytes are the assignment's
    trainer = RankPlan.from_json(shares.header, shares.trainers[0])
    receiver = RankPlan.from_json(shares.header, shares.inferences[0])
    sent = [(b.offset, b.length) for b in trainer.buckets_of(0) if b.receiver == 0]
    assert sent == receiver.expected_for(0)[0]
    assert trainer.sent_bytes(0) >= plan.assignment.bytes_by_sender()[0]  # and the padding between joined runs
    assert sum(n for ranges in receiver.expected_for(0).values() for _, n in ranges) <= receiver.bytes_for(0)
