"""Transports behind one interface (see base.py): tcp, nccl, uccl, and ipc (colocated ranks).

make_transport(name, ...) builds one, with the options options_for makes for a rank; what each
can do is capabilities_of(name). A transport that cannot run on this machine raises
TransportUnavailable saying why. There is no silent fallback: `auto` is resolved once, by
resolve_transport, into a name and the reason for it, which the caller reports.
"""

from __future__ import annotations

import importlib
from typing import Any

from weightsync.transport.base import (
    Capabilities,
    RankContext,
    Receiver,
    Sender,
    TransferError,
    Transport,
    TransportUnavailable,
)

# Each transport's module and class, imported when first asked for (none of them imports torch or
# a transport's own library before it is built).
CLASSES = {"tcp": ("tcp", "TcpTransport"), "nccl": ("nccl", "NcclTransport"), "uccl": ("uccl", "UcclTransport"),
           "ipc": ("ipc", "IpcTransport")}
NAMES = tuple(CLASSES)

__all__ = ["NAMES", "Capabilities", "RankContext", "Receiver", "Sender", "TransferError", "Transport",
           "TransportUnavailable", "capabilities_of", "make_transport", "options_for", "resolve_transport",
           "transport_class"]


def transport_class(name: str) -> type[Transport]:
    """The class of the named transport; ValueError for a name that is none."""
    if name not in CLASSES:
        raise ValueError(f"unknown transport {name!r}; use one of {', '.join(NAMES)}")
    module, cls = CLASSES[name]
    return getattr(importlib.import_module(f"{__name__}.{module}"), cls)


def capabilities_of(name: str) -> Capabilities:
    """What the named transport can do, as its class declares it (a transport built for host
    memory, nccl over gloo, says so on itself)."""
    return transport_class(name).capabilities


def options_for(name: str, context: RankContext) -> Any:
    """The named transport's options for a rank that offers `context`: the one place where a
    job's rank becomes what a transport is built with."""
    return transport_class(name).options_for(context)


def make_transport(name: str, *, token: bytes, timeout: float = 300.0, options: Any = None) -> Transport:
    """Build the named transport with its `options` (its own Options record, e.g. tcp.TcpOptions;
    None: its defaults, where it has them; options_for builds them for a job's rank).

    tcp:  TcpOptions(socket_buffer).
    nccl: NcclOptions(trainers, inferences (world sizes), store (a torch.distributed Store shared
          by every trainer and inference rank), or group (a ready NCCL process group whose ranks
          are trainers 0..M-1 then inference M..M+N-1), device, backend: "gloo" runs the same
          code on host tensors (machines without GPUs, tests)).
    uccl: UcclOptions(gpu (local GPU index, default 0)).
    ipc:  IpcOptions(), none (trainer and inference ranks on one node, GPUs visible to both).
    Every transport authenticates its connections with `token` and fails a silent peer after
    `timeout` seconds.
    """
    cls = transport_class(name)
    if options is None:
        return cls(token, timeout)
    if not isinstance(options, cls.Options):
        raise TypeError(f"the {name} transport takes {cls.Options.__name__}, not {type(options).__name__}")
    return cls(token, timeout, options)


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
