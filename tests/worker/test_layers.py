"""The worker's layers, checked: a package imports only packages below it (in the order a version
travels, from the job contract up to the command), never one above it, not even inside a function;
no two modules import each other, directly or around a loop; no module a reader cannot hold in
mind; the operator imports the job contract alone; and nothing outside rendezvous/ reaches into
the store client of a rendezvous object, which has a verb for what is asked of it. Imports inside
a function are kept for heavy optional dependencies (torch, vLLM, uccl, ...), never for
weightsync's own modules."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from support.paths import LAYERS

from weightsync.job import states

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "worker" / "weightsync"
MAX_LINES = 450
MAX_UNITS = 15
# The imports of weightsync's own modules that stay inside a function, each for a heavy or optional
# dependency that the module's other callers must not pay for.
LAZY = {
    "weightsync.cli": "each subcommand loads what it runs: `weightsync --help` and `weightsync plan` load no torch",
    "weightsync.roles": "each role loads its own program: the controller's pod loads no torch",
    "weightsync.roles.controller.planning": "spec.model is built (torch) only to name the rank whose model is wrong: "
                                            "the controller's pod loads no torch",
    "weightsync.transport": "nccl and uccl load their libraries (torch.distributed's NCCL, uccl) only when chosen",
    "weightsync.transport.ws64_kernels": "the kernels' module imports Triton, which only a GPU checksum needs: "
                                          "the controller, and every host range, load no Triton",
    "weightsync.model.flat": "the native cast is an optional build (the operator installs without a compiler)",
    "weightsync.rendezvous.channel": "the store's client is torch.distributed's Store: the controller and roster load no torch",
    "weightsync.vllm_backend": "vLLM's LoRA resolver (adapter.py) loads only in a server of a LoRA job, and vLLM's "
                               "internals (internals.py, torch) only where vLLM loads the plugin: importing the "
                               "package loads no torch",
    "weightsync.plan.simulate": "transformers, for a config named by model type, only when one is named",
    "weightsync.vllm_backend.inflight": "vLLM's internals (internals.py, torch) only at a keep pause, in vLLM's API "
                                        "server: the controller, which signs its calls with the guard, loads no torch",
}


def modules() -> dict[str, Path]:
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


MODULES = modules()


def imports(path: Path) -> list[tuple[str, bool, int]]:
    """(module imported, whether inside a function, line) of every weightsync import in a file."""
    tree = ast.parse(path.read_text())
    package = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts[:-1])
    found = []

    def visit(node, nested):
        for child in ast.iter_child_nodes(node):
            inner = nested or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            if isinstance(child, ast.ImportFrom):
                if child.level:
                    base = package.split(".")[: len(package.split(".")) - child.level + 1]
                    module = ".".join(base + ([child.module] if child.module else []))
                else:
                    module = child.module or ""
                for alias in child.names:
                    full = f"{module}.{alias.name}"
                    found.append((full if full in MODULES else module, inner, child.lineno))
            elif isinstance(child, ast.Import):
                found.extend((alias.name, inner, child.lineno) for alias in child.names)
            visit(child, inner)

    visit(tree, False)
    return [(m, nested, line) for m, nested, line in found if m == "weightsync" or m.startswith("weightsync.")]


def layer(module: str) -> int | None:
    parts = module.split(".")
    return LAYERS.index(parts[1]) if len(parts) > 1 and parts[1] in LAYERS else None


def test_no_package_imports_one_above_it():
    wrong = []
    for name, path in MODULES.items():
        here = layer(name)
        for imported, _, line in imports(path):
            there = layer(imported)
            if here is not None and there is not None and there > here:
                wrong.append(f"{path.relative_to(ROOT)}:{line} ({LAYERS[here]}) imports {imported} ({LAYERS[there]})")
    assert not wrong, "lower layers import upper ones:\n" + "\n".join(wrong)


def test_weightsync_is_never_imported_inside_a_function():
    lazy = [f"{path.relative_to(ROOT)}:{line} imports {imported}" for name, path in MODULES.items()
            if name != "weightsync" and name not in LAZY for imported, nested, line in imports(path) if nested]
    assert not lazy, "imports of weightsync's own modules inside functions:\n" + "\n".join(lazy)


def test_no_import_cycle():
    graph = {name: {m for m, _, _ in imports(path) if m in MODULES and m != name} for name, path in MODULES.items()}
    # a module importing its own package's facade is not a cycle of two modules
    for name in graph:
        graph[name] = {m for m in graph[name] if not name.startswith(m + ".")}
    state: dict[str, int] = {}
    cycles = []

    def walk(node, trail):
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                cycles.append(" -> ".join(trail[trail.index(nxt):] + [nxt]))
            elif nxt not in state:
                walk(nxt, trail + [nxt])
        state[node] = 2

    for name in sorted(graph):
        if name not in state:
            walk(name, [name])
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


# the worker's modules and the operator's: one limit for every module of the project
SIZED = {**MODULES,
         **{f"weightsync_operator.{p.stem}": p for p in (ROOT / "operator" / "weightsync_operator").glob("*.py")}}


@pytest.mark.parametrize("name", sorted(SIZED))
def test_a_module_fits_in_a_readers_mind(name):
    lines = len(SIZED[name].read_text().splitlines())
    assert lines <= MAX_LINES, f"{SIZED[name].relative_to(ROOT)} has {lines} lines: split it by what it answers"


def test_the_package_has_few_top_level_units():
    units = sorted(p.name for p in PACKAGE.iterdir()
                   if not p.name.startswith((".", "__pycache__")) and (p.suffix == ".py" or p.is_dir()))
    assert len(units) <= MAX_UNITS, units
    assert set(units) - {"__init__.py", "cli.py"} <= set(LAYERS), units


def test_the_operator_imports_only_the_job_contract():
    wrong = []
    for path in sorted((ROOT / "operator").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([node.module or ""] if isinstance(node, ast.ImportFrom)
                     else [a.name for a in node.names] if isinstance(node, ast.Import) else [])
            for module in names:
                if module.startswith("weightsync.") and not module.startswith("weightsync.job"):
                    wrong.append(f"{path.relative_to(ROOT)}:{node.lineno} imports {module}")
                if isinstance(node, ast.ImportFrom) and module == "weightsync":
                    wrong += [f"{path.relative_to(ROOT)}:{node.lineno} imports weightsync.{a.name}"
                              for a in node.names if a.name not in ("job", "__version__")]
    assert not wrong, "\n".join(wrong)


# Constants outside job/ that spell a phase's word and are not a job's phase, each with its reason.
NOT_PHASES = {"KUEUE_PENDING", "KUEUE_SUCCEEDED", "KUEUE_FAILED"}  # Kueue's reasons (weightsync_operator/queueing.py)


def test_no_job_phase_is_spelled_outside_the_job_contract():
    """A job's phases and end states are spelled once, in job/states.py: a phase written as a
    string elsewhere could drift from the CRD's enum (as a metrics list once did)."""
    phases = set(states.PHASES)
    wrong = []
    paths = [p for p in sorted(PACKAGE.rglob("*.py")) if "job" not in p.relative_to(PACKAGE).parts[:1]]
    for path in paths + sorted((ROOT / "operator").rglob("*.py")):
        tree = ast.parse(path.read_text())
        allowed = {id(c) for node in ast.walk(tree) if isinstance(node, ast.Assign)
                   and {t.id for t in ast.walk(node.targets[0]) if isinstance(t, ast.Name)} <= NOT_PHASES
                   for c in ast.walk(node.value)}
        wrong += [f"{path.relative_to(ROOT)}:{node.lineno} spells {node.value!r}" for node in ast.walk(tree)
                  if isinstance(node, ast.Constant) and node.value in phases and id(node) not in allowed]
    assert not wrong, "job phases spelled outside weightsync/job/states.py:\n" + "\n".join(wrong)


# `.store` attributes outside rendezvous/ that are no rendezvous object's store client, each with
# its reason: (module, the expression whose .store it is).
OWN_STORES = {
    # the nccl transport's own torch store, handed to it in its options (NcclOptions.store)
    ("weightsync.transport.nccl", "options"), ("weightsync.transport.nccl", "self"),
    ("weightsync.transport.nccl", "self.t"),
    # the benchmark's barrier over the case's own TCPStore, which no rendezvous is part of
    ("weightsync.bench.rank_process", "self"),
}


def test_nothing_outside_the_rendezvous_reaches_into_its_store():
    """The rendezvous objects (Channel, Member, Host) say what they do with their store in verbs
    (end, resumes, starts, verification_failed, c10d_store, close, ...): a module that reached into
    `.store` would write keys and values that rendezvous/ no longer knows of. A method named store
    that is called (Sync.store(), the trainer's torch store) is a verb of its own."""
    wrong = []
    for name, path in MODULES.items():
        if name.startswith("weightsync.rendezvous"):
            continue
        tree = ast.parse(path.read_text())
        called = {id(node.func) for node in ast.walk(tree) if isinstance(node, ast.Call)}
        wrong += [f"{path.relative_to(ROOT)}:{node.lineno} reads {ast.unparse(node)}" for node in ast.walk(tree)
                  if isinstance(node, ast.Attribute) and node.attr == "store" and id(node) not in called
                  and (name, ast.unparse(node.value)) not in OWN_STORES]
    assert not wrong, "modules outside rendezvous/ that reach into a store client (give the rendezvous a verb):\n" + \
        "\n".join(wrong)


DOOR = "weightsync.vllm_backend.internals"
OWN = {"self", "cls"}  # a class's own attributes, private or not, are its own business
REACHING = {"__dict__", "__wrapped__"}


def reaches_in(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, what) of every reach into another object's internals: a private attribute read of
    anything but self or cls, an attribute written on anything but self (a patch), __dict__ or
    __wrapped__, setattr or delattr, getattr or hasattr of a private name, the heap (gc), and an
    import of a private module (vllm._custom_ops)."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            own = isinstance(node.value, ast.Name) and node.value.id in OWN
            dunder = node.attr.startswith("__") and node.attr.endswith("__")
            if node.attr in REACHING or (node.attr.startswith("_") and not dunder and not own):
                found.append((node.lineno, f"reads .{node.attr}"))
            elif isinstance(node.ctx, (ast.Store, ast.Del)) and not (isinstance(node.value, ast.Name)
                                                                      and node.value.id == "self"):
                found.append((node.lineno, f"writes {ast.unparse(node)}"))
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
            name = node.args[1].value if len(node.args) > 1 and isinstance(node.args[1], ast.Constant) else ""
            private = isinstance(name, str) and name.startswith("_") and not name.startswith("__")
            if node.func.id in ("setattr", "delattr") or (node.func.id in ("getattr", "hasattr") and private):
                found.append((node.lineno, ast.unparse(node)))
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names = [a.name for a in node.names] + ([node.module] if isinstance(node, ast.ImportFrom) and node.module else [])
            found += [(node.lineno, f"imports {n}") for n in names
                      if n == "gc" or any(p.startswith("_") and not p.startswith("__") for p in n.split("."))]
    return found


BEHIND_THE_DOOR = ("weightsync.vllm_backend", "weightsync.integrations")  # the server's side and the trainers'


def test_only_the_door_reaches_into_vllm():
    """vLLM's private attributes, the patches of its objects and the heap scan the backend and the
    trainer engine rely on are named in vllm_backend/internals.py alone, which probes each on the
    installed vLLM (the server's when the plugin loads, the trainer engine's as it is imported): no
    other module of vllm_backend/ or integrations/ reaches into vLLM (or torch) itself."""
    wrong = [f"{path.relative_to(ROOT)}:{line} {what}" for name, path in MODULES.items()
             if name.startswith(BEHIND_THE_DOOR) and name != DOOR
             for line, what in reaches_in(ast.parse(path.read_text()))]
    assert not wrong, "vllm_backend/ and integrations/ modules that reach into vLLM's internals (name them in " \
        "internals.py):\n" + "\n".join(wrong)


def test_the_check_sees_each_kind_of_reach():
    """The door's check catches what it looks for (a check that finds nothing proves nothing)."""
    source = """
import gc
from vllm._custom_ops import cpu_prepack_moe_weight
manager._load_adapter = load
held = manager._adapter_manager
twin.__dict__["w"] = w
setattr(module, "tp_rank", 0)
kernel.process_weights_for_onednn = keeping
present = hasattr(mapper, "_map_name_with_shard")
self._seen = {}
name = loader.__name__
"""
    found = reaches_in(ast.parse(source))
    assert sorted({line for line, _ in found}) == [2, 3, 4, 5, 6, 7, 8, 9], found
    assert not [what for line, what in found if line in (10, 11)], found
    assert reaches_in(ast.parse(MODULES[DOOR].read_text())), "internals.py reaches into nothing: the check is blind"


def test_nothing_outside_the_rendezvous_pairs_a_key_with_a_record():
    """A store key and the record written or read under it are paired once, in rendezvous/ (a verb
    of Member, Host or Channel: say_staged, say_applied, publish_reference, ...): a module outside it
    that set or got a value under Keys.<...> would pair them a second time, by hand."""
    wrong = []
    for name, path in MODULES.items():
        if name.startswith("weightsync.rendezvous"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in ("set", "get")
                    and node.args and "Keys." in ast.unparse(node.args[0])):
                wrong.append(f"{path.relative_to(ROOT)}:{node.lineno} {ast.unparse(node)[:80]}")
    assert not wrong, "store keys paired with their records outside rendezvous/ (give it a verb):\n" + "\n".join(wrong)
