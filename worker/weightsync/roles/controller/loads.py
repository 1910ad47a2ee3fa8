"""The controller's part in each version's load into the job's vLLM servers, and what a load that
fails does to the round.

Once every receiver of a round has the version received and verified (staged), every server loads
it at once between two steps (vllm_backend/control.py): over its HTTP control routes, or, for a
vLLM Ray actor held by the trainer that runs this controller in process, through the actor's
methods (integrations/vllm_actor.py), the same steps. A server that stopped answering goes out
of the round if its ranks went away with it (killed, preempted: they rejoin and get the next round
in full); so does one whose ranks went away while its call is still open (its engine died, and its
API process waits on for the load it will never answer), without waiting for the call's deadline.
A server that answered that its load failed is judged by its ranks' own word, which they leave in
the store as they see it fail (runtime/inbound.LoadFailed): with
spec.inference.onLoadFailure rollBack each says it failed and which whole version it holds (none,
where vLLM reloaded part of the layers in place), and the round goes on without it; with failJob
each reports the failure, reason LoadFailed, and the job fails. A server whose ranks say nothing
of the kind (they loaded, or refused the call) fails the job as before (ServerLoadFailed): what it
serves is no longer what its label says.

A server none of whose workers failed is loaded only where all of them staged: with loadAhead a
worker whose load into its second copy failed part-way stages nothing, and its server, served copy
untouched, is not loaded; its other workers are told to discard what they staged (Keys.unloaded).

Also here: where each round's seconds went (phases), for its record.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, Mapping

from weightsync.job import CONTROLLER, INFERENCE, WorkerContext, reasons
from weightsync.job.errors import JobFailed
from weightsync.job.role_sections import KEEP
from weightsync.rendezvous.messages import Applied, Round
from weightsync.rendezvous.proofs import control_key, update_proof
from weightsync.rendezvous.protocol import HEARTBEAT, who
from weightsync.rendezvous.roster import Host
from weightsync.rendezvous.rounds import BACK_POLL
from weightsync.runtime.faults import pause_point
from weightsync.vllm_backend.control import ControlError, Server, Session, Steps, Unreachable, UpdateTimes
from weightsync.vllm_backend.guard import MIDDLEWARE

# seconds for an external vLLM server that joined (its model loaded) to serve: vLLM profiles, sizes
# its KV cache and compiles after the weight-transfer engine is built
SERVE_TIMEOUT = 900.0


@dataclass(frozen=True)
class ServerLoads:
    """How a round's load into the vLLM servers went, as the controller saw it."""

    staging: float  # seconds from the reference digest to every receiver staged (received and verified)
    prepare: float | None  # with loadAhead, the slowest worker's load into its second copy, before the pause
    slowest: UpdateTimes  # each call's and the stall's longest over the servers


def load_on_servers(ctx: WorkerContext, host: Host, rnd: Round, timeout: float, say: Callable[[str], None],
                    driven: Mapping[str, Steps]) -> ServerLoads:
    """Once every receiver of the round has it staged, every vLLM server loads it at once; returns
    how long the staging took and each server's calls (the module's docstring says what a server
    that fails does). `driven`: the servers this process drives otherwise than over HTTP, by the
    name their workers claimed under; every other one's name is its URL."""
    began = time.monotonic()
    staged = host.collect_staged(rnd, timeout)
    staging = time.monotonic() - began
    pause_point(CONTROLLER, 0, "staged", rnd.version)
    proof = update_proof(ctx.token, ctx.job.identity, rnd.version)
    key = control_key(ctx.token, ctx.job.identity)
    # one update per server: a tensor-parallel server's workers are several ranks, and vLLM's update
    # has every worker load its own staged version; {server: its ranks}
    servers: dict[str, list[int]] = {}
    for rank in sorted(staged):
        servers.setdefault(host.rank_info(rank).server, []).append(rank)
    for url, ranks in list(servers.items()):
        ahead = [r for r in host.receiving() if r not in staged and host.rank_info(r) is not None
                 and host.rank_info(r).server == url and host.applied_of(rnd, r) is not None]
        if ahead:  # a worker's load ahead failed: the server serves on its copy, untouched
            del servers[url]
            for r in ranks:
                host.say_unloaded(rnd.version, r)
            say(f"the vLLM server of {who(INFERENCE, ranks[0])} does not load {rnd.name}: "
                f"{', '.join(who(INFERENCE, r) for r in ahead)} failed to load it ahead; its other workers discard it")
    def failed(rank: int, e: ControlError) -> JobFailed:
        return JobFailed(f"{who(INFERENCE, rank)} (pod {host.rank_info(rank).pod}) did not load {rnd.name} "
                         f"into its vLLM server: {e}", reasons.SERVER_LOAD_FAILED)

    keep = ctx.job.inference.vllm.inflight == KEEP

    def load(url: str) -> UpdateTimes | ControlError:
        session = Session.of([staged[r] for r in servers[url]])
        try:
            if url in driven:  # a vLLM Ray actor of the trainer's process, its owner (integrations/vllm_actor.py)
                return driven[url].update(rnd.version, proof, timeout, session, keep)
            server = Server(url, key)
            if ctx.job.inference.external:  # a server the user started joined as vLLM built it, before it served
                server.wait_up(SERVE_TIMEOUT)
                if server.open_to_clients():  # its control routes, which relabel and reset, would be any client's
                    raise ControlError(f"{server.url} answers its control routes to any client: start it with "
                                       f"--middleware {MIDDLEWARE} (docs/jobs.md, vLLM)")
            return server.update(rnd.version, proof, timeout, session, keep)
        except ControlError as e:
            return e  # judged on this thread, which keeps the roster: its ranks may be gone, or say why

    loads = calls(host, servers, load, rnd.name)
    for url, got in loads.items():
        ranks = servers[url]
        if isinstance(got, Unreachable):
            if not host.gone(ranks, 2 * host.limit_for(INFERENCE) + 2 * HEARTBEAT):
                raise failed(ranks[0], ControlError(f"{got}; its workers beat on, so the server is alive")) from None
            say(f"the vLLM server of {who(INFERENCE, ranks[0])} stopped answering while it loaded {rnd.name} "
                f"({got}) and its ranks went away: {rnd.name} goes on without them")
        elif isinstance(got, ControlError):
            said = ranks_word(host, rnd, ranks, host.limit_for(INFERENCE))
            if said is None or all(a.load_failed is None for a in said.values()):
                raise failed(ranks[0], got) from None
            say(f"the vLLM server of {who(INFERENCE, ranks[0])} (pod {host.rank_info(ranks[0]).pod}) failed to load "
                f"{rnd.name} part-way ({got}); spec.inference.onLoadFailure rollBack: it answers its clients 503 until "
                "the next version loads whole, and the job goes on")
    times = [t for t in loads.values() if isinstance(t, UpdateTimes)]
    ahead = [got.prepare_seconds for got in staged.values() if got.prepare_seconds is not None]
    return ServerLoads(staging, max(ahead) if ahead else None, UpdateTimes.slowest(times))


def calls(host: Host, servers: dict[str, list[int]], load: Callable[[str], UpdateTimes | ControlError],
          what: str) -> dict[str, UpdateTimes | ControlError]:
    """Each server's load of `what` (the round's name), called at once on threads of their own: its
    answer, or Unreachable once its ranks left the round while its call was open (check_ranks keeps
    the roster meanwhile); that call is left to end at its own deadline."""
    pool = ThreadPoolExecutor(max_workers=max(1, len(servers)))
    futures = {url: pool.submit(load, url) for url in servers}
    loads: dict[str, UpdateTimes | ControlError] = {}
    try:
        while len(loads) < len(futures):
            for url, future in futures.items():
                if url in loads:
                    continue
                if future.done():
                    loads[url] = future.result()
                elif host.left_round(servers[url]):
                    loads[url] = Unreachable(f"{url}: its workers went away while it loaded {what}, its call open")
            if len(loads) < len(futures):
                host.check_ranks(trainers=not host.resuming)
                time.sleep(BACK_POLL)
    finally:
        pool.shutdown(wait=False)
    return loads


def ranks_word(host: Host, rnd: Round, ranks: list[int], within: float) -> dict[int, Applied] | None:
    """{rank: what it applied} once every one of `ranks` said what became of the round (applied it,
    or failed to load it: Applied.load_failed), None where they did not within `within` seconds.
    A rank that reports a failure instead (failJob: LoadFailed) fails the job from here (check_ranks)."""
    deadline = time.monotonic() + within
    while True:
        said = {r: host.applied_of(rnd, r) for r in ranks}
        if all(got is not None for got in said.values()):
            return said
        if time.monotonic() > deadline:
            return None
        host.check_ranks(trainers=not host.resuming)
        time.sleep(0.01)


def phases(transfer: float, verify: float, loads: ServerLoads | None, applied: dict[int, Applied],
           after: float) -> dict[str, float]:
    """Where a round's seconds went (the round record's phases): the transfer (go to every
    trainer's report), the reference digest, with vLLM servers the staging, each control call,
    the workers' own load (the slowest) and the stall; then the wait for every rank's applied."""
    phases = {"transfer": transfer, "verify": verify}
    if loads is not None:
        phases["staging"] = loads.staging
        if loads.prepare is not None:
            phases["prepare"] = loads.prepare
        phases.update(loads.slowest.to_json())
        engine = [got.load_seconds for got in applied.values() if got.load_seconds is not None]
        if engine:
            phases["load"] = max(engine)
    phases["applied"] = after
    return {k: round(v, 6) for k, v in phases.items()}
