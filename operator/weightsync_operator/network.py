"""Choosing a job's network mode, once, when it is created."""

from __future__ import annotations

from typing import Iterable, Mapping

from kubernetes.utils import parse_quantity

from weightsync.job import Network


def resolve(network: Network, nodes: Iterable[Mapping]) -> tuple[str, str]:
    """(mode, reason) for a job's spec.network given the cluster's nodes. `auto` takes rdma when
    some schedulable node offers the RDMA resource in its allocatable resources, else tcp."""
    requested = network.mode
    if requested != "auto":
        return requested, f"spec.network.mode is {requested}"
    resource, count = network.rdma.resource_name, network.rdma.resource_count
    offering = sorted(
        n["metadata"]["name"] for n in nodes
        if not (n.get("spec") or {}).get("unschedulable")
        and parse_quantity(((n.get("status") or {}).get("allocatable") or {}).get(resource, 0)) >= count
    )
    if offering:
        shown = ", ".join(offering[:3]) + (f" and {len(offering) - 3} more" if len(offering) > 3 else "")
        return "rdma", f"auto: {len(offering)} node(s) offer {count} {resource} ({shown})"
    return "tcp", f"auto: no schedulable node offers {count} {resource} in its allocatable resources"
