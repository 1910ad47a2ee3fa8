"""The names of the rendezvous store's keys, every one of them in one place: who writes each,
and what is under it (the typed messages are in messages.py; protocol.py is a rank's side of the
rendezvous, roster.py the controller's)."""

from __future__ import annotations


class Keys:
    """Every key of the rendezvous (role is "trainer" or "inference", rank the rank within it).
    The controller deletes a version's keys but its record (done) two versions later (Host.forget)."""

    FAILURES = "failures"  # counter: failures reported (failed/<role>/<rank> says whose)
    VERIFY_FAILURES = "verify_failures"  # counter: versions that failed verification
    PLAN, PLAN_MAC = "plan", "plan/mac"  # controller: the plan, HMAC'd with the token
    # controller: the defaulted job (Job.to_object(), its resolved network mode as an annotation)
    # that external ranks read instead of a spec file (rendezvous/external_rank.py), HMAC'd with the token
    JOB, JOB_MAC = "job", "job/mac"
    END = "end"  # controller: the job is over {"state", "reason", "message"}
    CLOSED = "closed"  # counter: trainer ranks that closed (closed/<rank> says after which version)
    LATEST = "latest"  # controller: the last version it said go for (its first sending)
    RESUMING = "resuming"  # counter: the times the trainers began to resume from their checkpoint
    # controller: where the trainers resumed, last {"resumes", "version" (the next one), "delivered"
    # (the last delivered, or None), "step" (its step), "attempts" {trainer rank: its start}}
    RESUME = "resume"

    @staticmethod
    def join(role: str, rank: int) -> str:
        """rank: a counter, its attempt number (above 1: its process started again)."""
        return f"join/{role}/{rank}"

    @staticmethod
    def nonce(role: str, rank: int, attempt: int) -> str:
        """controller: a fresh random challenge for that attempt."""
        return f"nonce/{role}/{rank}/{attempt}"

    @staticmethod
    def published(what: str, role: str, rank: int, attempt: int) -> str:
        """rank: its "endpoint", "meta" (FlatLayout json), "info" (RankInfo) and "proof" (HMAC of
        the nonce and the other three) for that attempt."""
        return f"{what}/{role}/{rank}/{attempt}"

    @staticmethod
    def peers(epoch: int) -> str:
        """controller: the inference ranks' endpoints as of `epoch` (0 at the plan; one more per
        rejoin), and .../mac its HMAC."""
        return f"peers/{epoch}"

    @staticmethod
    def ready(version: int, rank: int) -> str:
        """trainer: ready to send `version`."""
        return f"ready/{version}/{rank}"

    @staticmethod
    def closed(rank: int) -> str:
        """trainer: it publishes no more versions; the value is the last it published (-1: none)."""
        return f"closed/{rank}"

    @staticmethod
    def go(version: int, again: int = 0) -> str:
        """controller: a Round (json); again > 0 sends the final version once more, to ranks that
        rejoined after it went out."""
        return f"go/{version}" if not again else f"go/{version}/again/{again}"

    @staticmethod
    def sent(version: int, again: int, rank: int) -> str:
        """trainer: its report of the round (SentReport)."""
        return f"sent/{version}/{rank}" if not again else f"sent/{version}/again/{again}/{rank}"

    @staticmethod
    def cut(version: int, again: int = 0) -> str:
        """controller: the receivers of a round it counted away while the round was on its way
        (json list); trainers stop sending to them at once instead of waiting out their timeout."""
        return f"cut/{version}" if not again else f"cut/{version}/again/{again}"

    @staticmethod
    def dropped(version: int) -> str:
        """controller: why it dropped that version while it was on its way (a trainer rank stopped
        and the trainers resume); its receivers take none of it and wait for the next."""
        return f"dropped/{version}"

    @staticmethod
    def ref(version: int) -> str:
        """controller: the digest of `version` from all trainers' checksums."""
        return f"ref/{version}"

    @staticmethod
    def ref_of(version: int, rank: int) -> str:
        """controller: the digest inference rank `rank` must have for `version`, its own entry of
        Keys.ref: a receiver reads it, not every receiver's digests."""
        return f"ref/{version}/{rank}"

    @staticmethod
    def applied(version: int, rank: int, attempt: int) -> str:
        """inference: received, verified and switched to `version` (in that attempt)."""
        return f"applied/{version}/{rank}/{attempt}"

    @staticmethod
    def staged(version: int, rank: int, attempt: int) -> str:
        """inference (vLLM): received and verified `version`, waiting for the controller to have
        its server load it (then applied)."""
        return f"staged/{version}/{rank}/{attempt}"

    @staticmethod
    def unloaded(version: int, rank: int, attempt: int) -> str:
        """controller: the rank's vLLM server does not load `version`, which the rank staged (another
        of its workers failed to load it ahead): the rank discards it and serves on."""
        return f"unloaded/{version}/{rank}/{attempt}"

    @staticmethod
    def away(rank: int, attempt: int) -> str:
        """controller: why it counted that start of an inference rank away; the start must end, and
        the rank start again to rejoin (a rank counted away is taken back only as a new start)."""
        return f"away/{rank}/{attempt}"

    @staticmethod
    def replica(start: int) -> str:
        """controller: how many times the built-in tensor-parallel replica whose first inference
        rank is `start` went away (absent: never); its ranks form their process group under it."""
        return f"replica/{start}"

    @staticmethod
    def welcome(rank: int, attempt: int) -> str:
        """controller: the Round a rejoined inference rank receives first."""
        return f"welcome/{rank}/{attempt}"

    @staticmethod
    def done(version: int, again: int = 0) -> str:
        """controller: the round's record."""
        return f"done/{version}" if not again else f"done/{version}/again/{again}"

    @staticmethod
    def failed(role: str, rank: int) -> str:
        """any rank: why it gave up (the FAILURES counter goes up with it)."""
        return f"failed/{role}/{rank}"

    @staticmethod
    def beat(role: str, rank: int) -> str:
        """any rank: a counter bumped every HEARTBEAT seconds."""
        return f"beat/{role}/{rank}"

    @staticmethod
    def bye(role: str, rank: int) -> str:
        """any rank: saw the end; the controller may go."""
        return f"bye/{role}/{rank}"
