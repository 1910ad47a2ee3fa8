"""A trainer rank's connections to the inference ranks, kept in step with the controller's rounds:
a rank that went away is dropped, and one that came back (a new attempt, at its new endpoint or
at the same one) is dialled again. The same peers name the job's vLLM servers, for a script that
sends its own requests to them (Sync.servers)."""

from __future__ import annotations

from weightsync.job import INFERENCE
from weightsync.rendezvous.messages import Peer, RankInfo, Round
from weightsync.rendezvous.protocol import Member, who
from weightsync.transport.base import TransferError


class Connections:
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

    def servers(self) -> tuple[str, ...]:
        """The URLs of the inference ranks' vLLM servers as of the last round, each once, in rank
        order (a tensor-parallel server's workers name the same one): what each worker told the
        controller when it joined (RankInfo.server), read back under its proof of the job token."""
        urls: list[str] = []
        for r, peer in sorted(self.peers.items()):
            server = self._info(r, peer.attempt).server
            if server is not None and server not in urls:
                urls.append(server)
        return tuple(urls)

    def _info(self, rank: int, attempt: int) -> RankInfo:
        return self.member.info_of(INFERENCE, rank, attempt)
