"""Weight versions from real training, for benchmarks of delta versions.

How many elements a version changes is a property of training, not of the transfer: a synthetic
mask would measure whatever it was told. So the benchmark trains the model for real, with the
built-in trainer's step (model.train_step), data (data.MarkovTokens) and optimizer (AdamW, at a
learning rate RL fine-tuning uses), one version per optimizer step, and keeps every version's
float32 weights as one flat file (a FlatLayout at float32) that benchmark processes load their
weights from. changed[dtype][k] is the measured fraction of elements whose value in `dtype`
differs between versions k and k+1.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field

import torch

from weightsync.model.build import parameters, train_step
from weightsync.model.flat import FlatLayout, fill_range, torch_dtype, views
from weightsync.model.markov import MarkovTokens, rank_generator


@dataclass
class TrainedVersions:
    directory: str
    layout: FlatLayout  # of the files: float32
    count: int  # versions 0 .. count - 1; version 0 is the model before training
    learning_rate: float
    changed: dict[str, list[float]] = field(default_factory=dict)
    losses: list[float] = field(default_factory=list)
    seconds: float = 0.0  # of training

    def path(self, version: int) -> str:
        return os.path.join(self.directory, f"v{version}.f32")

    def load(self, version: int, into: list[torch.Tensor]) -> None:
        """Copy version `version` into `into`: float32 tensors in the layout's order."""
        flat = torch.from_file(self.path(version), shared=False, size=self.layout.total_bytes, dtype=torch.uint8)
        for dest, src in zip(into, views(flat, self.layout)):
            dest.copy_(src)


def train(model: torch.nn.Module, count: int, directory: str, *, learning_rate: float, batch: int, seq_len: int,
          seed: int = 0, dtypes: tuple[str, ...] = ("bfloat16",)) -> TrainedVersions:
    """Train `model` (float32) for count - 1 optimizer steps, saving version 0 and the weights
    after every step into `directory`."""
    model.train()
    params = [p for _, p in parameters(model)]
    layout = FlatLayout.from_named_tensors(parameters(model), "float32")
    out = TrainedVersions(directory, layout, count, learning_rate, {d: [] for d in dtypes})
    optimizer = torch.optim.AdamW(model.parameters(), lr=learning_rate)
    data = MarkovTokens(int(model.config.vocab_size), seed)
    generator = rank_generator(seed, 0)
    buffer = torch.empty(layout.total_bytes, dtype=torch.uint8)
    before: dict[str, list[torch.Tensor]] = {}
    start = time.monotonic()
    for version in range(count):
        if version:
            out.losses.append(float(train_step(model, optimizer, data.batch(batch, seq_len, generator))))
        with torch.no_grad():
            fill_range(layout, [p.detach() for p in params], 0, layout.total_bytes, buffer)
        buffer.numpy().tofile(out.path(version))
        for dtype in dtypes:
            now = [p.detach().to(torch_dtype(dtype), copy=True) for p in params]  # a copy also at float32
            if version:
                changed = sum(int((a.view(_int(a)) != b.view(_int(b))).sum()) for a, b in zip(before[dtype], now))
                out.changed[dtype].append(changed / sum(p.numel() for p in params))
            before[dtype] = now
    out.seconds = time.monotonic() - start
    return out


def _int(t: torch.Tensor) -> torch.dtype:
    """The integer dtype of t's element size: values compared bit for bit."""
    return {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
