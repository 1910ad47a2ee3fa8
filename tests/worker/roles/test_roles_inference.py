"""The inference rank's double buffer: the model runs on the active flat buffer while the next
version lands in the other one, and switches between two generations only, to a whole version."""
import threading
import time

import pytest
import torch

from weightsync.job import Model
from weightsync.model import build as model
from weightsync.model.flat import views
from weightsync.roles.inference import Generations
from weightsync.runtime.faults import FAIL_LOAD_ENV, LoadFault, failing_half, half_of, load_fails
from weightsync.runtime.inbound import LoadFailed

SPEC = Model(config={"model_type": "gpt2", "n_layer": 2, "n_embd": 64, "n_head": 2, "vocab_size": 256,
                     "n_positions": 32, "bos_token_id": 0, "eos_token_id": 0}, dtype="bfloat16")


def versions_of(n):
    """n different weight sets of the same model, and the logits each gives on the prompt."""
    weights, expected = [], []
    for seed in range(n):
        m = model.build(SPEC, dtype="bfloat16", seed=seed)
        weights.append([p.detach().clone() for _, p in model.parameters(m)])
        expected.append(model.logits(m, model.prompt(m)))
    return weights, expected


def test_generations_only_ever_see_whole_versions():
    weights, expected = versions_of(4)
    served = model.build(SPEC, dtype="bfloat16", seed=99, load_weights=False)
    layout = model.layout_of(served, "bfloat16")
    buffers = [torch.zeros(layout.total_bytes, dtype=torch.uint8) for _ in range(2)]
    gens = Generations([p for _, p in model.parameters(served)], buffers, layout)

    def receive():  # lands each version slowly, tensor by tensor, in the staging buffer
        for version, tensors in enumerate(weights):
            for view, tensor in zip(views(gens.staging(), layout), tensors):
                view.copy_(tensor)
                time.sleep(0.001)
            gens.offer(version)
        gens.finish(end={"state": "Succeeded", "message": ""})

    threading.Thread(target=receive, daemon=True).start()
    ids = model.prompt(served)
    seen = []
    while True:
        gens.next_event(0.001 if gens.version is not None else None)
        gens.switch()
        if gens.end is not None:
            break
        if gens.version is not None:
            got = model.logits(served, ids)
            assert torch.equal(got, expected[gens.version]), f"generated with a mix of versions around {gens.version}"
            seen.append(gens.version)
    assert gens.version == 3 and seen == sorted(seen) and len(set(seen)) >= 2
    assert torch.equal(model.logits(served, ids), expected[3])


def test_a_version_never_offered_is_never_used():
    """What the receiving thread does with a version that fails verification: it does not offer
    it, so the model stays on the version it has, even though the staging buffer was written."""
    weights, expected = versions_of(2)
    served = model.build(SPEC, dtype="bfloat16", seed=99, load_weights=False)
    layout = model.layout_of(served, "bfloat16")
    buffers = [torch.zeros(layout.total_bytes, dtype=torch.uint8) for _ in range(2)]
    gens = Generations([p for _, p in model.parameters(served)], buffers, layout)
    for view, tensor in zip(views(gens.staging(), layout), weights[0]):
        view.copy_(tensor)
    offer = threading.Thread(target=gens.offer, args=(0,))
    offer.start()
    gens.next_event(5)
    assert gens.switch() == 0
    offer.join(5)
    for view, tensor in zip(views(gens.staging(), layout), weights[1]):  # received, then refused
        view.copy_(tensor)
    gens.finish(error=RuntimeError("version 1 failed verification"))
    gens.next_event(5)
    assert gens.switch() is None and gens.version == 0
    assert torch.equal(model.logits(served, model.prompt(served)), expected[0])


def test_a_switch_that_fails_half_way_goes_back_to_the_whole_version(monkeypatch):
    """faults.FAIL_LOAD_ENV fails the switch to version 1 after half of the layers: every
    parameter is back on version 0 (its buffer untouched), the receiving thread hears why
    (LoadFailed, naming the version the model runs on), and version 2 switches whole."""
    monkeypatch.setenv(FAIL_LOAD_ENV, "0@1")
    weights, expected = versions_of(3)
    served = model.build(SPEC, dtype="bfloat16", seed=99, load_weights=False)
    layout = model.layout_of(served, "bfloat16")
    buffers = [torch.zeros(layout.total_bytes, dtype=torch.uint8) for _ in range(2)]
    params = [p for _, p in model.parameters(served)]
    gens = Generations(params, buffers, layout)
    outcomes = []

    def receive():
        for version, tensors in enumerate(weights):
            for view, tensor in zip(views(gens.staging(), layout), tensors):
                view.copy_(tensor)
            try:
                gens.offer(version)
                outcomes.append(version)
            except LoadFailed as e:
                outcomes.append((str(e), e.holds))

    half = half_of(layout.names)
    assert 0 < half < len(params)
    original = gens._point

    def watched(version=None):  # what the failed switch left before it went back
        try:
            original(version)
        except LoadFault:
            watched.mixed = [p.data_ptr() for p in params]
            raise

    gens._point = watched
    thread = threading.Thread(target=receive, daemon=True)
    thread.start()
    ids = model.prompt(served)
    for want in (0, None, 2):
        gens.next_event(5)
        assert gens.switch() == want
        if want is None:
            assert gens.version == 0 and gens.rolled_back == 1
            assert torch.equal(model.logits(served, ids), expected[0]), "the model is not back on version 0 whole"
            on_new = [a == v.data_ptr() for a, v in zip(watched.mixed, views(buffers[0], layout))]  # version 1 landed in buffer 0
            assert on_new == [i < half for i in range(len(params))], "the failed switch did not stop half-way"
    thread.join(5)
    assert torch.equal(model.logits(served, ids), expected[2])
    assert outcomes[0] == 0 and outcomes[2] == 2
    message, holds = outcomes[1]
    assert holds == 0 and message.startswith("version 1 failed to load part-way (LoadFault: the switch to version 1 "
                                             f"failed after {half} of its {len(params)} parameters")
    assert message.endswith("the model runs on version 0 again")


def test_half_of_the_layers_is_counted_by_the_numbered_blocks():
    names = ["wte", "h.0.a", "h.0.b", "h.1.a", "h.2.a", "h.3.a", "h.3.b", "ln_f"]
    assert half_of(names) == 4  # h.0 and h.1 load, h.2 does not
    assert half_of(["model.layers.0.w", "model.layers.1.w", "model.layers.2.w", "norm"]) == 2
    assert half_of(["a", "b", "c", "d"]) == 2  # no numbered blocks: half of the tensors


def test_an_armed_load_yields_its_first_half_of_the_layers_then_fails(monkeypatch):
    named = [(n, i) for i, n in enumerate(["embed", "layers.0.w", "layers.1.w", "layers.2.w", "layers.3.w", "norm"])]
    assert failing_half(named, 1, 5) is named  # not armed: the tensors as they are
    monkeypatch.setenv(FAIL_LOAD_ENV, "0@4, 1@5")
    loaded = []
    with pytest.raises(LoadFault, match="the load of version 5 failed after 3 of its 6 tensors"):
        for item in failing_half(iter(named), 1, 5):
            loaded.append(item)
    assert loaded == named[:3]  # the embedding and layers 0 and 1
    assert load_fails(0, 4) and not load_fails(0, 5) and not load_fails(2, 5)
