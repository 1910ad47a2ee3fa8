"""Mixtures of experts through vLLM's own tensor and expert parallelism, for real: three jobs on
vLLM's CPU build, each one trainer rank into one vLLM server of two workers, run once for the
module.

- qwen2_moe (routed experts, a shared expert and its gate, the router's gate) at tensor-parallel
  size 2: each worker holds every expert's half of the intermediate dimension;
- a DeepSeek-V3-shaped model (MLA attention, a dense first layer, shared and routed experts) at
  tensor-parallel size 2 with expert parallelism (spec.inference.vllm.expertParallel): each worker
  holds 4 of the 8 experts whole and nothing of the other 4;
- qwen3_moe quantized to int8 (spec.model.quantization: compressed-tensors W8A8, per-row scales) at
  tensor-parallel size 2 with expert parallelism: each worker holds its half of the attention's
  int8 weights with their rows' scales and 4 of the 8 int8 experts whole with all of their scales,
  in vLLM's int8 MoE kernel (CPUExpertsInt8 on a CPU with AMX tiles, which it packs for its tiles:
  read back from that packing, vllm_backend/served.py). Its model is an int8 checkpoint, experts
  one tensor each with their scales; the trainer dequantizes it, and quantizing those weights again
  gives the checkpoint's bytes, so that version 0 is its weights. Version 1 is compared, once
  delivered, with vLLM's own reload of version 1's checkpoint from disk in the same server.

Each job's model is a checkpoint of its model (spec.model.path), the experts one tensor each as
published checkpoints name them (vLLM's loaders of both models read them, transformers stacks them
into one tensor of every expert per projection for the trainer): the server starts on it as vLLM
alone would, loading it from disk itself, and the trainer starts from it, so that version 0 is
its weights.

What is checked after each version: every worker's parameters equal the trainer's bytes as vLLM
lays them out (stated here independently of the backend: every parameter of qwen2_moe, the expert
layers of the DeepSeek-shaped model, whose MLA vLLM fuses and derives its own way); each worker
receives exactly the slices that layout gives it, half of the routed experts' bytes. Before any
version the server's weights, as vLLM loaded them from the checkpoint, are checksummed and then
zeroed by vLLM's weight checker; once version 0 is loaded, vLLM's own compare finds them equal to
that load from disk, and (tensor parallelism) the server answers the same greedy tokens as it did
then. The expert-parallel server is compared by weights alone: vLLM 0.32's CPU fused-MoE kernel
crashes at the first generation under expert parallelism (csrc/cpu/cpu_fused_moe.cpp), with or
without weightsync, and so does its int8 linear kernel for AMX at float32 ("expect A to be bfloat16
or half").
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import pytest
import torch
from support.checkpoint_tensors import EXPERT_STACK, one_per_expert, quantized
from support.vllm import (
    LLAMA,
    REACH_TIMEOUT,
    VllmRun,
    amx_tiles,
    as_bytes,
    checker,
    checksums_then_reset,
    completion,
    post,
    refused_before_version_0,
    save_checkpoint,
    shards,
    vllm_job,
    vllm_python,
)

from weightsync.job import Model
from weightsync.model.build import build, meta_layout
from weightsync.model.flat import ITEMSIZE, torch_dtype
from weightsync.model.quant import quantized_names
from weightsync.plan.boxes import Box, RankSlices, Slice
from weightsync.plan.sliced_plan import LocalLayout

pytestmark = pytest.mark.slow  # whole jobs or engines as processes: not in `make unit`

BASE = {k: v for k, v in LLAMA.items() if k not in ("model_type", "intermediate_size")}
EXPERTS = 8
QWEN2_MOE = {**BASE, "model_type": "qwen2_moe", "intermediate_size": 256, "moe_intermediate_size": 128,
             "shared_expert_intermediate_size": 256, "num_experts": EXPERTS, "num_experts_per_tok": 2}
# MLA as vLLM's CPU build runs it: a latent of 512 plus a rotary part of 64 (its only head size)
DEEPSEEK = {**BASE, "model_type": "deepseek_v3", "num_key_value_heads": 4, "intermediate_size": 256,
            "moe_intermediate_size": 128, "first_k_dense_replace": 1, "n_routed_experts": EXPERTS, "n_shared_experts": 1,
            "num_experts_per_tok": 2, "q_lora_rank": 64, "kv_lora_rank": 512, "qk_rope_head_dim": 64,
            "qk_nope_head_dim": 64, "v_head_dim": 64, "n_group": 1, "topk_group": 1}
# vLLM's CPU int8 MoE kernel: hidden and intermediate sizes multiples of 32, softmax top-k routing
QWEN3_MOE = {**BASE, "model_type": "qwen3_moe", "intermediate_size": 256, "moe_intermediate_size": 128,
             "num_experts": EXPERTS, "num_experts_per_tok": 2, "norm_topk_prob": True}
TP = 2
DTYPE = "float32"  # repacked by vLLM's CPU build on any x86 CPU, and read back through its kernels
# vLLM's CPU build prefers its AMX MLA backend where the CPU has AMX tiles, which takes 16-bit
# weights only (a float32 server dies at its start); its reference MLA backend, the one it picks
# without AMX, runs float32 on every x86 CPU
MLA_ARGS = ("--attention-backend", "CPU_MLA")
VERSIONS = 2  # 0..1: steps 2, every 2
HOLD = "trainer-0-before-ready-v0"  # the servers hold what vLLM loaded from the checkpoint; no version yet
PAUSE = "trainer-0-before-go-v1"  # version 0 is served; the trainer holds version 1 back
LAST = "controller-0-delivered-v1"  # the last version is delivered; the server is held


@dataclass
class MoeRun:
    run: VllmRun
    config: dict
    expert_parallel: bool
    quantization: str | None = None
    end: dict = field(default_factory=dict)
    tokens: list[int] | None = None  # the server's greedy tokens on version 0
    plain_tokens: list[int] | None = None  # its tokens as vLLM loaded the checkpoint, before any version
    compare: dict = field(default_factory=dict)  # vLLM's compare of version 0, loaded after a reset, with its own load
    compare_last: dict | None = None  # of a quantized job: vLLM's compare of its reload of version 1's checkpoint




def moe_run(tmp, name: str, config: dict, expert_parallel: bool, quantization: str | None = None) -> MoeRun:
    """The job's model is a checkpoint (the experts one tensor each, as published checkpoints hold
    them; quantized with `quantization`): its server starts as vLLM alone would on it (its own load
    from disk, checksummed before weightsync loads anything), and the trainer starts from it, so
    that version 0 holds its weights."""
    python = vllm_python()
    base = build(Model(config=config, dtype=DTYPE), dtype=DTYPE, seed=3)
    # its parameters, what the trainer sends (not DeepSeek's e_score_correction_bias buffer, which
    # vLLM's loader of this config does not take)
    tensors = {n: p.detach() for n, p in base.named_parameters()}
    if quantization is not None:
        tensors = quantized(tensors, quantized_names(base), quantization)
    checkpoint = save_checkpoint(one_per_expert(tensors), config, tmp / "checkpoint", quantization)
    job = vllm_job(name, trainers=1, servers=1, steps=2, checkpoint=checkpoint, tensorParallel=TP, dtype=DTYPE,
                   expert_parallel=expert_parallel, quantization=quantization,
                   args=MLA_ARGS if "kv_lora_rank" in config else ())
    run = VllmRun(tmp, job, python, pauses=[HOLD, PAUSE] + ([LAST] if quantization else []), pause_limit=REACH_TIMEOUT)
    out = MoeRun(run, config, expert_parallel, quantization)
    try:
        run.reach(HOLD)
        server = run.servers[0]
        run.up(server)
        if not expert_parallel:
            refused_before_version_0(server, name)  # no client is served the start-up weights
            out.plain_tokens = completion(server, name, key=run.key)
        own = checksums_then_reset(run, [server])[0][server]
        run.release(HOLD)
        run.reach(PAUSE)
        run.serving(server, 0)
        out.compare = checker(server, "compare", own, key=run.key)
        if not expert_parallel:
            out.tokens = completion(server, name)
        run.release(PAUSE)
        if quantization is not None:  # the last version, against vLLM's own reload of its checkpoint from disk
            run.reach(LAST)
            run.serving(server, 1)
            held = checker(server, "checksum", key=run.key)["checksums"]
            sent = torch.load(run.dump / "trainer-0-v1.pt")["sent"]
            folder = save_checkpoint(one_per_expert(sent), config, tmp / "checkpoint-v1", quantization)
            post(server, "/collective_rpc", {"method": "reload_weights", "kwargs": {"weights_path": str(folder)}},
                 key=run.key)
            out.compare_last = checker(server, "compare", held, key=run.key)
            run.release(LAST)
        out.end = run.finish()
    finally:
        run.local.stop()
    return out


@pytest.fixture(scope="module")
def tp_moe(tmp_path_factory) -> MoeRun:
    return moe_run(tmp_path_factory.mktemp("vllm-moe-tp"), "vllm-moe-tp", QWEN2_MOE, expert_parallel=False)


@pytest.fixture(scope="module")
def ep_moe(tmp_path_factory) -> MoeRun:
    return moe_run(tmp_path_factory.mktemp("vllm-moe-ep"), "vllm-moe-ep", DEEPSEEK, expert_parallel=True)


@pytest.fixture(scope="module")
def int8_ep_moe(tmp_path_factory) -> MoeRun:
    if not amx_tiles():
        pytest.skip("vLLM's CPU build has an int8 fused-experts kernel for x86 CPUs only where they have AMX tiles "
                    "(CPUExpertsInt8), and this CPU has none (no amx_tile in /proc/cpuinfo)")
    return moe_run(tmp_path_factory.mktemp("vllm-moe-int8-ep"), "vllm-moe-int8-ep", QWEN3_MOE, expert_parallel=True,
                   quantization="int8")


def routed(name: str) -> bool:
    return ".mlp.experts." in name


def expert_box(name: str, shape: tuple, rank: int, expert_parallel: bool, half: int | None) -> Box:
    """The box of a stacked expert tensor ([experts, 2 x intermediate, hidden] gate and up, or
    [experts, hidden, intermediate] down) that worker `rank` holds: under expert parallelism its
    experts whole, else every expert's share of the intermediate dimension (`half`: of gate, 0,
    or of up, 1)."""
    if expert_parallel:
        per = shape[0] // TP
        return Box((rank * per, 0, 0), ((rank + 1) * per, shape[1], shape[2]))
    if "gate_up_proj" in name:
        rows = shape[1] // 2
        size = rows // TP
        first = half * rows + rank * size
        return Box((0, first, 0), (shape[0], first + size, shape[2]))
    size = shape[2] // TP
    return Box((0, 0, rank * size), (shape[0], shape[1], (rank + 1) * size))


def cut(t: torch.Tensor, box: Box) -> torch.Tensor:
    for dim, (a, b) in enumerate(zip(box.start, box.stop)):
        t = t.narrow(dim, a, b - a)
    return t


def expected(tensors: dict[str, torch.Tensor], config: dict, rank: int, expert_parallel: bool) -> dict[str, torch.Tensor]:
    """The trainer's tensors as vLLM's model holds them on worker `rank`: qwen2_moe's attention and
    embeddings as for a Llama (support.vllm.shards; none of the DeepSeek-shaped model's), the shared
    expert as a dense MLP (gate_up_proj: its rows of gate and of up; down_proj: its columns), the
    gates whole, and the routed experts in w13_weight (gate and up rows stacked per expert) and
    w2_weight."""
    dense = {n: t for n, t in tensors.items() if ".mlp." not in n}
    out = shards(dense, config, TP, rank) if config is not DEEPSEEK else {}
    for name, t in tensors.items():
        if ".mlp.gate.weight" in name or "shared_expert_gate" in name:
            out[name] = t
        elif re.search(r"\.shared_experts?\.gate_proj\.", name):
            up = tensors[name.replace("gate_proj", "up_proj")]
            size = t.shape[0] // TP
            out[name.replace("gate_proj", "gate_up_proj")] = torch.cat([t[rank * size:(rank + 1) * size],
                                                                       up[rank * size:(rank + 1) * size]])
        elif re.search(r"\.shared_experts?\.down_proj\.", name):
            size = t.shape[1] // TP
            out[name] = t[:, rank * size:(rank + 1) * size]
        elif stack := EXPERT_STACK.search(name):
            param = name.replace(f"experts.{stack[1]}", "experts.routed_experts." + PARAMS[stack[1]])
            if expert_parallel or stack[1] == "down_proj":
                out[param] = cut(t, expert_box(name, tuple(t.shape), rank, expert_parallel, None))
            else:
                out[param] = torch.cat([cut(t, expert_box(name, tuple(t.shape), rank, False, h)) for h in (0, 1)], dim=1)
    return out


PARAMS = {"gate_up_proj": "w13_weight", "down_proj": "w2_weight"}  # vLLM's fused experts' parameters


# on every worker (int8's per-row scales of a row-parallel weight: every row)
WHOLE = re.compile(r"norm|\.mlp\.gate\.|shared_expert_gate|q_a_proj|kv_a_proj_with_mqa|(o_proj|down_proj)\.weight_scale")
ROWS = re.compile(r"\.(q_proj|k_proj|v_proj|q_b_proj|kv_b_proj|gate_proj|up_proj)\.|embed_tokens|lm_head")  # its half
COLUMNS = re.compile(r"\.(o_proj|down_proj)\.weight")  # its half of the columns; a down_proj bias whole


def needs(layout, rank: int, expert_parallel: bool) -> RankSlices:
    """What worker `rank` needs of a version, as vLLM lays these models out at tensor-parallel size
    2 (no vocabulary padding: 512 rows; 4 query and 4 or 2 KV heads, none replicated), an int8
    weight's scales with its rows."""
    out = []
    for slot in layout.slots:
        name, shape = slot.name, tuple(slot.shape)
        whole = Box((0,) * len(shape), shape)
        if routed(name):
            halves = (0, 1) if name.endswith("gate_up_proj") and not expert_parallel else (None,)
            out += [Slice(name, expert_box(name, shape, rank, expert_parallel, h)) for h in halves]
        elif WHOLE.search(name):
            out.append(Slice(name, whole))
        elif COLUMNS.search(name):
            size = shape[1] // TP
            out.append(Slice(name, Box((0, rank * size), (shape[0], (rank + 1) * size))))
        elif ROWS.search(name):
            size = shape[0] // TP
            out.append(Slice(name, Box((rank * size,) + (0,) * (len(shape) - 1), ((rank + 1) * size,) + shape[1:])))
        else:
            raise AssertionError(f"the test's layout does not know {name}")
    return RankSlices(rank, tuple(out))


MOES = ["tp_moe", "ep_moe", "int8_ep_moe"]


@pytest.mark.parametrize("which", MOES)
def test_every_worker_holds_its_experts_and_the_rest_as_vllm_lays_them_out(which, request):
    moe: MoeRun = request.getfixturevalue(which)
    end, dump = moe.end, moe.run.dump
    assert end["state"] == "Succeeded", end
    assert end["versions"] == VERSIONS and end["failed_verifications"] == 0, end
    dtypes = {s.name: torch_dtype(s.dtype) for s in meta_layout(moe.run.job.model).slots}
    for version in range(VERSIONS):
        trainer = torch.load(dump / f"trainer-0-v{version}.pt")
        # a quantized version: its tensors as sent (int8 weights and their scales, the rest cast)
        trainer = {n: t.to(dtypes[n]) for n, t in trainer["sent"].items()} if moe.quantization else trainer["tensors"]
        if moe.quantization:
            weight = "model.layers.0.mlp.experts.gate_up_proj"
            assert trainer[weight].dtype == torch.int8 and trainer[weight + "_scale"].dtype == torch.float32
        for rank in range(TP):
            want = expected(trainer, moe.config, rank, moe.expert_parallel)
            got = torch.load(dump / f"inference-{rank}-v{version}.pt")["tensors"]
            if moe.config is not DEEPSEEK:
                assert sorted(got) == sorted(want), f"vLLM holds other tensors: {sorted(set(got) ^ set(want))}"
            else:  # the expert layers
                want = {n: t for n, t in want.items() if ".mlp." in n}
                assert set(want) <= set(got), f"vLLM has none of {sorted(set(want) - set(got))}"
            for name, tensor in want.items():
                assert got[name].dtype == tensor.dtype and got[name].shape == tensor.shape, \
                    (name, got[name].dtype, got[name].shape, tensor.shape)
                assert torch.equal(as_bytes(got[name]), as_bytes(tensor)), \
                    f"{which} version {version}: worker {rank} differs in {name}"


@pytest.mark.parametrize("which", MOES)
def test_each_worker_receives_only_its_share_half_of_the_routed_experts(which, request):
    moe: MoeRun = request.getfixturevalue(which)
    layout = meta_layout(moe.run.job.model)
    log = moe.run.log(2)  # the server's pod
    experts = sum(s.nbytes for s in layout.slots if routed(s.name))
    dtypes = {s.name: s.dtype for s in layout.slots}  # an int8 version's weights int8, their scales float32
    for rank in range(TP):
        share = needs(layout, rank, moe.expert_parallel)
        said = re.search(rf"\[inference rank {rank}\] tensor-parallel rank {rank} of {TP} .*?: receives (\d+) of "
                         rf"(\d+) bytes per version", log)
        assert said, f"inference rank {rank} did not say what it receives"
        assert int(said[1]) == LocalLayout.of(layout, share).total_bytes and int(said[2]) == layout.total_bytes, said[0]
        routed_bytes = sum(s.box.numel * ITEMSIZE[dtypes[s.tensor]] for s in share.slices if routed(s.tensor))
        assert routed_bytes * TP == experts, f"{which}: worker {rank} receives {routed_bytes} of {experts} expert bytes"


@pytest.mark.parametrize("which", MOES)
def test_vllms_weight_checker_finds_the_weights_vllm_loaded_from_disk(which, request):
    moe: MoeRun = request.getfixturevalue(which)
    assert moe.compare == {"match": True, "mismatches": []}, moe.compare


def test_the_tensor_parallel_server_answers_as_vllms_own_load_of_the_same_version(tp_moe):
    assert tp_moe.tokens is not None and tp_moe.tokens == tp_moe.plain_tokens, (tp_moe.tokens, tp_moe.plain_tokens)


def test_the_int8_expert_parallel_server_holds_what_vllms_own_reload_of_the_last_versions_checkpoint_holds(int8_ep_moe):
    assert int8_ep_moe.compare_last == {"match": True, "mismatches": []}, int8_ep_moe.compare_last
