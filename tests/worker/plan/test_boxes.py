"""Slices and the plan over them: FSDP2 shards and TP slices as torch and transformers cut them
(checked against fully_shard and transformers' own TP styles on a fake process group), every
needed byte painted exactly once from a rank that holds it, balance across replicas, the links'
model, and `weightsync plan --simulate`."""

import json

import numpy as np
import pytest
import torch
import torch.distributed as dist
from support.cli import in_process as weightsync

from weightsync.plan.boxes import Box, GlobalTensor, Slicing, chunk_bounds, join
from weightsync.plan.holders import dim1_where_dim0_is_uneven, sharded
from weightsync.plan.linktime import greedy_order, simulate
from weightsync.plan.pieces import assign_pieces, check_assignment
from weightsync.plan.tp_needs import check_heads, tp_boxes, tp_needs

LLAMA = dict(model_type="llama", num_hidden_layers=2, hidden_size=64, intermediate_size=130, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=101, max_position_embeddings=64)
QWEN2 = dict(model_type="qwen2", num_hidden_layers=2, hidden_size=64, intermediate_size=96, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=99, max_position_embeddings=64)
MOE = dict(model_type="deepseek_v3", num_hidden_layers=2, first_k_dense_replace=1, hidden_size=64,
           intermediate_size=128, moe_intermediate_size=36, n_routed_experts=5, num_experts_per_tok=2,
           num_attention_heads=4, num_key_value_heads=4, vocab_size=100, q_lora_rank=16, kv_lora_rank=16,
           qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, n_group=1, topk_group=1, max_position_embeddings=64)


def build(values, device="meta", **extra):
    from transformers import AutoConfig, AutoModelForCausalLM

    values = {**values, **extra}
    config = AutoConfig.for_model(values.pop("model_type"), **values)
    torch.manual_seed(0)
    with torch.device(device):
        return AutoModelForCausalLM.from_config(config)


def tensors_of(model, dtype="bfloat16"):
    return [GlobalTensor(n, tuple(p.shape), dtype) for n, p in model.named_parameters()]


class FakeWorld:
    """One rank of a fake process group: torch's own sharding code runs in this process for any
    rank of any world size, without peers (only shapes and local slices, no communication)."""

    def __init__(self, rank, world):
        self.rank, self.world = rank, world

    def __enter__(self):
        from torch.distributed.device_mesh import DeviceMesh
        from torch.testing._internal.distributed.fake_pg import FakeStore

        dist.init_process_group("fake", rank=self.rank, world_size=self.world, store=FakeStore())
        return DeviceMesh("cpu", list(range(self.world)))

    def __exit__(self, *exc):
        dist.destroy_process_group()


def region(tensor, boxes):
    """The elements of `tensor` in `boxes` (two boxes: concatenated on the dim where they differ)."""
    parts = [tensor[tuple(slice(a, b) for a, b in zip(box.start, box.stop))] for box in boxes]
    if len(parts) == 1:
        return parts[0]
    dim = next(d for d in range(tensor.dim()) if boxes[0].start[d] != boxes[1].start[d])
    return torch.cat(parts, dim=dim)


# ---------------------------------------------------------------- cutting as torch does


def test_chunk_bounds_are_torch_chunk_padded_with_empty_chunks():
    for size in range(0, 23):
        for chunks in range(1, 9):
            torch_chunks = torch.arange(size).chunk(chunks) if size else ()
            bounds = chunk_bounds(size, chunks)
            assert len(bounds) == chunks
            for i, (a, b) in enumerate(bounds):
                expect = torch_chunks[i].tolist() if i < len(torch_chunks) else []
                assert list(range(a, b)) == expect, (size, chunks, i)


@pytest.mark.parametrize("world", [3, 4])
def test_fsdp2_holdings_are_what_fully_shard_keeps_on_each_rank(world):
    from torch.distributed.fsdp import fully_shard

    shapes = {"a": (10, 3), "b": (7,), "c": (5, 4, 2), "d": (2, 6)}  # uneven, and fewer rows than ranks
    full = {n: torch.arange(int(np.prod(s)), dtype=torch.float32).reshape(s) for n, s in shapes.items()}
    tensors = [GlobalTensor(n, s, "float32") for n, s in shapes.items()]
    holders = sharded(tensors, world)
    for rank in range(world):
        module = torch.nn.Module()
        for n in shapes:
            module.register_parameter(n, torch.nn.Parameter(full[n].clone()))
        with FakeWorld(rank, world) as mesh:
            fully_shard(module, mesh=mesh)
            local = {n: p.to_local() for n, p in module.named_parameters()}
        held = {s.tensor: s.box for s in holders.of_rank(rank).slices}
        for n in shapes:
            if n in held:
                assert torch.equal(local[n], region(full[n], [held[n]])), (rank, n)
            else:
                assert local[n].numel() == 0, (rank, n)


@pytest.mark.parametrize("values,tp", [(LLAMA, 2), (QWEN2, 2), (MOE, 2), (MOE, 4)],
                         ids=["llama-gqa-tp2", "qwen2-bias-tp2", "moe-packed-tp2", "moe-packed-tp4"])
def test_tp_slices_are_what_transformers_shards_on_each_rank(values, tp):
    from transformers.distributed.tensor_parallel import (
        ALL_PARALLEL_STYLES,
        TensorParallelLayer,
        apply_tensor_parallelism,
    )

    ref = build(values, device="cpu")
    full = {n: p.detach().clone() for n, p in ref.named_parameters()}
    plan = ref._expand_parallel_plan(ref._tp_plan)
    # what transformers' own plan shards: each parameter it names with a style that splits it (the
    # base layer's shard_param keeps a parameter whole on every rank, e.g. a per-tensor scale)
    planned = {n for n, style in plan.items()
               if n in full and type(ALL_PARALLEL_STYLES[style]).shard_param is not TensorParallelLayer.shard_param}
    assert planned, f"transformers' plan shards nothing of {values['model_type']}: {ref._tp_plan}"
    needs = tp_needs(tensors_of(ref, "float32"), ref._tp_plan, tp)
    sharded_somewhere = set()
    for rank in range(tp):
        model = build(values, device="cpu")
        with FakeWorld(rank, tp) as mesh:
            apply_tensor_parallelism(model, mesh, model._expand_parallel_plan(model._tp_plan))
            local = {n: (p.to_local() if hasattr(p, "to_local") else p).detach() for n, p in model.named_parameters()}
        boxes = {}
        for s in needs.of_rank(rank).slices:
            boxes.setdefault(s.tensor, []).append(s.box)
        for n, t in full.items():
            assert n in boxes, f"rank {rank} needs nothing of {n}"
            assert torch.equal(local[n], region(t, boxes[n])), (rank, n, boxes[n])
            if local[n].shape != t.shape:
                sharded_somewhere.add(n)
    assert sharded_somewhere == planned, (sorted(sharded_somewhere ^ planned), "sharded, or planned, not both")


def test_tp_slices_of_gqa_projections_and_strided_row_slices():
    model = build(LLAMA)
    needs = tp_needs(tensors_of(model), model._tp_plan, 2)
    got = {s.tensor: s.box for s in needs.of_rank(1).slices}
    assert got["model.layers.0.self_attn.k_proj.weight"] == Box((16, 0), (32, 64))  # kv heads 2 x 16: one head
    assert got["model.layers.0.self_attn.o_proj.weight"] == Box((0, 32), (64, 64))  # row-parallel: dim 1
    assert not got["model.layers.0.self_attn.o_proj.weight"].contiguous_in((64, 64))
    assert got["model.layers.0.mlp.down_proj.weight"] == Box((0, 65), (64, 130))
    assert got["model.embed_tokens.weight"] == Box((51, 0), (101, 64))  # vocabulary-parallel, uneven
    assert got["model.norm.weight"] == Box((0,), (64,))  # not in the plan: needed whole
    whole = tp_needs(tensors_of(model), model._tp_plan, 1)
    assert all(s.box == t.whole() for s, t in zip(whole.of_rank(0).slices, whole.tensors))


def test_bad_tp_input_says_what_to_fix():
    model = build(LLAMA)
    with pytest.raises(ValueError, match=r"TP degree 4 does not divide the model's num_key_value_heads=2.*1, 2"):
        check_heads(model.config, model._tp_plan, 4)
    check_heads(model.config, model._tp_plan, 2)
    t = GlobalTensor("model.layers.0.mlp.up_proj.weight", (8, 4), "float32")
    with pytest.raises(ValueError, match="unknown tensor-parallel style 'diagonal'.*colwise"):
        tp_boxes(t, "diagonal", 2)
    with pytest.raises(ValueError, match="does not hold 2 equal packed blocks"):
        tp_boxes(GlobalTensor("x.gate_up_proj", (3, 7, 4), "float32"), "packed_colwise", 2)


# ---------------------------------------------------------------- coverage, byte by byte


def paint(plan, holders: Slicing, needs: Slicing):
    """Paint every piece onto a per-(receiver, tensor) count array; every needed element must be
    painted exactly once, nothing else at all, and every piece must lie in a box its sender holds."""
    shapes = {t.name: t.shape for t in needs.tensors}
    items = {t.name: t.itemsize for t in needs.tensors}
    held = {s: holders.of_rank(s).slices for s in range(holders.world)}
    counts = {}
    total = 0
    for s in range(plan.senders):
        for piece in plan.pieces_of(s):
            assert any(h.tensor == piece.tensor and h.box.intersect(piece.box) == piece.box for h in held[s]), \
                f"sender {s} does not hold {piece.tensor}{piece.box}"
            assert piece.nbytes == piece.box.numel * items[piece.tensor] <= plan.bucket_bytes
            key = (piece.receiver, piece.tensor)
            if key not in counts:
                counts[key] = np.zeros(shapes[piece.tensor], dtype=np.int32)
            counts[key][tuple(slice(a, b) for a, b in zip(piece.box.start, piece.box.stop))] += 1
            total += 1
    assert total == len(plan)
    for r in range(needs.world):
        want = {}
        for sl in needs.of_rank(r).slices:
            want.setdefault(sl.tensor, np.zeros(shapes[sl.tensor], dtype=np.int32))
            want[sl.tensor][tuple(slice(a, b) for a, b in zip(sl.box.start, sl.box.stop))] += 1
        got = {t: c for (rr, t), c in counts.items() if rr == r}
        assert set(got) == set(want), f"receiver {r}: tensors differ"
        for t in want:
            assert (want[t] == 1).sum() == want[t].astype(bool).sum()  # the needs themselves do not overlap
            assert np.array_equal(got[t], want[t]), f"receiver {r}, {t}: bytes missing or sent twice"


@pytest.mark.parametrize("case", ["fsdp4-to-tp2+tp1", "ddp3-to-tp2", "hsdp2x3-to-tp2+tp1", "moe-fsdp3-to-tp2+tp1",
                                  "tied-fsdp2-to-tp2", "dim1-fsdp4-to-tp2"])
def test_every_needed_byte_comes_from_exactly_one_holder(case):
    values = MOE if case.startswith("moe") else LLAMA
    model = build(values, tie_word_embeddings=True) if case.startswith("tied") else build(values)
    tensors = tensors_of(model)
    plan_styles = model._tp_plan
    if case.startswith("tied"):
        names = [t.name for t in tensors]
        assert "lm_head.weight" not in names and "model.embed_tokens.weight" in names  # one tensor
    holders = {"fsdp4-to-tp2+tp1": lambda: sharded(tensors, 4), "ddp3-to-tp2": lambda: sharded(tensors, 1, 3),
               "hsdp2x3-to-tp2+tp1": lambda: sharded(tensors, 3, 2), "moe-fsdp3-to-tp2+tp1": lambda: sharded(tensors, 3),
               "tied-fsdp2-to-tp2": lambda: sharded(tensors, 2),
               "dim1-fsdp4-to-tp2": lambda: sharded(tensors, 4, 1, dim1_where_dim0_is_uneven(4))}[case]()
    if case.endswith("+tp1"):
        needs = join(tp_needs(tensors, plan_styles, 2), tp_needs(tensors, plan_styles, 1))
    else:
        needs = tp_needs(tensors, plan_styles, 2)
    plan = assign_pieces(holders, needs, bucket_bytes=2048)
    check_assignment(plan, needs)
    paint(plan, holders, needs)
    assert plan.bytes_by_receiver().tolist() == needs.bytes_of_rank()


def test_the_plan_from_what_ranks_publish_equals_the_plan_from_the_layouts():
    model = build(LLAMA)
    tensors = tensors_of(model)
    holders = sharded(tensors, 3, 2)
    needs = join(tp_needs(tensors, model._tp_plan, 2), tp_needs(tensors, model._tp_plan, 1))
    published_h = Slicing.from_ranks(tensors, [holders.of_rank(r) for r in range(holders.world)], holders.world)
    published_n = Slicing.from_ranks(tensors, [needs.of_rank(r) for r in range(needs.world)], needs.world)
    a = assign_pieces(holders, needs, 4096)
    b = assign_pieces(published_h, published_n, 4096)
    for s in range(holders.world):
        assert a.pieces_of(s) == b.pieces_of(s)


def test_holdings_that_miss_or_overlap_are_refused_with_the_tensor_named():
    t = [GlobalTensor("w", (8, 4), "float32")]
    needs = tp_needs(t, {}, 1)
    from weightsync.plan.boxes import RankSlices, Slice

    gap = Slicing.from_ranks(t, [RankSlices(0, (Slice("w", Box((0, 0), (3, 4))),)),
                                 RankSlices(1, (Slice("w", Box((4, 0), (8, 4))),))], 2)
    with pytest.raises(ValueError, match=r"tensor w: .*need \[0:8, 0:4\] \(32 elements\) but the trainer ranks hold 28"):
        assign_pieces(gap, needs, 1024)
    overlap = Slicing.from_ranks(t, [RankSlices(0, (Slice("w", Box((0, 0), (5, 4))),)),
                                     RankSlices(1, (Slice("w", Box((4, 0), (8, 4))),))], 2)
    with pytest.raises(ValueError, match="tensor w: trainer ranks hold overlapping but different boxes"):
        assign_pieces(overlap, needs, 1024)


# ---------------------------------------------------------------- balance and order


def qwen_like():
    """Qwen2-0.5B's shapes (24 layers, hidden 896, 14 heads / 2 KV heads, vocab 151936, tied)."""
    return build(dict(model_type="qwen2", num_hidden_layers=24, hidden_size=896, intermediate_size=4864,
                      num_attention_heads=14, num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True))


@pytest.mark.parametrize("shard,replicas,tp,inference_replicas", [(4, 2, 2, 2), (1, 6, 1, 4), (8, 1, 2, 2)],
                         ids=["hsdp2x4-to-2xtp2", "ddp6-to-4xtp1", "fsdp8-to-2xtp2"])
def test_senders_are_balanced_within_five_percent(shard, replicas, tp, inference_replicas):
    model = qwen_like()
    tensors = tensors_of(model)
    holders = sharded(tensors, shard, replicas)
    needs = tp_needs(tensors, model._tp_plan, tp, inference_replicas)
    plan = assign_pieces(holders, needs, 64 << 20)
    check_assignment(plan, needs)
    senders, receivers = plan.balance()
    assert senders <= 1.05, plan.table()
    assert plan.bytes_by_receiver().tolist() == needs.bytes_of_rank()
    text = plan.table()
    assert f"balance (max / mean): senders {senders:.3f}, receivers {receivers:.3f}" in text


def test_senders_start_on_different_receivers():
    model = build(LLAMA)
    tensors = tensors_of(model)
    plan = assign_pieces(sharded(tensors, 4), tp_needs(tensors, model._tp_plan, 1, 4), 1 << 20)
    firsts = [plan.pieces_of(s)[0].receiver for s in range(4)]
    assert sorted(firsts) == [0, 1, 2, 3]
    for s in range(4):  # all a sender owes one receiver goes as one stream
        receivers = [p.receiver for p in plan.pieces_of(s)]
        runs = [r for i, r in enumerate(receivers) if i == 0 or receivers[i - 1] != r]
        assert len(runs) == len(set(runs)) == 4


def test_uniform_all_to_all_runs_at_the_speed_of_light_and_a_queue_does_not():
    pairs = np.full((4, 4), 1000.0)
    one_at_a_time = greedy_order(pairs, window=1)
    assert sorted(one_at_a_time[:, 0].tolist()) == [0, 1, 2, 3]  # a Latin square: each receiver one sender at a time
    fast = simulate(pairs, one_at_a_time, bandwidth=1000.0, window=1)
    assert fast.speed_of_light == pytest.approx(4.0) and fast.seconds == pytest.approx(4.0)
    queue = simulate(pairs, np.tile(np.arange(4), (4, 1)), bandwidth=1000.0, window=1)  # all start on receiver 0
    assert queue.seconds == pytest.approx(16.0) and queue.over_light == pytest.approx(4.0)
    assert simulate(pairs, greedy_order(pairs), bandwidth=1000.0).seconds == pytest.approx(4.0)
    jittered = simulate(pairs, greedy_order(pairs), bandwidth=1000.0, jitter=0.01, seed=1)
    assert 4.0 * 0.99 <= jittered.seconds <= 4.0 * 1.01


def test_a_stream_runs_at_the_share_of_its_more_crowded_end():
    # sender 0 owes receivers 0 and 1; sender 1 owes receiver 1 only: receiver 1 splits its NIC
    pairs = np.array([[1000.0, 1000.0], [0.0, 1000.0]])
    t = simulate(pairs, np.array([[0, 1], [0, 0]]), bandwidth=1000.0, window=2)
    # all three streams at 500 B/s (sender 0 has two, receiver 1 has two): 2 s, as the speed of light
    assert t.seconds == pytest.approx(2.0) and t.speed_of_light == pytest.approx(2.0)


def test_expert_parallel_ranks_need_their_experts_whole_and_the_rest_by_the_tp_plan():
    """vLLM's default placement: rank i of a replica of EP degree e holds experts [i*E/e, (i+1)*E/e)."""
    model = build(MOE, n_routed_experts=4)
    tensors = tensors_of(model)
    needs = tp_needs(tensors, model._tp_plan, 2, replicas=2, ep=4, experts=4)
    tp_only = tp_needs(tensors, model._tp_plan, 2)
    assert needs.world == 8
    for i, t in enumerate(tensors):
        per_rank = {r: [b for b, ranks in zip(needs.placements[i].boxes, needs.placements[i].ranks) if r in ranks]
                    for r in range(8)}
        if t.name.endswith((".experts.gate_up_proj", ".experts.down_proj")):
            for r in range(8):
                (box,) = per_rank[r]
                assert box.start[0] == (r % 4) and box.stop[0] == (r % 4) + 1 and box.shape[1:] == t.shape[1:]
        else:  # rank r is TP rank r % 2 of its data-parallel group
            want = {r: [b for b, ranks in zip(tp_only.placements[i].boxes, tp_only.placements[i].ranks) if r in ranks]
                    for r in range(2)}
            assert all(per_rank[r] == want[r % 2] for r in range(8)), t.name
    check_assignment(assign_pieces(sharded(tensors, 4), needs, 1 << 20), needs)


def test_simulate_with_expert_parallelism_states_each_gpus_share_of_the_experts(tmp_path):
    config = tmp_path / "config.json"
    config.write_text(json.dumps({**MOE, "n_routed_experts": 8}))
    out = weightsync("plan", "--simulate", str(config), "--trainers", "4", "--inference", "2xTP2xEP4", "--bucket-mb", "1")
    assert out.returncode == 0, out.stderr
    assert "2 replicas x TP2xEP4 = 8 GPUs" in out.stdout and "experts: 8 routed per layer" in out.stdout, out.stdout
    assert "of them (0.2500)" in out.stdout, out.stdout
    dp = weightsync("plan", "--simulate", str(config), "--trainers", "4", "--inference", "1xEP8", "--bucket-mb", "1")
    assert dp.returncode == 0 and "1 replicas x TP1xEP8 = 8 GPUs" in dp.stdout and "(0.1250)" in dp.stdout, dp.stderr


def test_simulate_in_fp8_plans_the_quantized_weights_and_their_scales_the_experts_placed_with_their_scales(tmp_path):
    from weightsync.plan.simulate import Topology, global_tensors, meta_model, model_config, run

    config = tmp_path / "config.json"
    config.write_text(json.dumps({**MOE, "n_routed_experts": 8, "moe_intermediate_size": 256}))
    tensors = {t.name: t for t in global_tensors(meta_model(model_config(str(config))),
                                                  Topology(4, 4, 1, 1, 1e9, ep=8, quantization="fp8"))}
    stacks = [n for n in tensors if n.endswith(".experts.gate_up_proj") or n.endswith(".experts.down_proj")]
    assert stacks and all(tensors[n].dtype == "float8_e4m3fn" for n in stacks)
    assert tensors[stacks[0] + "_scale_inv"].shape == (8, 4, 1) and tensors[stacks[0] + "_scale_inv"].dtype == "float32"
    assert tensors["model.embed_tokens.weight"].dtype == "bfloat16" and "lm_head.weight_scale_inv" not in tensors
    bf16 = weightsync("plan", "--simulate", str(config), "--trainers", "4", "--inference", "1xEP8", "--bucket-mb", "1")
    fp8 = weightsync("plan", "--simulate", str(config), "--trainers", "4", "--inference", "1xEP8", "--bucket-mb", "1",
                     "--dtype", "fp8")
    assert fp8.returncode == 0 and "with fp8 linear weights and their float32 scales" in fp8.stdout, fp8.stderr
    assert "(0.1250)" in fp8.stdout, fp8.stdout  # each GPU: its eighth of the experts, scales included
    assert bf16.returncode == 0, bf16.stderr
    busiest = [run(str(config), Topology(4, 4, 1, 1, 1e9, bucket_bytes=1 << 20, ep=8, quantization=q))["busiest_receiver_bytes"]
               for q in (None, "fp8")]
    assert busiest[1] < 0.75 * busiest[0], busiest  # the norms, routers and embeddings stay bfloat16


# a Llama whose TP2 slices hold whole 128x128 blocks (head size 128); at TP4 gate_proj's 192 rows
# per rank cut them
FP8_LLAMA = dict(model_type="llama", num_hidden_layers=1, hidden_size=512, intermediate_size=768, num_attention_heads=4,
                 num_key_value_heads=4, vocab_size=128, max_position_embeddings=64)


@pytest.mark.parametrize("fmt, values", [("int8", LLAMA), ("fp8", FP8_LLAMA)])
def test_a_quantized_weights_scales_follow_its_tp_slices(fmt, values):
    """Every rank needs the scales of exactly the box it needs of the weight: the per-row int8 scales
    of its rows (all of them for a row-parallel weight), the fp8 blocks its box covers."""
    from weightsync.model.quant import FORMATS
    from weightsync.plan.simulate import Topology, global_tensors

    f = FORMATS[fmt]
    model = build(values)
    tensors = global_tensors(model, Topology(2, 2, 1, 2, 1e9, quantization=fmt))
    needs = tp_needs(tensors, model._tp_plan, 2, fmt=f)
    boxes = {t.name: p for t, p in zip(needs.tensors, needs.placements)}
    per_rank = {r: {s.tensor: s.box for s in needs.of_rank(r).slices} for r in range(2)}
    scales = [t for t in tensors if f.weight_of(t.name) in boxes]
    assert scales and all(t.dtype == "float32" for t in scales)
    for t in scales:
        weight = next(w for w in tensors if w.name == f.weight_of(t.name))
        for r in range(2):
            w = per_rank[r][weight.name]
            start, stop = f.scale_bounds(weight.name, weight.shape, w.start, w.stop)
            assert per_rank[r][t.name] == Box(start, stop), (t.name, r)
    q, o = "model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.o_proj.weight"
    # rank 1: q_proj's rows from the middle on, so its scales from the middle row (int8) or block (fp8)
    assert per_rank[1][q + f.scale_suffix].start[0] == {"int8": 32, "fp8": 2}[fmt]
    assert len(boxes[o + f.scale_suffix].boxes) == (1 if fmt == "int8" else 2)  # int8: every rank all of o_proj's rows
    check_assignment(assign_pieces(sharded(tensors, 2), needs, 1 << 20), needs)


def test_an_fp8_tp_slice_that_cuts_a_block_is_refused_on_one_line_naming_the_weight(tmp_path):
    from weightsync.model.quant import FORMATS
    from weightsync.plan.simulate import Topology, global_tensors

    model = build(FP8_LLAMA)
    tensors = global_tensors(model, Topology(2, 2, 1, 4, 1e9, quantization="fp8"))
    with pytest.raises(ValueError) as e:
        tp_needs(tensors, model._tp_plan, 4, fmt=FORMATS["fp8"])
    assert "\n" not in str(e.value) and "rows [0, 192) of model.layers.0.mlp.gate_proj.weight [768, 512]" in str(e.value)
    assert "cut its 128x128 blocks" in str(e.value) and "tensor-parallel rank 0 of 4" in str(e.value)
    config = tmp_path / "config.json"
    config.write_text(json.dumps(FP8_LLAMA))
    planned = weightsync("plan", "--simulate", str(config), "--trainers", "2", "--inference", "2xTP2", "--bucket-mb", "1",
                         "--dtype", "fp8")
    assert planned.returncode == 0 and "every receiver gets exactly its bytes" in planned.stdout, planned.stderr
    refused = weightsync("plan", "--simulate", str(config), "--trainers", "2", "--inference", "1xTP4", "--dtype", "fp8")
    assert refused.returncode == 2 and "model.layers.0.mlp.gate_proj.weight" in refused.stderr, refused.stderr
    assert len(refused.stderr.strip().splitlines()) == 1, refused.stderr


@pytest.mark.parametrize("inference, values, message", [
    ("2xTP4xEP2", {"n_routed_experts": 8}, "the expert-parallel degree 2 must be a multiple of the TP degree 4"),
    ("1xEP3", {"n_routed_experts": 8}, "divide the model's 8 routed experts"),
    ("1xEP2", LLAMA, "has no experts to place with expert parallelism"),
])
def test_simulate_refuses_expert_parallel_layouts_vllm_would_not_run(tmp_path, inference, values, message):
    config = tmp_path / "config.json"
    config.write_text(json.dumps(values if "model_type" in values else {**MOE, **values}))
    out = weightsync("plan", "--simulate", str(config), "--trainers", "2", "--inference", inference)
    assert out.returncode == 2 and message in out.stderr, out.stderr


# ---------------------------------------------------------------- the command


def test_simulate_prints_balance_busiest_nic_projection_and_speed_of_light(tmp_path):
    config = tmp_path / "config.json"
    config.write_text(json.dumps(LLAMA))
    out = weightsync("plan", "--simulate", str(config), "--trainers", "8", "--fsdp", "4", "--inference", "3xTP2",
                     "--nic", "100gbit", "--bucket-mb", "1")
    assert out.returncode == 0, out.stderr
    text = out.stdout
    for field in ("balance (max / mean): senders", "busiest NIC", "speed of light:", "projected:",
                  "x the speed of light", "computed in", "HSDP 2 x FSDP2 degree 4", "3 replicas x TP2 = 6 GPUs",
                  "every receiver gets exactly its bytes", "jittered by +-0.1%"):
        assert field in text, field
    assert len([line for line in text.splitlines() if line.startswith("receiver")]) == 1


@pytest.mark.parametrize("args,message", [
    (["--simulate", "gpt-9"], "not a built-in model (kimi-k2, deepseek-v3, qwen3-235b-a22b, llama-3-70b)"),
    (["--simulate", "llama-3-70b", "--inference", "8 by 16"], "write replicas x TP degree, for example 8xTP16"),
    (["--simulate", "llama-3-70b", "--trainers", "10", "--fsdp", "4"], "--fsdp 4 must divide --trainers 10"),
    (["--simulate", "llama-3-70b", "--nic", "400X"], "--nic: link rate '400X' is not a number with bit"),
    ([], "give a job file, or --simulate MODEL"),
])
def test_simulate_refuses_bad_input_with_what_to_fix(args, message):
    out = weightsync("plan", *args)
    assert out.returncode == 2 and message in out.stderr, out.stderr


def test_simulate_refuses_a_tp_degree_that_splits_heads(tmp_path):
    config = tmp_path / "config.json"
    config.write_text(json.dumps(LLAMA))
    out = weightsync("plan", "--simulate", str(config), "--trainers", "4", "--inference", "2xTP4")
    assert out.returncode == 2
    assert "TP degree 4 does not divide the model's num_key_value_heads=2" in out.stderr, out.stderr


def test_simulate_refuses_tp_for_a_model_transformers_has_no_tp_plan_for(tmp_path):
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"model_type": "gpt2", "n_layer": 1, "n_embd": 32, "n_head": 2, "vocab_size": 64}))
    out = weightsync("plan", "--simulate", str(config), "--trainers", "2", "--inference", "2xTP2")
    assert out.returncode == 2
    assert "GPT2LMHeadModel has no tensor-parallel plan in transformers" in out.stderr, out.stderr
    assert "--inference 4xTP1" in out.stderr
    ok = weightsync("plan", "--simulate", str(config), "--trainers", "2", "--inference", "4xTP1")
    assert ok.returncode == 0 and "2 trainer rank(s) -> 4 inference rank(s)" in ok.stdout, ok.stderr
