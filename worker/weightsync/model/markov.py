"""Training data generated on the fly, learnable by construction.

Sequences come from a fixed random Markov chain over the vocabulary: every token has a few
successors with fixed probabilities. A model that learns the chain reaches the chain's entropy
rate, so the loss falls from log(vocab) towards a known floor.
"""

from __future__ import annotations

import math

import torch

SUCCESSOR_PROBS = (0.5, 0.25, 0.15, 0.1)


class MarkovTokens:
    def __init__(self, vocab: int, seed: int):
        if vocab < 2:
            raise ValueError(f"vocabulary of {vocab} tokens is too small to learn anything")
        g = torch.Generator().manual_seed(seed)
        self.vocab = vocab
        self.successors = torch.randint(vocab, (vocab, len(SUCCESSOR_PROBS)), generator=g)
        self.probs = torch.tensor(SUCCESSOR_PROBS)

    @property
    def entropy(self) -> float:
        """Nats per token of the chain: the floor the training loss approaches (successor lists
        may repeat a token, which only lowers the true floor)."""
        return -sum(p * math.log(p) for p in SUCCESSOR_PROBS)

    def batch(self, batch: int, seq_len: int, generator: torch.Generator) -> torch.Tensor:
        """(batch, seq_len) token ids, each row a walk on the chain from a uniform first token."""
        out = torch.empty(batch, seq_len, dtype=torch.long)
        out[:, 0] = torch.randint(self.vocab, (batch,), generator=generator)
        choices = torch.multinomial(self.probs.expand(batch, -1), seq_len - 1, replacement=True, generator=generator)
        for i in range(1, seq_len):
            out[:, i] = self.successors[out[:, i - 1], choices[:, i - 1]]
        return out


def rank_generator(seed: int, rank: int) -> torch.Generator:
    """Each trainer rank draws its own batches, reproducibly."""
    return torch.Generator().manual_seed(seed * 1_000_003 + 1 + rank)
