"""The vLLM engine's init, traced where it runs: in a process vLLM spawns (its engine core or a
worker), which a test cannot reach into, of a server the test starts with this folder first on
its PYTHONPATH. Python imports sitecustomize at the start of every process, so vLLM's processes
import this one too; where WEIGHTSYNC_TEST_TRACE_INIT names a file, an import hook wraps
WeightsyncEngine.init_transfer_engine as vLLM imports the engine's module, and each init is
followed as it runs (support/paths.py: the init info and what it names, init_of) and written to
that file as JSON. weightsync itself keeps no hook for tests; without the variable this does
nothing."""

from __future__ import annotations

import importlib.abc
import importlib.util
import json
import os
import sys
from pathlib import Path

TRACE_ENV = "WEIGHTSYNC_TEST_TRACE_INIT"
ENGINE = "weightsync.vllm_backend.engine"
ENTRY = "WeightsyncEngine.init_transfer_engine"


def _paths():
    """support/paths.py, loaded from its file: this folder's parent's packages stay off vLLM's path."""
    spec = importlib.util.spec_from_file_location("traced_init_paths", Path(__file__).resolve().parents[1] / "paths.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def traced_engine(engine: type, out: Path) -> None:
    """`engine`'s init_transfer_engine, each call followed and every trace so far written to `out`."""
    paths = _paths()
    init_transfer_engine = engine.init_transfer_engine
    traces: list[dict] = []

    def traced(self, init_info):
        path = paths.Path()
        failed = None
        try:
            return path.traced(lambda: init_transfer_engine(self, init_info), ENGINE, ENTRY, paths.init_of(init_info))
        except BaseException as e:
            failed = f"{type(e).__name__}: {e}"
            raise
        finally:
            traces.append({"steps": path.steps, "up": path.up, "calls": path.calls, "said": str(path),
                           "failed": failed, "pid": os.getpid(), "engine": sys.modules[ENGINE].__file__})
            partial = out.with_name(out.name + f".{os.getpid()}")
            partial.write_text(json.dumps(traces))
            partial.replace(out)

    engine.init_transfer_engine = traced


class WrapEngine(importlib.abc.MetaPathFinder):
    """Finds the engine's module as the other finders do, and wraps its engine once it ran."""

    def __init__(self, out: Path):
        self.out = out

    def find_spec(self, name, path, target=None):
        if name != ENGINE:
            return None
        spec = next(filter(None, (f.find_spec(name, path, target) for f in sys.meta_path
                                  if f is not self and hasattr(f, "find_spec"))), None)
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module

        def run(module):
            exec_module(module)
            traced_engine(module.WeightsyncEngine, self.out)

        spec.loader.exec_module = run
        return spec


if os.environ.get(TRACE_ENV):
    sys.meta_path.insert(0, WrapEngine(Path(os.environ[TRACE_ENV])))
