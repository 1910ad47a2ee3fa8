"""The checksum every transport carries with a range: xxh3_64 of its bytes, over byte views.

It sits below the transports and transfer.py, which all hash the same bytes the same way (the
sender while it sends or casts, the receiver while it lands them), in chunks of CHUNK bytes so
that each chunk is hashed while it is still in cache.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import xxhash

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
    """xxh3_64 of a bucket: its producer's once it is whole, when it has one (a Filling); else
    computed, from host memory directly or from device memory through one host copy."""
    if filling is not None:
        return filling.result()
    if hasattr(data, "data_ptr") and data.device.type != "cpu":
        data = data.cpu()
    return checksum_of(as_views(data))
