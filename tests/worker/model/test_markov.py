"""Generated training data: walks on a fixed random Markov chain, which a causal LM can learn."""
import math

import pytest
import torch

from weightsync.job import Model
from weightsync.model import build as model
from weightsync.model import markov as data


def test_batches_are_walks_on_the_chain_and_reproducible():
    chain = data.MarkovTokens(vocab=100, seed=5)
    a = chain.batch(4, 20, data.rank_generator(5, 0))
    b = chain.batch(4, 20, data.rank_generator(5, 0))
    other_rank = chain.batch(4, 20, data.rank_generator(5, 1))
    assert a.shape == (4, 20) and torch.equal(a, b) and not torch.equal(a, other_rank)
    for row in a:
        for prev, nxt in zip(row[:-1].tolist(), row[1:].tolist()):
            assert nxt in chain.successors[prev].tolist()


@pytest.mark.slow  # a training run of hundreds of steps: not in `make unit`
def test_the_loss_goes_down_towards_the_chain_entropy():
    spec = Model(config={"model_type": "gpt2", "n_layer": 1, "n_embd": 64, "n_head": 2, "vocab_size": 128,
                         "n_positions": 32, "bos_token_id": 0, "eos_token_id": 0}, dtype="float32")
    m = model.build(spec, seed=0)
    m.train()
    chain = data.MarkovTokens(model.vocab_size(m), seed=0)
    gen = data.rank_generator(0, 0)
    opt = torch.optim.AdamW(m.parameters(), lr=3e-3)
    losses = []
    for _ in range(40):
        x = chain.batch(8, 32, gen)
        loss = m(input_ids=x, labels=x).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert abs(losses[0] - math.log(128)) < 0.5  # starts near uniform
    assert sum(losses[-5:]) / 5 < losses[0] - 1.0  # and really learns
    assert chain.entropy < sum(losses[-5:]) / 5  # never below the floor
