"""Quantized versions: the quantizers checked bit for bit against references of the two formats
written here from their definitions (independent of torch's float8 cast), each rank's rows
quantized alone equal to the whole weight's, the quantized layout (names, dtypes, bytes), and what
is refused on one line."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from weightsync.job import Model, SpecError
from weightsync.model.build import build, layout_of, point_at
from weightsync.model.flat import FlatLayout, fill_range, views
from weightsync.model.quant import FORMATS, dequantize, quantization_config, quantize, quantized_tensors, scales_of
from weightsync.publisher.sources import local_tensors, sources_of

LLAMA = {"model_type": "llama", "hidden_size": 256, "intermediate_size": 512, "num_attention_heads": 4,
         "num_key_value_heads": 2, "num_hidden_layers": 2, "vocab_size": 512, "max_position_embeddings": 256}


def e4m3_table() -> tuple[np.ndarray, np.ndarray]:
    """Every finite non-negative float8_e4m3fn value and its code, from the format's definition:
    4 exponent bits (bias 7), 3 mantissa bits, subnormals at exponent 0, no infinities, and only
    S.1111.111 is NaN (so the largest value is 1.75 * 2**8 = 448)."""
    values, codes = [], []
    for code in range(0x7F):  # 0x7F is NaN
        exp, man = code >> 3, code & 7
        values.append(man / 8 * 2.0 ** -6 if exp == 0 else (1 + man / 8) * 2.0 ** (exp - 7))
        codes.append(code)
    return np.array(values, dtype=np.float64), np.array(codes, dtype=np.uint8)


def e4m3_reference(x: np.ndarray) -> np.ndarray:
    """Round float32 values (within +-448) to the nearest e4m3 value, ties to the even code; their codes."""
    values, codes = e4m3_table()
    mag = np.abs(x.astype(np.float64))
    hi = np.clip(np.searchsorted(values, mag), 1, len(values) - 1)
    lo = hi - 1
    dlo, dhi = mag - values[lo], values[hi] - mag
    pick = np.where(dlo < dhi, lo, np.where(dhi < dlo, hi, np.where(codes[lo] % 2 == 0, lo, hi)))
    pick = np.where(mag >= values[-1], len(values) - 1, pick)
    return codes[pick] | np.where(np.signbit(x) & (codes[pick] != 0), 0x80, 0).astype(np.uint8)


def fp8_reference(w: np.ndarray, block: int = 128) -> tuple[np.ndarray, np.ndarray]:
    """DeepSeek-V3's block format, block by block: scale_inv = max|block| / 448 (1 for zeros),
    code = e4m3(block / scale_inv); edge blocks are what is left of the weight."""
    rows, cols = w.shape
    scales = np.zeros((-(-rows // block), -(-cols // block)), dtype=np.float32)
    codes = np.zeros(w.shape, dtype=np.uint8)
    for i in range(scales.shape[0]):
        for j in range(scales.shape[1]):
            b = w[i * block:(i + 1) * block, j * block:(j + 1) * block]
            amax = np.float32(np.abs(b).max())
            s = np.float32(amax / np.float32(448.0)) if amax > 0 else np.float32(1.0)
            scales[i, j] = s
            codes[i * block:(i + 1) * block, j * block:(j + 1) * block] = e4m3_reference((b / s).astype(np.float32))
    return codes, scales


def int8_reference(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per output channel: scale = max|row| / 127 (1 for zeros), q = round half to even (row / scale)."""
    amax = np.abs(w).max(axis=1, keepdims=True).astype(np.float32)
    scale = np.where(amax > 0, amax / np.float32(127.0), np.float32(1.0)).astype(np.float32)
    return np.clip(np.round(w / scale), -127, 127).astype(np.int8), scale


def weights(rows: int, cols: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, cols, generator=g) * torch.logspace(-3, 1, cols)  # columns of very different sizes
    w[3] = 0  # a row of zeros: its scale is 1
    w[:, 5] = 1e-9  # near-subnormal values after scaling
    return w


@pytest.mark.parametrize("shape", [(256, 384), (200, 300), (130, 129)])
def test_fp8_blocks_equal_the_reference_bit_for_bit(shape):
    w = weights(*shape)
    w[:128, :128] = 0  # a block of zeros
    q, scale = quantize(w, FORMATS["fp8"])
    codes, scales = fp8_reference(w.numpy())
    assert q.dtype == torch.float8_e4m3fn and scale.dtype == torch.float32
    assert tuple(scale.shape) == (-(-shape[0] // 128), -(-shape[1] // 128))  # the edge blocks padded, as the format pads
    assert np.array_equal(scale.numpy().view(np.uint32), scales.view(np.uint32))
    assert np.array_equal(q.view(torch.uint8).numpy(), codes)
    back = dequantize(q, scale, FORMATS["fp8"], torch.float32)
    assert back[:128, :128].abs().max() == 0 and torch.allclose(back, w, rtol=0.07, atol=scale.max().item() * 2 ** -9)


def test_int8_channels_equal_the_reference_bit_for_bit():
    w = weights(96, 200)
    q, scale = quantize(w, FORMATS["int8"])
    ref_q, ref_scale = int8_reference(w.numpy())
    assert q.dtype == torch.int8 and tuple(scale.shape) == (96, 1)
    assert np.array_equal(q.numpy(), ref_q) and np.array_equal(scale.numpy().view(np.uint32), ref_scale.view(np.uint32))
    assert torch.allclose(dequantize(q, scale, FORMATS["int8"], torch.float32), w, atol=float(scale.max()) / 2 + 1e-12)


@pytest.mark.parametrize("fmt,rows", [("int8", [(0, 37), (37, 100), (100, 200)]), ("fp8", [(0, 128), (128, 200)])])
def test_each_ranks_rows_quantize_alone_to_the_whole_weights_rows(fmt, rows):
    """No gather: what a rank quantizes of its rows is the whole weight's quantization of them."""
    f = FORMATS[fmt]
    w = weights(200, 300)
    q, scale = quantize(w, f)
    for first, end in rows:
        part_q, part_scale = quantize(w[first:end], f)
        a, b = f.scale_rows("w", w.shape, first, end)
        assert torch.equal(part_q.view(torch.uint8), q[first:end].view(torch.uint8)) and torch.equal(part_scale, scale[a:b])


def test_a_shard_that_cuts_a_block_is_refused_on_one_line():
    with pytest.raises(ValueError) as e:
        FORMATS["fp8"].scale_rows("model.layers.0.self_attn.k_proj.weight", (128, 256), 64, 128)
    assert "\n" not in str(e.value) and "rows [64, 128) of model.layers.0.self_attn.k_proj.weight" in str(e.value)
    assert "multiples of 128 rows" in str(e.value)
    assert FORMATS["fp8"].scale_rows("w", (200, 256), 128, 200) == (1, 2)  # the last rows: the format pads them


def test_stacked_experts_quantize_expert_by_expert():
    w = torch.stack([weights(130, 140, seed=e) for e in range(3)])
    for f in FORMATS.values():
        q, scale = quantize(w, f)
        for e in range(3):
            one_q, one_scale = quantize(w[e], f)
            assert torch.equal(q[e].view(torch.uint8), one_q.view(torch.uint8)) and torch.equal(scale[e], one_scale)


@pytest.mark.parametrize("fmt", ["int8", "fp8"])
def test_a_quantized_version_carries_the_linear_weights_and_their_scales_in_about_half_the_bytes(fmt):
    f = FORMATS[fmt]
    model = build(Model(config=LLAMA), dtype="float32", seed=0)
    plain = layout_of(model, "bfloat16")
    layout = layout_of(model, "bfloat16", fmt)
    assert FlatLayout.from_json(layout.to_json()) == layout and layout.mixed and layout.itemsize == 1
    by_name = {s.name: s for s in layout.slots}
    q = by_name["model.layers.0.self_attn.q_proj.weight"]
    assert (q.dtype, q.shape) == (f.dtype, (256, 256))
    scale = by_name[f"model.layers.0.self_attn.q_proj.weight{f.scale_suffix}"]
    assert scale.dtype == "float32" and scale.shape == ((256, 1) if fmt == "int8" else (2, 2))
    for kept in ("model.embed_tokens.weight", "lm_head.weight", "model.norm.weight"):
        assert by_name[kept].dtype == "bfloat16"
    assert len(scales_of(layout, f)) == 2 * 7  # q, k, v, o, gate, up, down of each layer
    linear = sum(s.nbytes for s in plain.slots if s.name in scales_of(layout, f))
    assert 0.5 < sum(s.nbytes for s in layout.slots if s.name in scales_of(layout, f) or s.name.endswith(f.scale_suffix)) \
        / linear < 0.52
    # the version's bytes are the quantized tensors' own, and the built-in engine loads their dequantization
    sources = sources_of(model, "bfloat16", quantization=fmt)
    assert sources.layout == layout and sources.holdings is None
    tensors = local_tensors(model, sources)
    buffer = torch.zeros(layout.total_bytes, dtype=torch.uint8)
    fill_range(layout, tensors, 0, layout.total_bytes, buffer)
    got = dict(zip(layout.names, views(buffer, layout)))
    want_q, want_scale = quantize(model.model.layers[1].mlp.down_proj.weight, f)
    assert torch.equal(got["model.layers.1.mlp.down_proj.weight"].view(torch.uint8), want_q.view(torch.uint8))
    assert torch.equal(got[f"model.layers.1.mlp.down_proj.weight{f.scale_suffix}"], want_scale)
    served = build(Model(config=LLAMA), dtype="bfloat16", seed=1)
    point_at([p for _, p in served.named_parameters()], views(buffer, layout), layout, fmt)
    assert torch.equal(served.model.layers[1].mlp.down_proj.weight, dequantize(want_q, want_scale, f, torch.bfloat16))
    assert torch.equal(served.model.embed_tokens.weight, model.model.embed_tokens.weight.to(torch.bfloat16))
    assert [t.dtype for t in quantized_tensors(layout, f, [p for _, p in model.named_parameters()])[:3]] == \
        [torch.float32, torch.int8 if fmt == "int8" else torch.float8_e4m3fn, torch.float32]


def test_a_model_vllm_cannot_load_quantized_is_refused_on_one_line():
    gpt2 = build(Model(config={"model_type": "gpt2", "n_layer": 1, "n_embd": 64, "n_head": 2, "vocab_size": 64}),
                 dtype="float32", device="meta")
    with pytest.raises(SpecError) as e:
        layout_of(gpt2, "bfloat16", "int8")
    assert len(e.value.problems) == 1 and "Conv1D" in str(e.value) and "\n" not in e.value.problems[0]


def test_the_checkpoint_config_is_what_vllm_reads():
    int8 = quantization_config(FORMATS["int8"])
    assert int8["quant_method"] == "compressed-tensors"
    assert int8["config_groups"]["group_0"]["weights"]["strategy"] == "channel"
    assert quantization_config(FORMATS["fp8"]) == {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                                   "weight_block_size": [128, 128]}


def test_a_quantized_checkpoint_builds_its_weights_dequantized_and_a_lora_over_it_travels_unquantized(tmp_path):
    """spec.model.path holding an int8 checkpoint (what a vLLM server of it serves): the trainers'
    model is its weights dequantized (q x scale), the rest as stored; with spec.model.lora the
    versions are the adapter alone, in spec.model.dtype, never quantized."""
    from support.checkpoint_tensors import quantized
    from support.vllm import save_checkpoint

    from weightsync.job import Lora
    from weightsync.model.lora import Adapter, add_adapters
    from weightsync.model.quant import quantized_names

    fmt = FORMATS["int8"]
    base = build(Model(config=LLAMA, dtype="float32"), dtype="float32", seed=3)
    names = quantized_names(base)
    stored = quantized(base.state_dict(), names, "int8")
    folder = save_checkpoint(stored, {**LLAMA, "bos_token_id": 0, "eos_token_id": 0}, tmp_path / "int8", "int8")
    lora = Lora(rank=4, alpha=8, target_modules=("q_proj", "o_proj"), name="tuned")
    spec = Model(path=str(folder), dtype="float32", quantization="int8", lora=lora)
    model = build(spec, dtype="float32")
    for name, param in model.state_dict().items():
        want = dequantize(stored[name], stored[fmt.scale_name(name)], fmt, torch.float32) if name in names else stored[name]
        assert torch.equal(param, want), name
    add_adapters(model, lora)
    sources = sources_of(model, "float32", Adapter.of(spec), "int8")
    assert sources.fmt is None and {s.dtype for s in sources.layout.slots} == {"float32"}
    assert all(".lora_A." in n or ".lora_B." in n for n in sources.layout.names)
    (folder / "model.safetensors").rename(folder / "pytorch_model.bin")  # weights, but none this loader reads
    with pytest.raises(SpecError, match="its safetensors files hold no model.embed_tokens.weight"):
        build(spec, dtype="float32")


def test_a_quantized_mixture_of_experts_checkpoint_with_one_tensor_per_expert_builds_transformers_stacks(tmp_path):
    """Published quantized mixtures of experts store each expert's projections as tensors of their
    own, each with its scales (experts.<e>.gate_proj.weight, .weight_scale): the trainers' model
    stacks them dequantized as transformers holds them, and quantizing the stacks again gives the
    checkpoint's bytes (version 0 is the checkpoint)."""
    from support.checkpoint_tensors import one_per_expert, quantized
    from support.vllm import save_checkpoint

    from weightsync.model.quant import quantized_names

    config = {**LLAMA, "model_type": "qwen3_moe", "moe_intermediate_size": 64, "num_experts": 4,
              "num_experts_per_tok": 2, "bos_token_id": 0, "eos_token_id": 0}
    fmt = FORMATS["int8"]
    base = build(Model(config=config, dtype="float32"), dtype="float32", seed=3)
    stored = one_per_expert(quantized(base.state_dict(), quantized_names(base), "int8"))
    assert "model.layers.1.mlp.experts.3.up_proj.weight_scale" in stored and not any(".gate_up_proj" in n for n in stored)
    model = build(Model(path=str(save_checkpoint(stored, config, tmp_path / "int8", "int8")), dtype="float32",
                        quantization="int8"), dtype="float32")
    gate_up = model.state_dict()["model.layers.1.mlp.experts.gate_up_proj"]
    for e in range(4):
        q, scales = quantize(gate_up[e], fmt)
        assert torch.equal(q, torch.cat([stored[f"model.layers.1.mlp.experts.{e}.{p}.weight"] for p in ("gate_proj", "up_proj")]))
        assert torch.equal(scales[64:], stored[f"model.layers.1.mlp.experts.{e}.up_proj.weight_scale"])
    q, _ = quantize(model.state_dict()["model.layers.0.mlp.experts.down_proj"], fmt)
    assert torch.equal(q[2], stored["model.layers.0.mlp.experts.2.down_proj.weight"])
    del stored["model.layers.0.mlp.experts.3.down_proj.weight"]  # an expert short: refused, naming the stack
    with pytest.raises(SpecError, match="hold no model.layers.0.mlp.experts.down_proj"):
        build(Model(path=str(save_checkpoint(stored, config, tmp_path / "short", "int8")), dtype="float32",
                    quantization="int8"), dtype="float32")
