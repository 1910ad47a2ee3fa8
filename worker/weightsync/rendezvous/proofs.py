"""The proofs that a rank or the controller holds the job's token, over what it publishes: a
rank's proof of what it joined with, the controller's signatures of the plan and of each rank's share of it, of the job it
publishes for external ranks and of the inference ranks' endpoints, and the keys of a vLLM
server's control routes. Each is an HMAC (job/token.py) bound to what it proves, so that none can
be taken for another.
"""

from __future__ import annotations

from weightsync.job.token import mac

# The proofs below are hex HMACs (job/token.py) of their parts, each preceded by its length.
LENGTHS = "<Q"


def rank_proof(token: bytes, nonce: bytes, role: str, rank: int, endpoint: str, meta: str, info: str) -> str:
    """A rank's proof of what it published for an attempt, over the controller's nonce for it."""
    return mac(token, b"rank", nonce, role, str(rank), endpoint, meta, info, lengths=LENGTHS).hex()


def plan_mac(token: bytes, text: str | bytes) -> str:
    """The controller's signature of the plan it published."""
    return mac(token, b"plan", text, lengths=LENGTHS).hex()


def share_mac(token: bytes, role: str, rank: int, text: str | bytes) -> str:
    """The controller's signature of one rank's share of the plan, bound to that rank."""
    return mac(token, b"plan-share", role, str(rank), text, lengths=LENGTHS).hex()


def job_mac(token: bytes, identity: str, text: str | bytes) -> str:
    """The controller's signature of the job it published for external ranks, bound to the job's
    identity (namespace/name)."""
    return mac(token, b"job", identity, text, lengths=LENGTHS).hex()


def peers_mac(token: bytes, epoch: int, text: str | bytes) -> str:
    """The controller's signature of the inference ranks' endpoints as of `epoch`."""
    return mac(token, b"peers", str(epoch), text, lengths=LENGTHS).hex()


def update_proof(token: bytes, job: str, version: int) -> str:
    """What the controller sends with its request that a vLLM server load `version`: a load
    proves the job's token even where a server's control routes were open to its clients."""
    return mac(token, b"vllm-update", job, str(version), lengths=LENGTHS).hex()


def control_key(token: bytes, job: str) -> str:
    """The bearer key of a vLLM server's control routes (vllm_backend/guard.py): the controller
    and the pod's own process send it, a server of the job compares it; a key, not the token,
    so that what crosses the wire opens those routes and nothing else."""
    return mac(token, b"vllm-control", job, lengths=LENGTHS).hex()
