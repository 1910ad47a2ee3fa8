"""What a trainer on vLLM's RL API sends from: its `source`, vLLM's WeightSource.

A ModuleSource is read as weightsync reads any module: each rank's own parameters, an FSDP2
rank's shards as they are, never gathered (where vLLM's ModuleSource yields full tensors, a
collective per parameter). Any other WeightSource (a Megatron export, an expert- or
pipeline-parallel producer: vLLM's contract) yields full Hugging Face tensors and says which of them
this rank holds (held_names): weightsync keeps storage for those on the rank, in the order and
shapes of the source's metadata, and before each version iterates the source on every rank in
lockstep, as the contract asks (its materializing may be a collective), copying what the rank
holds. Each tensor is then held whole by the ranks whose held_names name it, and the plan
balances it among them as among DDP replicas; a name no rank holds is refused at the job's start
by the controller's check that every row is held.
"""

from __future__ import annotations

import torch
from vllm.distributed.weight_transfer.base import ModuleSource, WeightSource

from weightsync.publisher.sources import NamedTensors
from weightsync.vllm_backend.internals import source_module


class SourceTensors(NamedTensors):
    """A WeightSource's tensors as this rank holds them, filled again by fill() before each version."""

    def __init__(self, source: WeightSource, device: torch.device | str):
        self.source = source
        metadata = source.metadata()
        names = [m.name for m in metadata]
        if len(set(names)) != len(names):
            raise ValueError(f"{type(source).__name__}.metadata() names a tensor twice: name every parameter once")
        held = source.held_names()
        if held is not None and not set(held) <= set(names):
            raise ValueError(f"{type(source).__name__}.held_names() names tensors its metadata() does not "
                             f"({', '.join(sorted(set(held) - set(names))[:3])}): metadata() describes the whole model "
                             "on every rank")
        super().__init__([(m.name, tuple(m.shape), m.dtype) for m in metadata], held, device)
        self.config = getattr(source, "config", None)

    def fill(self) -> None:
        """Iterate the source once (every rank does, in the same order) and copy each tensor this
        rank holds into its storage; a tensor that is not as the metadata said is refused by name."""
        seen = 0
        for name, tensor in self.source:
            if name not in self.tensors:
                raise ValueError(f"{type(self.source).__name__} yielded {name!r}, which its metadata() does not name")
            if tensor is None or not self.held(name):
                continue
            mine = self.tensors[name]
            if tuple(tensor.shape) != tuple(mine.shape) or tensor.dtype != mine.dtype:
                raise ValueError(f"{type(self.source).__name__} yielded {name} as {list(tensor.shape)} {tensor.dtype}; "
                                 f"its metadata() says {list(mine.shape)} {mine.dtype}")
            mine.copy_(tensor.detach())
            seen += 1
        held = sum(self.held(n) for n in self.tensors)
        if seen != held:
            raise ValueError(f"{type(self.source).__name__} yielded {seen} of the {held} tensors this rank holds: one "
                             "pass of iter(source) yields every tensor metadata() names")


def weights_of(source) -> tuple[object, SourceTensors | None]:
    """What the rank publishes from (`source`'s module, or its tensors) and, for a source that is
    no ModuleSource, the tensors to fill before each version."""
    if isinstance(source, ModuleSource):
        return source_module(source), None
    if not isinstance(source, WeightSource):
        raise TypeError(f"weightsync's trainer engine sends from a vLLM WeightSource (ModuleSource(model), or one of "
                        f"your own), not {type(source).__name__}")
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    tensors = SourceTensors(source, device)
    return tensors, tensors
