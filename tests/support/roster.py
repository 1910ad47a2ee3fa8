"""The controller's roster and its ranks in one process, as the rendezvous tests drive them: a Host
on loopback with the tests' token, the Members that join it, and what a rank publishes."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

from weightsync.rendezvous.messages import RankInfo
from weightsync.rendezvous.policy import Policy
from weightsync.rendezvous.protocol import Member
from weightsync.rendezvous.roster import Host

TOKEN = b"0123456789abcdef-job-token"


def make_host(layout, job: str, said: list[str], **policy) -> Host:
    """A controller's Host for `job` whose lines go to `said`; `policy`: its Policy's fields."""
    return Host(0, TOKEN, layout, Policy(**policy), say=said.append, address="127.0.0.1", job=job)


def member(host: Host, role: str, rank: int, job: str) -> Member:
    return Member("127.0.0.1", host.store.port, TOKEN, role, rank, timeout=10, job=job)


def join(m: Member, endpoint: str) -> int:
    """The rank joins (its start counted, the token proven) at `endpoint`; returns its attempt."""
    return m.join(endpoint, '{"layout": 1}', RankInfo("tcp", pod=f"{m.role}-{m.rank}"), timeout=10)


@contextmanager
def one_of_each(job: str) -> Iterator[tuple[Host, dict[str, Member]]]:
    """A controller's Host with its one trainer and one inference rank joined and the plan
    published, before any go; the store closed after."""
    from weightsync.job import Layout

    host = make_host(Layout(trainers=1, trainer_procs=1, inferences=1, inference_procs=1), job, [],
                     silent_limit=60.0, away_limit=60.0)
    members = {role: member(host, role, 0, job=job) for role in ("trainer", "inference")}
    for m in members.values():
        join(m, "127.0.0.1:1001")
    admitted = host.admit(timeout=10)
    host.publish_plan("{}", {0: admitted[("inference", 0)].endpoint})
    try:
        yield host, members
    finally:
        host.store.close()
