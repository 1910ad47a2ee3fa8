"""A vLLM server that is a Ray actor (vLLM's RayVLLMWeightSyncClient: an LLM or AsyncLLM hosted
by an actor), driven through the actor's own methods from trainer rank 0's process, which holds the
client and runs the job's controller in process (integrations/vllm.py, no job file). Ray's things
are here and nowhere else.

Why through the actor, not over HTTP: an actor has no routes, and no address the job's controller
could dial; whoever holds its handle calls it. So the controller, on its thread in the process
that holds the handle, asks for each step of a server's update (control.Steps) and this module
makes it a call of the actor's, with ray.get's deadline:

- pause and resume: an AsyncLLM's pause_generation(mode="wait", clear_cache=True) and
  resume_generation, what an HTTP server's /pause and /resume run. An LLM (vLLM's offline engine)
  has neither and needs neither: it runs requests only inside one generate() call, and an actor
  runs one call at a time (Ray's default max_concurrency 1), so no request runs while the update's
  calls do. Its prefix cache, computed with the weights before, is reset as it resumes
  (reset_prefix_cache).
- start, load, finish and label: the same methods of either (start_weight_update,
  update_weights with the version and the job's proof, which the workers check as they do a
  server's; finish_weight_update and update_weight_version).

What a version is to an actor: its weight_version (get_weight_version, and every output's) is
the version's number once its update returned, as on an HTTP server. A generate() of an LLM runs
whole on one version; calls from other processes may land between the update's calls (Ray orders
only each caller's own), so one that lands between the load and the label runs on the new weights
under the old label: generate from the process that sends, or after send_weights() returned.

An actor's workers claim their ranks under a name (ray-actor-N, the client's place among those
given), which the trainer's signed init gives them: not a URL, which no controller dials. An actor
that died is Unreachable (its workers' heartbeats stop with it, and the job counts it away as a
server that went away); an error raised in it, a ControlError with its message, on one line.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.weight_transfer.base import WeightTransferUpdateRequest
from vllm.distributed.weight_transfer.clients import RayVLLMWeightSyncClient

from weightsync.vllm_backend.control import ControlError, Steps, Unreachable

NAME = "ray-actor-{}"  # an actor's name in the job: its client's place among the clients given


def said(error: BaseException) -> str:
    """What an actor's call raised, on one line: the exception raised in the actor (a RayTaskError's
    cause), without Ray's traceback."""
    cause = getattr(error, "cause", None) or error
    return " ".join(f"{type(cause).__name__}: {cause}".split())[:2000]


@dataclass(frozen=True)
class ActorServer(Steps):
    name: str
    handle: object = field(repr=False)  # the Ray actor's handle
    pauses: bool = False  # the actor has pause_generation and resume_generation (an AsyncLLM)

    @classmethod
    def of(cls, name: str, handle) -> ActorServer:
        return cls(name, handle, hasattr(handle, "pause_generation") and hasattr(handle, "resume_generation"))

    def call(self, method: str, limit: float, *args, **kwargs):
        """The actor's `method` called, its answer within `limit` seconds."""
        import ray
        from ray.exceptions import GetTimeoutError, RayActorError

        try:
            return ray.get(getattr(self.handle, method).remote(*args, **kwargs), timeout=limit)
        except GetTimeoutError:
            raise Unreachable(f"{self.name}.{method}() did not answer within {limit:.0f}s") from None
        except RayActorError as e:  # the actor died, or cannot be reached
            raise Unreachable(f"{self.name}.{method}(): the actor is gone ({said(e)})") from None
        except Exception as e:  # noqa: BLE001 - raised in the actor: its message, on one line
            raise ControlError(f"{self.name}.{method}() failed: {said(e)}") from None

    def pause(self, limit: float, keep: bool = False) -> None:
        if keep:  # no guard in front of an actor salts its requests' prefix cache by version (inflight.py)
            raise ControlError(f"{self.name}: spec.inference.vllm.inflight keep needs vLLM's HTTP server, whose guard "
                               "keys every request's prefix cache by version; a Ray actor is updated with finish")
        if self.pauses:
            self.call("pause_generation", limit, mode="wait", clear_cache=True)

    def abort(self, limit: float) -> None:
        if self.pauses:
            self.call("pause_generation", limit, mode="abort", clear_cache=True)

    def start(self, limit: float) -> None:
        self.call("start_weight_update", limit)

    def load(self, version: int, proof: str, limit: float) -> None:
        self.call("update_weights", limit, WeightTransferUpdateRequest(update_info={"version": version, "proof": proof}))

    def finish(self, label: str, limit: float) -> None:
        self.call("finish_weight_update", limit, label)

    def label(self, label: str, limit: float) -> None:
        self.call("update_weight_version", limit, label)

    def resume(self, limit: float) -> None:
        self.call("resume_generation" if self.pauses else "reset_prefix_cache", limit)


def servers_of(clients: list) -> tuple[list[str], dict[str, ActorServer]]:
    """Each client's server's name in the job (an HTTP client's URL, an actor's NAME), and the
    actors among them; ValueError, one line, for a client weightsync cannot drive."""
    names: list[str] = []
    actors: dict[str, ActorServer] = {}
    for i, client in enumerate(clients):
        url = getattr(client, "base_url", None)
        if url:
            names.append(url)
            continue
        if not isinstance(client, RayVLLMWeightSyncClient):
            raise ValueError(f"{type(client).__name__}: weightsync drives each vLLM server over its HTTP routes or "
                             "through its Ray actor: pass HTTPVLLMWeightSyncClient(url) or RayVLLMWeightSyncClient(handle), "
                             "one per server (or a list of them)")
        if len(client.handles) != 1:
            raise ValueError(f"RayVLLMWeightSyncClient over {len(client.handles)} actors: weightsync drives each server "
                             "on its own; give one RayVLLMWeightSyncClient(handle) per actor (a list of them)")
        handle = client.handles[0]
        if any(handle == other.handle for other in actors.values()):
            raise ValueError("an actor is named twice among the clients: one RayVLLMWeightSyncClient per actor")
        names.append(NAME.format(i))
        actors[names[-1]] = ActorServer.of(names[-1], handle)
    return names, actors


def refusal(name: str, error: BaseException) -> str:
    """The one line a trainer says where the actor `name` refused its init."""
    return f"the vLLM Ray actor {name} refused the init: {said(error)}"
