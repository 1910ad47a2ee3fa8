"""The inference rank's double buffer: the model runs on the active flat buffer while the next
version lands in the other one, and switches between two generations only, to a whole version."""
import threading
import time

import torch

from weightsync.job import Model
from weightsync.model import build as model
from weightsync.model.flat import views
from weightsync.roles.inference import Generations

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
