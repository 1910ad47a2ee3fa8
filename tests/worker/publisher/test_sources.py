"""What a trainer rank sends from: a plain or DDP module's parameters under their Hugging Face names,
and for FSDP2 (fully_shard, gloo ranks on CPU) only each rank's local shard, uneven last shards
included: the bytes each rank fills for its buckets equal the unsharded model's, quantized (int8)
too, each rank quantizing only the rows it holds, and no DTensor is ever gathered (full_tensor and
redistribute raise in the ranks)."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from support.tiers import first_in_unit

from weightsync.model.flat import FlatLayout, fill_range, range_views
from weightsync.plan.holders import Holdings, plan_by_holder
from weightsync.plan.segments import make_plan
from weightsync.publisher.sources import local_tensors, sources_of, version_name

# Sizes that 2, 3 and 4 ranks do not divide: vocab 101, 2 KV heads of 12, intermediate 70.
CONFIG = dict(vocab_size=101, hidden_size=48, intermediate_size=70, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=32, tie_word_embeddings=True)


def tiny_model():
    from transformers import AutoModelForCausalLM, Qwen2Config

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(Qwen2Config(**CONFIG))


def test_wrapper_prefixes_are_dropped_and_tied_weights_listed_once():
    assert version_name("module._orig_mod.model.layers.0.mlp.up_proj.weight") == "model.layers.0.mlp.up_proj.weight"
    assert version_name("model.module_list.0.weight") == "model.module_list.0.weight"
    model = tiny_model()
    sources = sources_of(torch.compile(model), "bfloat16")
    assert sources.holdings is None and sources.starts is None
    names = [s.name for s in sources.layout.slots]
    assert names == [n for n, _ in model.named_parameters()] and "lm_head.weight" not in names  # tied to the embedding
    assert local_tensors(model, sources)[0] is not None


def sent_by(model, dtype: str, rank: int, world: int, quantization: str | None = None):
    """What this rank holds of `model` (sources_of) and the bytes it fills into each of its buckets
    (offset -> bytes), planned over every rank's holdings as the controller plans them."""
    sources = sources_of(model, dtype, quantization=quantization)
    params = local_tensors(model, sources)
    everyone = [None] * world
    dist.all_gather_object(everyone, sources.holdings.to_json())  # what the controller gets in the join
    holdings = {r: Holdings.from_json(h) for r, h in enumerate(everyone)}
    plan = plan_by_holder(sources.layout, holdings, inferences=1, bucket_bytes=1024)
    filled = {}
    for b in plan.buckets_of(rank):
        data = torch.empty(b.length, dtype=torch.uint8)
        fill_range(sources.layout, params, b.offset, b.end, data, sources.starts)
        if dtype == "float32":  # sent in place, straight from the shard's memory
            assert b"".join(bytes(v) for v in range_views(sources.layout, params, b.offset, b.end, sources.starts)) \
                == bytes(data.numpy())
        filled[b.offset] = data
    return sources, filled


def never_gathered() -> None:
    """In a rank's process: any DTensor gathered from here on fails the test (publishing reads a
    rank's own shards and nothing else)."""
    from torch.distributed.tensor import DTensor

    def gathered(*_a, **_k):
        raise AssertionError("a DTensor was gathered")

    DTensor.full_tensor = gathered
    DTensor.redistribute = gathered


def fsdp_tiny_model():
    """tiny_model with FSDP2 over each layer and the whole, in a rank's process, never gathered."""
    from torch.distributed.fsdp import fully_shard

    model = tiny_model()
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    never_gathered()
    return model


def _fsdp_rank(rank: int, world: int, init: str, out: str, dtype: str, quantized: bool) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    try:
        model = fsdp_tiny_model()
        sources, filled = sent_by(model, dtype, rank, world)
        mesh = init_device_mesh("cpu", (world,))
        refused = None
        try:
            tp = torch.nn.Linear(8, 6)
            tp.weight = torch.nn.Parameter(distribute_tensor(tp.weight.detach(), mesh, [Shard(1)]))
            sources_of(tp, dtype)
        except ValueError as e:
            refused = str(e)
        saved = {"filled": filled, "holdings": sources.holdings.to_json(), "layout": sources.layout.to_json(),
                 "refused": refused}
        if quantized:  # the same shards again, each rank quantizing its own rows (int8), and fp8 refused
            sources, filled = sent_by(model, dtype, rank, world, "int8")
            try:
                sources_of(model, dtype, quantization="fp8")
                refused = None
            except ValueError as e:
                refused = str(e)
            saved["quantized"] = {"filled": filled, "layout": sources.layout.to_json(), "refused": refused}
        torch.save(saved, os.path.join(out, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


# two casts, and shards of uneven rows (101 over 3 ranks: 34, 34, 33); Shard(0) rows sent uncast
# (float32) are the expert-parallel test's below, on a 2-D mesh of four ranks; the two ranks in
# bfloat16 also quantize their shards (check_quantized), sparing two more processes a test of its own
@pytest.mark.parametrize("world,dtype", first_in_unit([(2, "bfloat16"), (3, "float16")]))
def test_fsdp2_ranks_send_only_their_shards_and_together_the_whole_version(tmp_path, world, dtype):
    quantized = dtype == "bfloat16"
    mp.start_processes(_fsdp_rank, args=(world, str(tmp_path / "init"), str(tmp_path), dtype, quantized),
                       nprocs=world, start_method="spawn")
    model = tiny_model()
    layout = FlatLayout.from_named_tensors(model.named_parameters(), dtype)
    reference = torch.zeros(layout.total_bytes, dtype=torch.uint8)
    fill_range(layout, [p.detach() for p in model.parameters()], 0, layout.total_bytes, reference)
    got = [torch.load(tmp_path / f"rank{r}.pt") for r in range(world)]
    assert all(FlatLayout.from_json(g["layout"]) == layout for g in got)
    sent = 0
    for r, g in enumerate(got):
        rows = Holdings.from_json(g["holdings"]).rows
        assert rows[0] != (0, 101) and rows[0][1] - rows[0][0] in (-(-101 // world), 101 - (world - 1) * -(-101 // world))
        for offset, data in g["filled"].items():
            assert torch.equal(data, reference[offset:offset + data.numel()]), f"rank {r}, bytes at {offset}"
            sent += data.numel()
        assert "Shard(dim=1)" in g["refused"] and "not supported" in g["refused"]
    assert sent == layout.payload_bytes  # every byte of every tensor, once
    assert make_plan(layout, world, 1, 1024).version_bytes == layout.total_bytes
    if quantized:
        check_quantized([g["quantized"] for g in got])


# a mixture of experts: 6 experts over 2 expert-parallel ranks, each group of 3 again over 2 FSDP ranks (2 and 1)
MOE = dict(model_type="qwen3_moe", vocab_size=101, hidden_size=48, intermediate_size=64, moe_intermediate_size=24,
           num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
           num_experts=6, num_experts_per_tok=2)


def moe_model():
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    values = dict(MOE)
    return AutoModelForCausalLM.from_config(AutoConfig.for_model(values.pop("model_type"), **values))


def _ep_rank(rank: int, world: int, init: str, out: str) -> None:
    """Expert parallelism as torchtitan lays it out: a 2-D mesh (ep, fsdp); the experts' stacks
    Shard(0) over ep and again Shard(0) over fsdp, every other parameter replicated over ep and
    Shard(0) over fsdp."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    try:
        model = moe_model()
        mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("ep", "fsdp"))
        for module in model.modules():
            for name, p in list(module._parameters.items()):
                if p is None:
                    continue
                placements = [Shard(0), Shard(0)] if p.dim() == 3 else [Replicate(), Shard(0)]
                module._parameters[name] = torch.nn.Parameter(distribute_tensor(p.detach(), mesh, placements))
        never_gathered()
        sources, filled = sent_by(model, "float32", rank, world)
        torch.save({"filled": filled, "holdings": sources.holdings.to_json()}, os.path.join(out, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.mark.slow  # four processes: `make test`, beside the first FSDP2 case in `make unit`
def test_expert_parallel_ranks_on_a_2d_mesh_send_only_their_experts_and_together_the_whole_version(tmp_path):
    world = 4
    mp.start_processes(_ep_rank, args=(world, str(tmp_path / "init"), str(tmp_path)), nprocs=world, start_method="spawn")
    model = moe_model()
    layout = FlatLayout.from_named_tensors(model.named_parameters(), "float32")
    reference = torch.zeros(layout.total_bytes, dtype=torch.uint8)
    fill_range(layout, [p.detach() for p in model.parameters()], 0, layout.total_bytes, reference)
    stacks = [i for i, s in enumerate(layout.slots) if len(s.shape) == 3]
    assert stacks, "the model has no stacked experts"
    sent = 0
    for r in range(world):
        got = torch.load(tmp_path / f"rank{r}.pt")
        rows = Holdings.from_json(got["holdings"]).rows
        ep, fsdp = divmod(r, 2)
        # experts [3 ep, 3 ep + 3) of the ep rank, then torch.chunk's 2 and 1 of them for the fsdp rank
        assert all(rows[i] == (3 * ep + 2 * fsdp, 3 * ep + (2 if fsdp == 0 else 3)) for i in stacks), rows
        for offset, data in got["filled"].items():
            assert torch.equal(data, reference[offset:offset + data.numel()]), f"rank {r}, bytes at {offset}"
            sent += data.numel()
    assert sent == layout.payload_bytes  # every byte of every tensor, once


def check_quantized(got: list[dict]) -> None:
    """int8 per channel: each rank quantized only the rows it holds, and together they sent the
    bytes of the whole model quantized; fp8 blocks of 128 rows that a rank's shard cuts are refused."""
    from weightsync.model.build import layout_of

    model = tiny_model()
    layout = layout_of(model, "bfloat16", "int8")
    whole = sources_of(model, "bfloat16", quantization="int8")
    reference = torch.zeros(layout.total_bytes, dtype=torch.uint8)
    fill_range(layout, local_tensors(model, whole), 0, layout.total_bytes, reference)
    sent = 0
    for r, g in enumerate(got):
        assert FlatLayout.from_json(g["layout"]) == layout
        for offset, data in g["filled"].items():
            assert torch.equal(data, reference[offset:offset + data.numel()]), f"rank {r}, quantized bytes at {offset}"
            sent += data.numel()
        assert "cut its 128x128 blocks" in g["refused"] and "\n" not in g["refused"], g["refused"]
    assert sent == layout.payload_bytes
