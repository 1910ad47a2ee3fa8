"""LoRA adapters as versions (model/lora.py): the adapter's layout from the spec alone, the
adapter read off a model that carries it, refused on one line where it is not the spec's, and
PEFT's forward (W + alpha / rank B A)."""

from __future__ import annotations

import pytest
import torch
from support.vllm import LLAMA

from weightsync.job import Lora, Model, SpecError
from weightsync.model.build import build
from weightsync.model.lora import Adapter, adapter_layout, add_adapters, merged
from weightsync.publisher.sources import local_tensors, sources_of


def model_spec(rank=4, alpha=8, targets=("q_proj", "v_proj")):
    lora = Lora(rank=rank, alpha=alpha, target_modules=tuple(targets))
    return Model(config=LLAMA, dtype="float32", lora=lora)


def test_the_adapter_layout_is_pefts_names_and_shapes_over_the_base():
    layout = adapter_layout(model_spec())
    assert layout.names[:4] == ["base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight",
                                "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight",
                                "base_model.model.model.layers.0.self_attn.v_proj.lora_A.weight",
                                "base_model.model.model.layers.0.self_attn.v_proj.lora_B.weight"]
    shapes = [s.shape for s in layout.slots[:4]]
    assert shapes == [(4, 256), (256, 4), (4, 256), (128, 4)]  # v_proj: 2 KV heads of 64
    assert len(layout.slots) == 2 * 2 * LLAMA["num_hidden_layers"]


def test_the_adapter_of_a_wrapped_model_is_sent_alone_and_runs_as_the_merged_weight():
    spec = model_spec()
    torch.manual_seed(0)
    model = add_adapters(build(spec, dtype="float32"), spec.lora)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_()
    sources = sources_of(model, "float32", Adapter.of(spec))
    assert sources.layout.names == adapter_layout(spec).names
    tensors = local_tensors(model, sources)
    assert sum(t.numel() for t in tensors) * 4 == sources.layout.total_bytes
    assert all(not p.requires_grad for n, p in model.named_parameters() if "lora_" not in n)
    layer = model.model.layers[0].self_attn.q_proj
    x = torch.randn(3, 256)
    want = x @ merged(layer.base_layer.weight, layer.lora_A["default"].weight, layer.lora_B["default"].weight, spec.lora).T
    torch.testing.assert_close(layer(x), want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("carried, expected", [
    (None, "the model carries no LoRA adapter"),
    (model_spec(rank=8).lora, "spec.model.lora.rank: 4, but the model's adapter on model.layers.0.self_attn.q_proj has rank 8"),
    (model_spec(alpha=4).lora, "spec.model.lora.alpha: 8 (scaling 2), but the model's adapter"),
    (model_spec(targets=("q_proj",)).lora, "the model's layer model.layers.0.self_attn.v_proj carries no adapter"),
    (model_spec(targets=("q_proj", "v_proj", "o_proj")).lora,
     "the model's layer model.layers.0.self_attn.o_proj carries an adapter, but targetModules (q_proj, v_proj)"),
])
def test_a_model_whose_adapter_is_not_the_specs_is_refused_on_one_line(carried, expected):
    spec = model_spec()
    model = build(spec, dtype="float32")
    if carried is not None:
        add_adapters(model, carried)
    with pytest.raises(SpecError) as err:
        sources_of(model, "float32", Adapter.of(spec))
    assert expected in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize("targets, missing", [
    (("qkv",), "qkv names"),
    (("q_proj", "nonexistent_proj"), "nonexistent_proj names"),  # one that matches does not hide one that does not
    (("c_attn", "q_proj", "qkv"), "c_attn, qkv name"),
])
def test_targets_no_layer_has_are_refused_naming_the_layers_there_are(targets, missing):
    with pytest.raises(SpecError) as err:
        adapter_layout(model_spec(targets=targets))
    assert str(err.value) == (f"invalid WeightTransferJob: spec.model.lora.targetModules: {missing} no linear layer of "
                              "the model (LlamaForCausalLM); its linear layers are named down_proj, gate_proj, k_proj, "
                              "lm_head, o_proj, q_proj, up_proj, v_proj: name only those")


def test_the_adapter_is_found_under_the_prefixes_peft_and_wrappers_add():
    """PeftModel holds the model as base_model.model (its layers then named base_model.model.model.
    layers...), DDP as module: the adapter's layers are found by the base model's names all the same."""
    spec = model_spec()
    model = add_adapters(build(spec, dtype="float32"), spec.lora)
    inner, outer = torch.nn.Module(), torch.nn.Module()
    inner.model = model
    outer.base_model = inner
    names = [n for n, _ in Adapter.of(spec).tensors(outer)]
    assert names == adapter_layout(spec).names
    assert names[0] == "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"


def test_a_model_peft_wrapped_publishes_the_tensors_peft_saves():
    """A model wrapped by PEFT itself (get_peft_model, as TRL wraps it): the version's names,
    shapes and bytes are those of PEFT's own adapter state dict (what adapter_model.safetensors
    holds, and vLLM loads), and another rank in PEFT's config is refused on one line."""
    import peft  # a dev dependency (pyproject.toml), as TRL brings it to a trainer

    spec = model_spec()
    torch.manual_seed(0)
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    model = peft.get_peft_model(build(spec, dtype="float32"), config)
    sources = sources_of(model, "float32", Adapter.of(spec))
    saved = peft.get_peft_model_state_dict(model)
    assert sources.layout.names == list(saved)
    for tensor, (name, want) in zip(local_tensors(model, sources), saved.items()):
        assert torch.equal(tensor.reshape(want.shape), want), name
    eight = peft.LoraConfig(r=8, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    other = peft.get_peft_model(build(spec, dtype="float32"), eight)
    with pytest.raises(SpecError, match="spec.model.lora.rank: 4, but the model's adapter on .* has rank 8"):
        sources_of(other, "float32", Adapter.of(spec))
