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

from weightsync.job import states

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "worker" / "weightsync"
# Low to high. The facade (__init__) and the command (cli) sit on top.
LAYERS = ["job", "model", "plan", "transport", "transfer", "rendezvous", "runtime", "publisher", "vllm_backend",
          "roles", "local", "bench", "integrations", "cli"]
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
    "weightsync.model.flat": "the native cast is an optional build (the operator installs without a compiler)",
    "weightsync.rendezvous.channel": "the store's client is torch.distributed's Store: the controller and roster load no torch",
    "weightsync.vllm_backend": "vLLM's LoRA resolver (adapter.py) loads only in a server of a LoRA job: the plugin's "
                               "entry point loads no torch",
    "weightsync.plan.simulate": "transformers, for a config named by model type, only when one is named",
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


@pytest.mark.parametrize("name", sorted(MODULES))
def test_a_module_fits_in_a_readers_mind(name):
    lines = len(MODULES[name].read_text().splitlines())
    assert lines <= MAX_LINES, f"{MODULES[name].relative_to(ROOT)} has {lines} lines: split it by what it answers"


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
