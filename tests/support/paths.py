"""How far an entry point's parameter travels: the modules a value given to one of weightsync's
entry points (the controller's context, a trainer's rank in attach, the vLLM engine's init info)
passes through, traced as the code runs rather than read off the imports.

From the entry point's frame on, a call that hands the value on (`carries` says which arguments
do: the value itself, or an object holding it) is followed, and so are the calls those make in
turn; every other call is left out. A step is a call from one weightsync module into another; the
steps are counted once per pair of modules (ten calls from the protocol to the keys are one step).
A step back up a layer is a call from a module into one of a higher layer (test_layers' order),
which no import allows, so only a callback makes one. The profiler follows the thread it is
started on."""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Any, Callable

# The worker's packages, low to high (test_layers checks that none imports one above it). The facade
# (__init__) and the command (cli) sit on top.
LAYERS = ["job", "model", "plan", "transport", "transfer", "rendezvous", "runtime", "publisher", "vllm_backend",
          "roles", "local", "bench", "integrations", "cli"]


def layer(module: str) -> int:
    """A weightsync module's layer (the facade and anything else above every package)."""
    parts = module.split(".")
    return LAYERS.index(parts[1]) if len(parts) > 1 and parts[1] in LAYERS else len(LAYERS)


@dataclass
class Path:
    """The steps a value took from the entry points traced (Path.follow), in the order first taken."""

    steps: list[tuple[str, str]] = field(default_factory=list)  # (from module, to module)
    calls: int = 0  # calls between modules that handed the value on, repeats included

    @property
    def modules(self) -> set[str]:
        return {m for step in self.steps for m in step}

    @property
    def up(self) -> list[tuple[str, str]]:
        return [(a, b) for a, b in self.steps if layer(b) > layer(a)]

    def __str__(self) -> str:
        return (f"{len(self.steps)} steps between {len(self.modules)} modules ({self.calls} calls), "
                f"{len(self.up)} back up a layer:\n" + "\n".join(f"  {a} -> {b}" for a, b in self.steps))

    def follow(self, module: str, function: str, carries: Callable[[str, Any], bool]):
        """A profiler (for sys.setprofile) that follows the value from each call of `function` (its
        qualified name) in `module` on: `carries(name, value)` says whether an argument hands it on."""
        carriers: dict[int, Any] = {}  # id(frame) -> frame, of the frames that hold the value

        def holds(frame) -> bool:
            code = frame.f_code
            names = code.co_varnames[:code.co_argcount + code.co_kwonlyargcount]
            return any(carries(n, frame.f_locals.get(n)) for n in names)

        def profile(frame, event, arg) -> None:
            if event == "return":
                carriers.pop(id(frame), None)
                return
            if event != "call":
                return
            name = frame.f_globals.get("__name__", "")
            if not name.startswith("weightsync"):
                return
            if name == module and frame.f_code.co_qualname == function:
                carriers[id(frame)] = frame
                return
            caller = frame.f_back
            if caller is None or carriers.get(id(caller)) is not caller or not holds(frame):
                return
            carriers[id(frame)] = frame
            came = caller.f_globals.get("__name__", "")
            if came != name:
                self.calls += 1
                if (came, name) not in self.steps:
                    self.steps.append((came, name))

        return profile

    def traced(self, run: Callable[[], Any], module: str, function: str, carries: Callable[[str, Any], bool]):
        """run(), its calls followed on this thread (follow); what it returns."""
        previous = sys.getprofile()
        sys.setprofile(self.follow(module, function, carries))
        try:
            return run()
        finally:
            sys.setprofile(previous)


def holding(value: Any) -> Callable[[str, Any], bool]:
    """Arguments that carry `value`: the value itself, or an object holding it as an attribute
    (the controller holding its context, a rank's life holding it too)."""
    def carries(name: str, arg: Any) -> bool:
        if arg is value:
            return True
        return any(v is value for v in getattr(arg, "__dict__", {}).values())

    return carries


def rank_of(rank: int) -> Callable[[str, Any], bool]:
    """Arguments that carry a rank: one named `rank` that is it, or an object whose `rank` it is
    (a Member, a RankLife, a Sync, a transport's end)."""
    def carries(name: str, arg: Any) -> bool:
        if name == "rank" and arg == rank and isinstance(arg, int):
            return True
        held = getattr(arg, "__dict__", {}).get("rank")
        return isinstance(held, int) and held == rank

    return carries


def init_of(init: Any) -> Callable[[str, Any], bool]:
    """Arguments that carry the vLLM engine's init info (engine.WeightsyncInitInfo): the init
    itself, one of the values it names (its job, its controller, this server's URL, its proof),
    or an object holding either as an attribute (the join it is made into, a Place, a store client)."""
    named = {v for v in vars(init).values() if isinstance(v, str) and v}

    def carried(value: Any) -> bool:
        return value is init or (isinstance(value, str) and value in named)

    def carries(name: str, arg: Any) -> bool:
        return carried(arg) or any(carried(v) for v in getattr(arg, "__dict__", {}).values())

    return carries
