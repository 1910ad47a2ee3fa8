"""What a job's vLLM server does with its clients' generation requests around a version's load: its
guard (guard.py) holds new ones back while an update is under way, keys every request's prefix
cache by the version the server holds, and, where the requests in flight are kept across loads
(spec.inference.vllm.inflight keep), serves only the route whose answers name each token's version.

vLLM's prefix cache reuses the KV blocks of a prompt's prefix computed before, keyed by the tokens,
the LoRA adapter and the request's cache salt (vLLM's `cache_salt`, hashed into the first block's
key and through the chain into every later block's), never by the weights: a block computed with
one version and reused by a request on the next would give it the old version's keys and values
under the new version's label. Rather than clearing the whole cache at every version (which, with
requests frozen in flight, preempts them to prefill each again: vLLM resets running requests to
clear it), the guard sets every generation request's cache salt itself, server-side: the job's
own salt, naming the version the server holds and the update epoch, followed by the client's own
salt, hashed, where it gave one (clients that keep their caches apart stay apart, and none can
name another epoch's salt). Every signed control call that may change the weights (a pause, a
load, a label, vLLM's own reload, a reset of its weights) starts a new epoch, so blocks of an old
version are never matched again; they age out as vLLM's own eviction decides.

A request salted before an update and run after it would still match old blocks: so from a signed
pause (an update's start) until its resume the guard holds new generation requests back (vLLM
would queue them anyway), and salts each as it lets it through, with the version loaded. It cannot
hold a request that passed it before the pause and reaches vLLM's engine after it (the API
process's milliseconds of rendering one): under finish the pause clears the cache once the
requests in flight finished, so such a request finds no old block; under keep it is in flight
across the update, as those frozen are, and may reuse blocks of the version before as they reuse
their own KV. vLLM's spans count generated tokens: a request's prompt may have been computed on
the version before the first one its tokens name.

Under keep an answer must say which version produced which token. vLLM's token-in-token-out route
(/inference/v1/generate) does: weight_versions, spans of output tokens, each named by the label
the engine core held as it generated them, which only the job's controller sets. The OpenAI- and
Anthropic-style routes carry no such field, so a server that keeps requests across loads answers
them 400, saying where to go. The guard reads the mode from the pause itself (mode=keep): nothing
to configure, and a server the user started knows it as a pod's does. A server of several API
processes refuses such a pause (keep_problem): the controller's update fails, saying so.

Standard library only, as the guard (but for the door to vLLM's internals, asked for the number of API processes
at a keep pause, in vLLM's API server).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
from dataclasses import dataclass
from typing import Callable, TypeVar
from urllib.parse import parse_qs

SALT = "cache_salt"  # vLLM's field, on every generation route's request
SPAN_ROUTES = frozenset({"/inference/v1/generate"})  # the generation routes whose answers name each token's version
PAUSE_ROUTE, RESUME_ROUTE = "/pause", "/resume"
HOLD_CHECK = 0.5  # seconds between a held request's looks at the server's admission (the lease)

Refusal = TypeVar("Refusal")


def salt(version: int | None, epoch: int, client: str | None = None) -> str:
    """A request's cache salt: the job's, for the version held and the update epoch, then the
    client's own, hashed (within vLLM's 128 characters, none of its forbidden ones)."""
    own = f"weightsync-v{'none' if version is None else version}-e{epoch}"
    return own if client is None else f"{own}-{hashlib.sha256(client.encode()).hexdigest()[:40]}"


def salted(body: bytes, version: int | None, epoch: int) -> bytes:
    """A generation request's body with its cache salt set (salt); ValueError, one line, where it
    is not a JSON object or names a cache salt that is not a non-empty string."""
    try:
        request = json.loads(body or b"{}")
    except ValueError:
        raise ValueError("a generation request's body is a JSON object; this one is not JSON") from None
    if not isinstance(request, dict):
        raise ValueError(f"a generation request's body is a JSON object, not {type(request).__name__}")
    client = request.get(SALT)
    if client is not None and (not isinstance(client, str) or not client):
        raise ValueError(f"{SALT}, where a request names one, is a non-empty string")
    request[SALT] = salt(version, epoch, client)
    return json.dumps(request).encode()


def spanless(path: str, keep: bool) -> str | None:
    """Why a generation route must not answer on a server that keeps requests across loads (None
    where it may)."""
    if not keep or path in SPAN_ROUTES:
        return None
    return (f"{path}: this vLLM server keeps requests in flight across versions (spec.inference.vllm.inflight keep), "
            "so an answer must say which version produced which token, and only /inference/v1/generate says so "
            "(weight_versions); render a prompt to token ids with /v1/completions/render or "
            "/v1/chat/completions/render and generate through /inference/v1/generate, or run the job with "
            "inflight finish")


@dataclass(frozen=True)
class Pause:
    """What a pause's query asks, read once: its mode (vLLM's own default, abort, where it names
    none) and whether it keeps the caches (clear_cache=false)."""

    mode: str
    keeps_caches: bool

    @classmethod
    def of(cls, query: bytes) -> "Pause":
        asked = parse_qs(query.decode("latin-1"))
        return cls(asked.get("mode", ["abort"])[-1], asked.get("clear_cache", [""])[-1] == "false")


def keep_problem(scope: dict) -> str | None:
    """Why this server cannot keep requests across loads (None where it can): each of several API
    processes (vLLM's --api-server-count, read from the app's state, which vLLM's API server puts
    in every request's scope) has a guard of its own, and only the one the controller's pause
    reaches would hold and salt its requests for the update."""
    state = getattr(scope.get("app"), "state", None)
    parallel = getattr(getattr(state, "vllm_config", None), "parallel_config", None)
    if parallel is None:  # an app that is not vLLM's API server: one process
        return None
    # here, not at the top: the door imports torch (loaded in vLLM's API server), the controller loads none
    from weightsync.vllm_backend.internals import api_process_count

    count = api_process_count(parallel)
    if count == 1:
        return None
    return (f"{PAUSE_ROUTE}?mode=keep: this vLLM server runs {count} API processes (--api-server-count), and the guard "
            "of each sees only the updates sent to it, so the others would neither hold their requests for an update "
            "nor key their cache by the new version: start it with one API process, or run the job with "
            "spec.inference.vllm.inflight finish")


async def pause_kept(scope: dict, pause: Pause) -> tuple[int, dict] | None:
    """A keep pause (`pause`, its mode keep) that keeps the caches (the controller's) sent straight
    to vLLM's engine: (status, answer) as vLLM's route gives them, or None where it clears them, and
    where the app is not vLLM's API server (vLLM's route takes it, as it comes). vLLM's route
    (AsyncLLM.pause_generation) sleeps 20 ms once the engine paused, so that the last outputs of
    the requests a pause finishes reach their clients before it answers; a keep pause finishes
    none (they are frozen, their last step's outputs sent before the engine's answer), and the
    engine serves nothing in those 20 ms: the clients' stall of every update."""
    client = getattr(getattr(scope.get("app"), "state", None), "engine_client", None)
    if client is None or not pause.keeps_caches:
        return None
    from weightsync.vllm_backend.internals import pause_engine  # (torch: see keep_problem)

    try:
        await pause_engine(client, "keep")
    except Exception as e:  # noqa: BLE001 - answered as vLLM's route answers it
        return 500, {"error": f"Failed to pause generation: {e}"}
    return 200, {"status": "paused"}


class Updates:
    """The updates one API process's guard has seen: the epoch (salt), whether the last one kept
    the requests in flight, and whether one is under way (from its pause to its resume)."""

    def __init__(self) -> None:
        self.epoch = 0
        self.keep = False
        self.under_way = False
        self._held: list[asyncio.Future] = []  # a future per request held, done at the resume

    def changed(self) -> None:
        """A signed control call that may change the weights: blocks cached until now match nothing more."""
        self.epoch += 1

    def pausing(self, pause: Pause) -> None:
        """A signed pause: an update starts (a pause that aborts every request, as one after a failed
        load, says nothing of the mode)."""
        if pause.mode in ("wait", "keep"):
            self.keep = pause.mode == "keep"
        self.under_way = True
        self.changed()

    def resumed(self) -> None:
        self.under_way = False
        self.looked()

    async def hold(self, refusal: Callable[[], Refusal | None]) -> Refusal | None:
        """Until no update is under way; `refusal()`'s answer where it has one meanwhile (the
        server stopped hearing its controller, or its load failed), looked at every HOLD_CHECK
        seconds and at every signed call's end."""
        while self.under_way:
            refused = refusal()
            if refused is not None:
                return refused
            held = asyncio.get_running_loop().create_future()
            self._held.append(held)
            try:
                await asyncio.wait_for(held, HOLD_CHECK)
            except asyncio.TimeoutError:
                if held in self._held:  # (unless a call's end took it out meanwhile)
                    self._held.remove(held)
        return None

    def looked(self) -> None:
        """A signed call ended: the requests held look at the server's admission again (a load
        that failed refuses them at once)."""
        for held in self._held:
            if not held.done():
                held.set_result(None)
        self._held.clear()
