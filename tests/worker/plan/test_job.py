"""Which plan a job gets (plan/job.py), from what its ranks hold and need, and `weightsync plan job.yaml`
for jobs whose trainers hold FSDP2 shards and whose inference replicas mix tensor-parallel degrees."""
import pytest
import torch
import yaml
from support.cli import in_process as weightsync

from weightsync.cli import job_plan
from weightsync.job import API_VERSION, KIND, Job, load_job
from weightsync.model.flat import FlatLayout
from weightsync.plan.holders import Holdings
from weightsync.plan.job import fsdp_holdings, inference_needs, make_job_plan
from weightsync.plan.segments import Plan
from weightsync.plan.sliced_plan import SlicedPlan, needs_everything
from weightsync.transport import capabilities_of

# vocab 1001 and intermediate 700 do not split evenly over 4 trainer ranks or 2 TP ranks
CONFIG = {"model_type": "llama", "vocab_size": 1001, "hidden_size": 256, "intermediate_size": 700,
          "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2}


def job(inference: dict) -> Job:
    return load_job({"apiVersion": API_VERSION, "kind": KIND, "metadata": {"name": "tp"},
                              "spec": {"model": {"config": CONFIG, "dtype": "bfloat16"},
                                       "trainer": {"replicas": 2, "procsPerPod": 2},
                                       "inference": inference, "transfer": {"bucketMB": 1}}})


def over(transport: str) -> dict:
    """What the planner is told of a transport, as the controller tells it."""
    can = capabilities_of(transport)
    return {"transport": transport, "scatters": can.scatters, "range_limit": can.range_limit}


def test_fsdp_holdings_are_torch_chunks_rows_and_hsdp_repeats_them():
    layout = FlatLayout.from_shapes([("a", (10, 3)), ("b", (3,)), ("c", (1, 4)), ("d", ())], "float32")
    for shard in (1, 2, 3, 4):
        for index, held in enumerate(fsdp_holdings(layout, shard, shard)):
            for (first, end), slot in zip(held.rows, layout.slots):
                rows = torch.arange(slot.shape[0] if slot.shape else 1)
                chunks = torch.chunk(rows, shard)
                want = chunks[index].tolist() if index < len(chunks) else []
                assert list(range(first, end)) == want, (slot.name, shard, index)
    hsdp = fsdp_holdings(layout, 4, 2)
    assert hsdp[0] == hsdp[2] != hsdp[1] == hsdp[3]
    assert fsdp_holdings(layout, 3, 1) == [Holdings.whole(layout)] * 3


def test_the_planner_follows_what_the_ranks_hold_and_need():
    layout = FlatLayout.from_shapes([("a", (10, 64)), ("b", (7, 32))], "float32")
    whole = make_job_plan(layout, fsdp_holdings(layout, 2, 1), 3, 4096)
    assert isinstance(whole, Plan) and [b.trainer for b in whole.buckets] == [0, 1]  # one segment each, across tensors
    shards = make_job_plan(layout, fsdp_holdings(layout, 2, 2), 3, 4096)
    assert isinstance(shards, Plan)  # by holder: trainer rank 1 sends rows 5..9 of "a", never rows it lacks
    assert {(b.trainer, b.offset) for b in shards.buckets if b.offset < layout.slots[0].nbytes} == {(0, 0), (1, 5 * 64 * 4)}
    # over tcp a bucket bundles a rank's runs of both tensors; nccl and uccl land a frame in one run
    assert [(b.trainer, len(b.spans)) for b in shards.buckets] == [(0, 2), (1, 2)]
    for transport in ("nccl", "uccl"):
        alone = make_job_plan(layout, fsdp_holdings(layout, 2, 2), 3, 4096, **over(transport))
        assert [(b.trainer, len(b.spans)) for b in alone.buckets] == [(0, 1), (1, 1), (0, 1), (1, 1)]
    with pytest.raises(ValueError, match="too large for the uccl transport, which moves at most 4294967295 bytes"):
        make_job_plan(layout, fsdp_holdings(layout, 2, 1), 3, 4096 << 20, **over("uccl"))
    assert make_job_plan(layout, fsdp_holdings(layout, 2, 1), 3, 4096 << 20, **over("nccl")).bucket_bytes == 4096 << 20
    needs = (needs_everything(layout, 0), needs_everything(layout, 1))
    sliced = make_job_plan(layout, fsdp_holdings(layout, 2, 2), 2, 4096, needs)
    assert isinstance(sliced, SlicedPlan) and sliced.bytes_by_receiver() == [layout.total_bytes] * 2


def test_a_job_of_mixed_tensor_parallel_degrees_is_planned_over_slices():
    mixed = job({"replicas": 3, "tensorParallelSizes": [2, 1]})
    plan = job_plan(mixed, fsdp=4)
    assert isinstance(plan, SlicedPlan) and (plan.trainers, plan.inferences) == (4, 3)
    received = plan.bytes_by_receiver()
    assert received[2] == plan.version_bytes  # the TP1 replica gets the whole version
    assert received[0] < plan.version_bytes // 2 + plan.version_bytes // 8 and received[1] < received[2]
    for trainer, held in enumerate(plan.holdings):
        assert held == Holdings.fsdp(plan.layout, 4, trainer)
    # the TP ranks' needs are the model's own TP plan: a row-parallel weight is cut on dim 1
    o_proj = {r: {s.tensor: s.box for s in plan.needs[r].slices}["model.layers.0.self_attn.o_proj.weight"] for r in (0, 1)}
    assert (o_proj[0].start, o_proj[0].stop, o_proj[1].start, o_proj[1].stop) == ((0, 0), (256, 128), (0, 128), (256, 256))
    assert inference_needs(job({"replicas": 2}).layout, plan.layout, lambda r: None) is None


def test_plan_prints_every_sender_and_receiver_of_a_tensor_parallel_job(tmp_path):
    path = tmp_path / "tp.yaml"
    path.write_text(yaml.safe_dump({"apiVersion": API_VERSION, "kind": KIND, "metadata": {"name": "tp"},
                                    "spec": {"model": {"config": CONFIG, "dtype": "bfloat16"},
                                             "trainer": {"replicas": 2, "procsPerPod": 2},
                                             "inference": {"replicas": 3, "tensorParallelSizes": [2, 1]}}}))
    out = weightsync("plan", str(path), "--fsdp", "4")
    assert out.returncode == 0, out.stderr
    assert "4 trainer rank(s) -> 3 inference rank(s)" in out.stdout
    lines = out.stdout.splitlines()
    senders = lines[lines.index(next(line for line in lines if line.strip().startswith("sender"))) + 1:][:4]
    assert [line.split()[0] for line in senders] == ["0", "1", "2", "3"]
    assert any(line.strip().startswith("receiver") for line in lines) and "balance (max / mean): senders" in out.stdout
    wrong = weightsync("plan", str(path), "--fsdp", "3")
    assert wrong.returncode == 2 and "the FSDP degree 3 must divide the job's 4 trainer ranks" in wrong.stderr
