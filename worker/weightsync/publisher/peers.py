"""A trainer rank's connections to the inference ranks, kept in step with the controller's rounds:
a rank that went away is dropped, and one that came back (a new attempt, at its new endpoint or
at the same one) is dialled again."""

from __future__ import annotations

from weightsync.job import INFERENCE
from weightsync.rendezvous.messages import Peer, Round
from weightsync.rendezvous.protocol import Member, who
from weightsync.transport.base import TransferError


class Links:
    def __init__(self, sender, member: Member, endpoints: dict[int, str], timeout: float):
        self.sender, self.member, self.timeout = sender, member, timeout
        self.peers, self.epoch = {r: Peer(e, 1) for r, e in endpoints.items()}, 0

    def follow(self, rnd: Round) -> dict[int, str]:
        """Connect to every receiver of the round; returns {rank: why} for those it cannot reach."""
        if rnd.epoch != self.epoch:
            peers = self.member.peers(rnd.epoch, self.timeout)
            for r, peer in peers.items():
                if self.peers.get(r) != peer:
                    self.sender.drop(r)
            self.peers, self.epoch = peers, rnd.epoch
        for r in self.peers:
            if r not in rnd.receivers and self.sender.connected(r):
                self.sender.drop(r)  # away: it gets nothing until it is back
        missing = {r: self.peers[r].endpoint for r in rnd.receivers if not self.sender.connected(r)}
        try:
            self.sender.connect(missing)  # all at once; the ones that answer are connected
        except TransferError as e:
            return {r: str(e) if e.peer == who(INFERENCE, r) else f"could not connect to {endpoint}"
                    for r, endpoint in missing.items() if not self.sender.connected(r)}
        return {}
