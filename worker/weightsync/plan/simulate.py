"""`weightsync plan --simulate`: the pieces of a large model on a large cluster, without either.

The model is built on the meta device (shapes, no weights: a 1T-parameter MoE takes seconds),
its parameters become global tensors in the transfer dtype, the trainer side is FSDP2 (HSDP where
the FSDP degree is less than the trainer GPUs, DDP at degree 1), the inference side replicas of
TP degree k sliced by the model's own transformers TP plan, or of expert-parallel degree e (a
mixture of experts served as vLLM serves it with --enable-expert-parallel: each GPU holds e-th of
the routed experts, whole, and the rest by the TP plan; plan/tp_needs.py). A quantized version
(--dtype fp8 or int8) is planned with its scales following their weights' slices (an fp8 slice that
cuts a 128x128 block is refused, naming the weight). The same planner the controller runs
then assigns every piece to a sender, the assignment is checked (every receiver gets exactly its
bytes of every tensor), and linktime simulates its order on one NIC per rank.
"""

from __future__ import annotations

import os
import re
import time
from dataclasses import dataclass
from pathlib import Path

from weightsync.job import SpecError
from weightsync.job.files import FileProblem
from weightsync.model.config import expert_count, from_mapping, read_config_json
from weightsync.model.quant import format_of, quantized_names
from weightsync.plan.boxes import GlobalTensor, Slicing
from weightsync.plan.holders import dim1_where_dim0_is_uneven, sharded
from weightsync.plan.linktime import WINDOW, simulate
from weightsync.plan.pieces import assign_pieces, check_assignment
from weightsync.plan.segments import size_text
from weightsync.plan.tp_needs import ONE_EXPERT, STACKED_EXPERTS, check_heads, tp_needs

JITTER, JITTER_RUNS = 1e-3, 3

# Shapes of public checkpoints (their config.json values), built with transformers' own classes.
# DeepSeek-V3 (deepseek-ai/DeepSeek-V3): 256 experts, ~671B parameters
_DEEPSEEK_V3 = dict(
    vocab_size=129280, hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048,
    num_hidden_layers=61, num_attention_heads=128, num_key_value_heads=128, n_shared_experts=1,
    n_routed_experts=256, num_experts_per_tok=8, first_k_dense_replace=3, kv_lora_rank=512,
    q_lora_rank=1536, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128, n_group=8, topk_group=4,
    tie_word_embeddings=False)
MODELS = {
    # Kimi K2 (moonshotai/Kimi-K2-Instruct): the DeepSeek-V3 architecture with 384 experts, ~1.03T parameters
    "kimi-k2": ("deepseek_v3", {**_DEEPSEEK_V3, "vocab_size": 163840, "num_attention_heads": 64,
                                "num_key_value_heads": 64, "n_routed_experts": 384, "first_k_dense_replace": 1,
                                "n_group": 1, "topk_group": 1}),
    "deepseek-v3": ("deepseek_v3", _DEEPSEEK_V3),
    # Qwen3-235B-A22B (Qwen/Qwen3-235B-A22B): 128 experts, 8 per token, ~235B parameters
    "qwen3-235b-a22b": ("qwen3_moe", dict(
        vocab_size=151936, hidden_size=4096, intermediate_size=12288, moe_intermediate_size=1536,
        num_hidden_layers=94, num_attention_heads=64, num_key_value_heads=4, head_dim=128, num_experts=128,
        num_experts_per_tok=8, tie_word_embeddings=False)),
    # Llama 3 70B (meta-llama/Meta-Llama-3-70B)
    "llama-3-70b": ("llama", dict(
        vocab_size=128256, hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
        num_attention_heads=64, num_key_value_heads=8, tie_word_embeddings=False)),
}


@dataclass(frozen=True)
class Topology:
    trainers: int       # trainer GPUs
    fsdp: int           # FSDP degree (trainers / fsdp replicas: HSDP; 1: DDP)
    replicas: int       # inference replicas
    tp: int             # TP degree of each
    nic_bits: float     # per rank, each way
    dtype: str = "bfloat16"
    bucket_bytes: int = 64 << 20
    fsdp_dim: str = "0"  # "0": fully_shard's default; "auto": dim 1 where dim 0 does not split evenly
    ep: int = 0         # expert-parallel degree of each replica (its GPUs); 0: none
    quantization: str | None = None  # fp8 or int8: the linear layers' weights quantized, with their scales

    def __post_init__(self):
        if self.trainers < 1 or self.fsdp < 1 or self.trainers % self.fsdp:
            raise ValueError(f"--fsdp {self.fsdp} must divide --trainers {self.trainers} (the rest are HSDP replicas)")
        if self.replicas < 1 or self.tp < 1:
            raise ValueError("--inference needs at least one replica of TP degree at least 1, for example 8xTP16")
        if self.ep and self.ep % self.tp:
            raise ValueError(f"--inference: the expert-parallel degree {self.ep} must be a multiple of the TP degree "
                             f"{self.tp} (the GPUs of a replica: EP = TP x its data-parallel attention groups)")

    @property
    def replica_gpus(self) -> int:
        return max(self.tp, self.ep)


INFERENCE = re.compile(r"\s*(\d+)\s*[xX*]\s*(?:(?:TP|tp)?\s*(\d+))?\s*(?:[xX*]?\s*(?:EP|ep)\s*(\d+))?\s*")


def parse_inference(text: str) -> tuple[int, int, int]:
    """'8xTP16' (or '8x16') -> (8 replicas, TP degree 16, no expert parallelism); '4xEP32' -> (4,
    1, 32): 32 GPUs a replica, each with 1/32 of the routed experts and the rest whole (data-
    parallel attention); '2xTP8xEP8' -> (2, 8, 8)."""
    m = INFERENCE.fullmatch(text)
    if not m or (m.group(2) is None and m.group(3) is None):
        raise ValueError(f"--inference {text!r}: write replicas x TP degree, for example 8xTP16, and for a mixture "
                         "of experts served with expert parallelism x EP degree (2xTP8xEP8, or 4xEP32)")
    return int(m.group(1)), int(m.group(2) or 1), int(m.group(3) or 0)


def model_config(name: str):
    """A built-in model's transformers config, or the config.json at a path (a file or its directory)."""
    from transformers import AutoConfig

    if name in MODELS:
        model_type, values = MODELS[name]
        return AutoConfig.for_model(model_type, **values)
    path = Path(name)
    if path.is_dir():
        path = path / "config.json"
    if not os.path.lexists(path):
        raise ValueError(f"--simulate {name!r}: not a built-in model ({', '.join(MODELS)}) and no config.json there")
    try:
        settings = read_config_json(path)
    except FileProblem as e:
        raise ValueError(f"--simulate: {e}") from None
    try:
        return from_mapping(settings)
    except (SpecError, ValueError) as e:
        raise ValueError(f"--simulate {name}: {e}") from None


def meta_model(config):
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


def global_tensors(model, topo: Topology) -> list[GlobalTensor]:
    """The model's parameters as the version's tensors: in topo.dtype, or quantized as a quantized
    job sends them (model/quant.py: each linear weight in the format's dtype, then its scales)."""
    fmt = format_of(topo.quantization)
    names = quantized_names(model) if fmt is not None else set()
    out = []
    for n, p in model.named_parameters():
        shape = tuple(p.shape)
        if n in names:
            out += [GlobalTensor(n, shape, fmt.dtype), GlobalTensor(fmt.scale_name(n), fmt.scale_shape(shape), "float32")]
        else:
            out.append(GlobalTensor(n, shape, topo.dtype))
    return out


@dataclass(frozen=True)
class Shapes:
    """A model's version on a topology, before any plan: its tensors, what each trainer GPU holds
    and what each inference GPU needs (what `weightsync bench --control-plane`'s ranks join with)."""

    tensors: list  # GlobalTensor, in the model's order
    experts: int  # routed experts per layer (0: a dense model)
    holders: Slicing
    needs: Slicing
    build_seconds: float  # the meta model and its tensors
    needs_seconds: float  # the holders and needs


def shapes(name: str, topo: Topology) -> Shapes:
    """The tensors of `name`, held as topo's trainers shard them and needed as its inference replicas
    slice them; ValueError where the topology cannot serve the model."""
    t0 = time.perf_counter()
    config = model_config(name)
    model = meta_model(config)
    plan_styles = dict(getattr(model, "_tp_plan", None) or {})
    if topo.tp > 1 and not plan_styles:
        raise ValueError(f"{type(model).__name__} has no tensor-parallel plan in transformers: "
                         f"simulate its inference as replicas of TP1 (for example --inference {topo.replicas * topo.tp}xTP1)")
    check_heads(config, plan_styles, topo.tp)
    experts = expert_count(config)
    if topo.ep and not experts:
        raise ValueError(f"--inference: {name} has no experts to place with expert parallelism; drop the EP degree")
    tensors = global_tensors(model, topo)
    built = time.perf_counter() - t0
    t1 = time.perf_counter()
    shard_dim = dim1_where_dim0_is_uneven(topo.fsdp) if topo.fsdp_dim == "auto" else int(topo.fsdp_dim)
    holders = sharded(tensors, topo.fsdp, topo.trainers // topo.fsdp, shard_dim)
    needs = tp_needs(tensors, plan_styles, topo.tp, topo.replicas, topo.ep, experts, format_of(topo.quantization))
    return Shapes(tensors, experts, holders, needs, built, time.perf_counter() - t1)


def run(name: str, topo: Topology) -> dict:
    """Plan `name` on `topo`; the figures `weightsync plan --simulate` prints ("plan": the
    pieces.PieceAssignment)."""
    shaped = shapes(name, topo)
    tensors, experts, needs = shaped.tensors, shaped.experts, shaped.needs
    t1 = time.perf_counter()
    assignment = assign_pieces(shaped.holders, needs, topo.bucket_bytes)
    planned = time.perf_counter() - t1 + shaped.needs_seconds
    built = shaped.build_seconds

    check_assignment(assignment, needs)
    pairs = assignment.pair_bytes()
    timing = simulate(pairs, assignment.position, topo.nic_bits / 8)
    jittered = max(simulate(pairs, assignment.position, topo.nic_bits / 8, JITTER, seed).seconds
                   for seed in range(JITTER_RUNS))
    sent, received = assignment.bytes_by_sender(), assignment.bytes_by_receiver()
    bs, br = assignment.balance()
    routed = [i for i, t in enumerate(tensors) if STACKED_EXPERTS.search(t.name) or ONE_EXPERT.search(t.name)]
    routed_bytes = sum(tensors[i].nbytes for i in routed)
    # what the first GPU of a replica needs of the routed experts (each GPU the same share)
    routed_share = sum(box.numel * tensors[i].itemsize for i in routed
                       for box, ranks in zip(needs.placements[i].boxes, needs.placements[i].ranks) if 0 in ranks)
    return {"model": name, "experts": experts, "routed_bytes": routed_bytes, "routed_per_gpu": routed_share,
            "parameters": sum(t.numel for t in tensors), "tensors": len(tensors),
            "version_bytes": sum(t.nbytes for t in tensors), "build_seconds": built, "plan_seconds": planned,
            "pieces": len(assignment), "streams": timing.streams, "sender_balance": bs, "receiver_balance": br,
            "busiest_sender_bytes": int(sent.max()), "busiest_receiver_bytes": int(received.max()),
            "busiest_nic_bytes": timing.busiest_nic_bytes, "projected_seconds": timing.seconds,
            "speed_of_light_seconds": timing.speed_of_light, "over_light": timing.over_light,
            "jittered_seconds": jittered, "plan": assignment}


def report(r: dict, topo: Topology) -> str:
    hsdp = topo.trainers // topo.fsdp
    kind = "FSDP2" if hsdp == 1 else ("DDP" if topo.fsdp == 1 else f"HSDP {hsdp} x FSDP2")
    shape = f"TP{topo.tp}" + (f"xEP{topo.ep}" if topo.ep else "")
    quantized = f" with {topo.quantization} linear weights and their float32 scales" if topo.quantization else ""
    lines = [
        f"model: {r['model']}: {r['parameters'] / 1e9:.1f}B parameters in {r['tensors']} tensors, "
        f"{size_text(r['version_bytes'])} as {topo.dtype}{quantized} (built on the meta device in {r['build_seconds']:.1f} s)",
        f"trainers: {topo.trainers} GPUs, {kind} degree {topo.fsdp} (shard dim {topo.fsdp_dim}); "
        f"inference: {topo.replicas} replicas x {shape} = {topo.replicas * topo.replica_gpus} GPUs; "
        f"one {topo.nic_bits / 1e9:g} Gb/s NIC per GPU, full duplex",
        *([f"experts: {r['experts']} routed per layer, {size_text(r['routed_bytes'])} in all; each inference GPU "
           f"needs {size_text(r['routed_per_gpu'])} of them ({r['routed_per_gpu'] / r['routed_bytes']:.4f}), and "
           f"{size_text(r['busiest_receiver_bytes'])} in all per version at most"] if r["experts"] else []),
        f"plan: {r['pieces']} pieces (at most {size_text(topo.bucket_bytes)}), {r['streams']} sender->receiver "
        f"streams, computed in {r['plan_seconds']:.2f} s; checked: every receiver gets exactly its bytes",
        f"balance (max / mean): senders {r['sender_balance']:.3f}, receivers {r['receiver_balance']:.3f}",
        f"busiest sender {size_text(r['busiest_sender_bytes'])}, busiest receiver "
        f"{size_text(r['busiest_receiver_bytes'])}, busiest NIC {size_text(r['busiest_nic_bytes'])}",
        f"speed of light: {r['speed_of_light_seconds']:.3f} s (busiest NIC / bandwidth)",
        f"projected: {r['projected_seconds']:.3f} s = {r['over_light']:.3f} x the speed of light (senders stream "
        f"their pieces in plan order, {WINDOW} receivers at a time; each NIC shared by its streams)",
        f"projected with stream sizes jittered by +-{JITTER:.1%}: {r['jittered_seconds']:.3f} s = "
        f"{r['jittered_seconds'] / r['speed_of_light_seconds'] if r['speed_of_light_seconds'] else 1.0:.3f} x "
        f"(the worst of {JITTER_RUNS} seeds)",
    ]
    return "\n".join(lines)
