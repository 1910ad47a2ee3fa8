"""The checksum every transport carries with a range, computed where its bytes lie.

- Host bytes: xxh3_64, over byte views, in chunks of CHUNK bytes so that each chunk is hashed
  while it is still in cache (the sender while it sends or casts, the receiver while it lands
  them).
- GPU bytes (the nccl, uccl and ipc transports, whose both ends hold the range in GPU memory):
  ws64 (defined in ws64.py), computed on the GPU in one pass over the bytes (ws64_kernels.py,
  Triton kernels), on whatever stream is current, with no copy to the host. xxh3 is sequential
  and would need every byte on the host. ws64 is defined on the bytes alone, so the CPU computes
  the same value (device_checksum on a host tensor: torch's elementwise kernels and one
  reduction), which is how the tests pin it.

It sits below the transports and transfer/, which all hash the same bytes the same way.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import xxhash

from weightsync.transport.ws64 import GOLDEN, MIX, U64, definition
from weightsync.transport.ws64_kernels import ws64_fused

__all__ = ["CHUNK", "GOLDEN", "MIX", "U64", "as_views", "bucket_checksum", "checksum_of", "device_checksum"]

if TYPE_CHECKING:
    from weightsync.transport.base import Filling

# bytes sent, or received, at a time and hashed at once, while they are still in cache (sizes
# measured best with `weightsync bench`)
CHUNK = 1 << 20


def checksum_of(views: list) -> int:
    """xxh3_64 of the concatenated bytes."""
    if len(views) == 1:
        return xxhash.xxh3_64_intdigest(views[0])
    h = xxhash.xxh3_64()
    for v in views:
        h.update(v)
    return h.intdigest()


def as_views(data: Any) -> list[memoryview]:
    """Byte views of what a caller hands to send(): bytes-like objects, CPU tensors, or lists."""
    if isinstance(data, (list, tuple)):
        return [v for d in data for v in as_views(d)]
    if hasattr(data, "data_ptr"):  # a torch tensor
        if data.device.type != "cpu":
            raise ValueError("the TCP transport sends host memory: stage device tensors into a host buffer first")
        import torch

        if not data.is_contiguous():
            raise ValueError("send a contiguous tensor (its bytes go out as they lie in memory)")
        return [memoryview(data.detach().reshape(-1).view(torch.uint8).numpy())]
    return [memoryview(data).cast("B")]


def bucket_checksum(data, filling: Filling | None = None) -> int:
    """The checksum of a bucket: its producer's once it is whole, when it has one (a Filling);
    else computed where it lies (xxh3_64 of host memory, ws64 of device memory)."""
    if filling is not None:
        return filling.result()
    if hasattr(data, "data_ptr") and data.device.type != "cpu":
        return int(device_checksum(data)) & U64
    return checksum_of(as_views(data))


def device_checksum(data):
    """ws64 of a tensor's bytes, computed on its device on the current stream: on a GPU by the
    fused kernel (one read of the bytes), on the CPU as the definition reads. Returns a 0-dim
    int64 tensor there (int() of it waits for that stream only; & U64 makes it the unsigned
    value that ranges carry)."""
    if data.device.type == "cuda":
        return ws64_fused(data)
    return definition(data)
