"""The plan over slices published in shares (plan/shares.py): the controller sets every rank's
share under a key of its own, signed with the job token, before the plan's header (Keys.PLAN),
which the ranks wait for; a rank reads the header and its own share, and no other rank's. A plan
that is not over slices is published whole, as before.
"""

from __future__ import annotations

from weightsync.job.token import same
from weightsync.plan.interface import TransferPlan
from weightsync.plan.rank_plan import RankPlan, is_shares
from weightsync.plan.shares import share_out
from weightsync.plan.sliced_plan import SlicedPlan, plan_from_json
from weightsync.rendezvous.messages import Text
from weightsync.rendezvous.proofs import share_mac


def share_key(role: str, rank: int) -> str:
    return f"plan-share/{role}/{rank}"


def publish_shares(channel, token: bytes, plan: TransferPlan) -> str:
    """Set every rank's share of `plan` where it is over slices; returns the text to publish as
    the plan (its header, or the whole plan's JSON)."""
    if not isinstance(plan, SlicedPlan):
        return plan.to_json()
    shares = share_out(plan)
    for role, texts in (("trainer", shares.trainers), ("inference", shares.inferences)):
        for rank, text in enumerate(texts):
            channel.set(share_key(role, rank), Text(text))
            channel.set(share_key(role, rank) + "/mac", Text(share_mac(token, role, rank, text)))
    return shares.header


def own_share(member, text: str, timeout: float, refused: type[Exception] = ValueError) -> str | None:
    """`member`'s rank's share of the published plan `text`, checked to come from a holder of the
    token (`refused` raised where it does not: protocol.ProofError); None where the plan is
    published whole."""
    if not is_shares(text):
        return None
    key = share_key(member.role, member.rank)
    member.wait_for(key + "/mac", "this rank's share of the transfer plan", timeout)
    share = member.get(key)
    if not same(member.get(key + "/mac").decode(), share_mac(member.token, member.role, member.rank, share)):
        raise refused("this rank's share of the published plan is not signed with this job's token")
    return share.decode()


def own_plan(member, text: str, timeout: float, refused: type[Exception] = ValueError) -> TransferPlan:
    """The plan `member`'s rank uses, from the published plan's `text`: the whole plan, or the
    header and this rank's share."""
    share = own_share(member, text, timeout, refused)
    return plan_from_json(text) if share is None else RankPlan.from_json(text, share)
