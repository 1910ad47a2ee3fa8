"""Transports behind one interface (see base.py): tcp, nccl, uccl, and ipc (colocated ranks).

make_transport(name, ...) builds one; a transport that cannot run on this machine raises
TransportUnavailable saying why. There is no silent fallback: `auto` is resolved once, by
resolve_transport, into a name and the reason for it, which the caller reports.
"""

from __future__ import annotations

from weightsync.transport.base import Receiver, Sender, TransferError, Transport, TransportUnavailable

NAMES = ("tcp", "nccl", "uccl", "ipc")
# The transports whose receivers land one frame's bytes in several runs of the version (a bucket
# that bundles a sharded rank's runs of several tensors); the others take one run per frame.
SCATTERING = ("tcp",)
# The largest range (bucket) a transport moves in one transfer, where it has a limit: uccl's
# transfer sizes are 32-bit.
RANGE_LIMITS = {"uccl": (1 << 32) - 1}

__all__ = ["NAMES", "RANGE_LIMITS", "SCATTERING", "Receiver", "Sender", "TransferError", "Transport",
           "TransportUnavailable", "make_transport", "resolve_transport"]


def make_transport(name: str, *, token: bytes, timeout: float = 300.0, **options) -> Transport:
    """Build the named transport.

    tcp:  options socket_buffer (bytes).
    nccl: options store (a torch.distributed Store shared by every trainer and inference rank),
          trainers, inferences (world sizes); or group (a ready NCCL process group whose ranks
          are trainers 0..M-1 then inference M..M+N-1), with trainers and inferences.
          backend "gloo" runs the same code on host tensors (machines without GPUs, tests).
    uccl: options gpu (local GPU index, default 0).
    ipc:  no options (trainer and inference ranks on one node, GPUs visible to both).
    Every transport authenticates its connections with `token` and fails a silent peer after
    `timeout` seconds.
    """
    if name == "tcp":
        from weightsync.transport.tcp import TcpTransport

        return TcpTransport(token, timeout, **options)
    if name == "nccl":
        from weightsync.transport.nccl import NcclTransport

        return NcclTransport(token=token, timeout=timeout, **options)
    if name == "uccl":
        from weightsync.transport.uccl import UcclTransport

        return UcclTransport(token=token, timeout=timeout, **options)
    if name == "ipc":
        from weightsync.transport.ipc import IpcTransport

        return IpcTransport(token=token, timeout=timeout, **options)
    raise ValueError(f"unknown transport {name!r}; use one of {', '.join(NAMES)}")


def resolve_transport(requested: str, network_mode: str, colocated: bool = False) -> tuple[str, str]:
    """The transport `requested` (spec.transfer.transport) means here, and why: auto picks ipc
    when every rank of the job shares this machine's GPUs (`colocated`), uccl on an RDMA network
    with GPUs and the uccl package, else nccl with GPUs, else tcp."""
    if requested != "auto":
        return requested, f"spec.transfer.transport is {requested}"
    from weightsync.transport import nccl, uccl

    gpu_problem = nccl.unavailable_reason()
    if colocated and gpu_problem is None:
        return "ipc", "auto: every rank shares this machine's GPUs: CUDA IPC"
    if network_mode == "rdma" and gpu_problem is None and uccl.unavailable_reason() is None:
        return "uccl", "auto: RDMA network, GPUs and the uccl package are present"
    if gpu_problem is None:
        why = "the network is not rdma" if network_mode != "rdma" else f"uccl cannot run ({uccl.unavailable_reason()})"
        return "nccl", f"auto: GPUs with NCCL are present; {why}"
    return "tcp", f"auto: {gpu_problem}"
