"""The causal LM the roles hold: built from a config (seeded, nothing downloaded) or a checkpoint
directory, its version layout without allocating weights, and parameters that are views into a
flat buffer."""
import pytest
import torch

from weightsync.job import Model, SpecError
from weightsync.model import build as model
from weightsync.model.flat import views

CONFIG = {"model_type": "gpt2", "n_layer": 2, "n_embd": 64, "n_head": 2, "vocab_size": 256, "n_positions": 32,
          "bos_token_id": 0, "eos_token_id": 0}
SPEC = Model(config=CONFIG, dtype="bfloat16")


def test_same_seed_same_weights_other_seed_other_weights():
    a, b = model.build(SPEC, seed=3), model.build(SPEC, seed=3)
    c = model.build(SPEC, seed=4)
    pa, pb, pc = model.parameters(a), model.parameters(b), model.parameters(c)
    assert [n for n, _ in pa] == [n for n, _ in pb]
    assert all(torch.equal(x, y) for (_, x), (_, y) in zip(pa, pb))
    assert not torch.equal(pa[0][1], pc[0][1])


def test_meta_layout_matches_the_built_model_and_lists_tied_weights_once():
    built = model.build(SPEC, dtype="float32")
    layout = model.meta_layout(SPEC)
    assert layout == model.layout_of(built, "bfloat16")
    assert layout.dtype == "bfloat16"
    assert "lm_head.weight" not in layout.names and "transformer.wte.weight" in layout.names  # gpt2 ties them
    assert layout.payload_bytes == 2 * sum(p.numel() for p in built.parameters())


def test_point_at_makes_parameters_views_of_the_buffer_and_tied_weights_follow():
    m = model.build(SPEC, dtype="bfloat16")
    layout = model.layout_of(m, "bfloat16")
    buffer = torch.zeros(layout.total_bytes, dtype=torch.uint8)
    slots = views(buffer, layout)
    for (_, p), v in zip(model.parameters(m), slots):
        v.copy_(p.detach())
    expected = model.logits(m, model.prompt(m))
    model.point_at([p for _, p in model.parameters(m)], slots)
    assert torch.equal(model.logits(m, model.prompt(m)), expected)
    wte = m.transformer.wte.weight
    assert wte.data_ptr() == slots[0].data_ptr() and m.lm_head.weight.data_ptr() == slots[0].data_ptr()
    buffer.zero_()  # writing the buffer is writing the model
    assert not m.transformer.wte.weight.any() and not m.lm_head.weight.any()


def test_point_at_refuses_views_of_another_model():
    m = model.build(SPEC)
    other = model.build(Model(config={**CONFIG, "n_embd": 32}, dtype="float32"))
    with pytest.raises(ValueError, match="does not fit"):
        model.point_at([p for _, p in model.parameters(m)], [p for _, p in model.parameters(other)])


def test_checkpoint_directory(tmp_path):
    saved = model.build(SPEC, seed=7)
    saved.save_pretrained(tmp_path)
    loaded = model.build(Model(path=str(tmp_path), dtype="bfloat16"))
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(model.parameters(saved), model.parameters(loaded)))
    assert model.meta_layout(Model(path=str(tmp_path), dtype="bfloat16")) == model.layout_of(saved, "bfloat16")
    shaped = model.build(Model(path=str(tmp_path), dtype="bfloat16"), load_weights=False)
    assert [n for n, _ in model.parameters(shaped)] == [n for n, _ in model.parameters(saved)]


def test_bad_config_and_missing_path_are_spec_errors(tmp_path):
    with pytest.raises(SpecError, match="spec.model.config"):
        model.build(Model(config={"model_type": "no-such-model"}, dtype="float32"))
    with pytest.raises(SpecError, match="spec.model.path"):
        model.build(Model(path=str(tmp_path / "absent"), dtype="float32"))


def test_greedy_generation_is_deterministic():
    m = model.build(SPEC, seed=1)
    ids = model.prompt(m)
    first = model.greedy(m, ids, 5)
    assert first == model.greedy(m, ids, 5) and len(first) == 5
    assert all(0 <= t < CONFIG["vocab_size"] for t in first)
