"""The CRD's structural schema applied to a job as the API server applies it: defaults, unknown
fields (strict field validation), the OpenAPI schema and the CEL rules. Each check returns the
problems it finds, as "path: what to fix" lines; the job contract (job/spec.py) raises them.

A separate module so that the contract reads as the contract (names, layout, environment) and
this as the mechanics of one Kubernetes feature. Imports neither torch nor the Kubernetes client.
"""

from __future__ import annotations

import copy
import difflib
import functools
import math
from pathlib import Path
from typing import Any, Mapping

import yaml


def choices(names, limit: int = 8) -> str:
    """A list of names for a message: all of them when few, else the first `limit` and a count."""
    names = list(names)
    if len(names) <= limit:
        return ", ".join(names)
    return f"{', '.join(names[:limit])} and {len(names) - limit} more"


def did_you_mean(name: str, known) -> str:
    """' (did you mean X?)' for the closest known name, or ''."""
    close = difflib.get_close_matches(name, list(known), n=1, cutoff=0.7)
    return f" (did you mean {close[0]}?)" if close else ""


@functools.cache
def crd() -> dict:
    """The CRD as shipped in the package (the same file as crds/ and the chart's)."""
    return yaml.safe_load((Path(__file__).parent / "crd.yaml").read_text())


def openapi_schema(version: str) -> dict:
    """The openAPIV3Schema of one version of the CRD."""
    (served,) = [v for v in crd()["spec"]["versions"] if v["name"] == version]
    return served["schema"]["openAPIV3Schema"]


def apply_defaults(node_schema: Mapping, value: Any) -> Any:
    """Structural-schema defaulting as the API server does it: an absent property with a default
    takes it, then defaulting recurses into what is there (including defaults just placed)."""
    if isinstance(value, dict):
        props = node_schema.get("properties", {})
        for name, sub in props.items():
            if name not in value and "default" in sub:
                value[name] = copy.deepcopy(sub["default"])
            if name in value:
                value[name] = apply_defaults(sub, value[name])
        extra = node_schema.get("additionalProperties")
        if isinstance(extra, dict):
            for name in value.keys() - props.keys():
                value[name] = apply_defaults(extra, value[name])
    elif isinstance(value, list) and "items" in node_schema:
        return [apply_defaults(node_schema["items"], v) for v in value]
    return value


def schema_problems(node_schema: Mapping, obj: dict) -> list[str]:
    import jsonschema

    def path(err) -> str:
        return ".".join(str(p) for p in err.absolute_path) or "(root)"

    def message(err) -> str:  # a large value is named by its type, not printed whole
        shown = repr(err.instance)
        return err.message if len(shown) <= 80 else err.message.replace(shown, f"a {type(err.instance).__name__}")

    validator = jsonschema.Draft4Validator(_strip_extensions(node_schema))
    errors = sorted(validator.iter_errors(obj), key=lambda e: list(map(str, e.absolute_path)))
    return [f"{path(e)}: {message(e)}" for e in errors] + not_finite(obj, "")


INT64 = (-(2 ** 63), 2 ** 63 - 1)  # the integers the API server (and CEL) hold


def not_finite(value: Any, where: str) -> list[str]:
    """Numbers the API server cannot carry, which would pass the schema's bounds here: NaN and
    infinities (they compare false; YAML's .nan and .inf), and integers beyond 64 bits (the API
    server's int64; CEL fails on them), refused wherever they stand."""
    if isinstance(value, float) and not math.isfinite(value):
        return [f"{where or '(root)'}: {value!r} is not a finite number"]
    if isinstance(value, int) and not isinstance(value, bool) and not INT64[0] <= value <= INT64[1]:
        shown = str(value) if value.bit_length() <= 128 else f"an integer of {value.bit_length()} bits"
        return [f"{where or '(root)'}: {shown} does not fit in 64 bits (from {INT64[0]} to {INT64[1]})"]
    if isinstance(value, dict):
        return [p for k, v in value.items() for p in not_finite(v, f"{where}.{k}" if where else str(k))]
    if isinstance(value, list):
        return [p for i, v in enumerate(value) for p in not_finite(v, f"{where}[{i}]")]
    return []


# The fields of every object's metadata (ObjectMeta), which the API server checks itself: the
# CRD's schema says only `type: object` there.
OBJECT_META = ("name", "generateName", "namespace", "selfLink", "uid", "resourceVersion", "generation",
               "creationTimestamp", "deletionTimestamp", "deletionGracePeriodSeconds", "labels", "annotations",
               "ownerReferences", "finalizers", "managedFields")


def unknown_fields(node: Mapping, value: Any, where: str) -> list[str]:
    """Fields the schema does not declare, refused as the API server refuses them with strict field
    validation (kubectl's default): without this a misspelt field is dropped and its default used.
    Objects that keep unknown fields (x-kubernetes-preserve-unknown-fields: spec.model.config is
    checked against its transformers config class by the worker) or take any key
    (additionalProperties) are not structural here."""
    if isinstance(value, list) and "items" in node:
        return [p for i, v in enumerate(value) for p in unknown_fields(node["items"], v, f"{where}[{i}]")]
    if not isinstance(value, dict):
        return []
    props = dict(node.get("properties", {}))
    if where == "metadata":
        props.update({name: {} for name in OBJECT_META})
    extra = node.get("additionalProperties")
    closed = bool(props) and not extra and not node.get("x-kubernetes-preserve-unknown-fields")
    problems = []
    for name, v in value.items():
        path = f"{where}.{name}" if where else name
        if name in props:
            problems += unknown_fields(props[name], v, path)
        elif isinstance(extra, dict):
            problems += unknown_fields(extra, v, path)
        elif closed:
            problems.append(f"{path}: unknown field{did_you_mean(name, props) or f' (known: {choices(props)})'}")
    return problems


def _strip_extensions(node: Any) -> Any:
    """The schema as plain JSON Schema, without the x-kubernetes-* keys."""
    if isinstance(node, dict):
        return {k: _strip_extensions(v) for k, v in node.items() if not k.startswith("x-kubernetes-")}
    if isinstance(node, list):
        return [_strip_extensions(v) for v in node]
    return node


def cel_rules(node: Mapping, value: Any, where: str) -> list[str]:
    """Evaluate the CRD's x-kubernetes-validations (transition rules, which need the old object,
    are left to the API server)."""
    problems: list[str] = []
    for rule in node.get("x-kubernetes-validations", []):
        if "oldSelf" in rule["rule"]:
            continue
        if not _cel(rule["rule"], value):
            problems.append(f"{where or 'metadata.name'}: {rule.get('message', rule['rule'])}")
    if isinstance(value, dict):
        for name, sub in node.get("properties", {}).items():
            if name in value:
                problems += cel_rules(sub, value[name], f"{where}.{name}" if where else name)
    elif isinstance(value, list) and "items" in node:
        for i, item in enumerate(value):
            problems += cel_rules(node["items"], item, f"{where}[{i}]")
    return problems


def _cel(rule: str, value: Any) -> bool:
    import celpy

    env = celpy.Environment()
    program = env.program(env.compile(rule), functions=_kubernetes_cel_functions())
    return bool(program.evaluate({"self": celpy.json_to_cel(value)}))


def _kubernetes_cel_functions() -> dict:
    """The functions of the Kubernetes CEL libraries the CRD's rules use that are not standard
    CEL (and so not in celpy): the lists library's sum()."""
    from celpy import celtypes

    def list_sum(items):
        return celtypes.IntType(sum(int(item) for item in items))

    return {"sum": list_sum}
