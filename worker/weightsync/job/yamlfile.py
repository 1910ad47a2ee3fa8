"""Reading a job file as kubectl reads it, within bounds: a regular file (files.py), its size,
its depth, and the size its aliases expand to (an object that walks the job, the schema's checks
or a copy, would otherwise expand a few lines of nested aliases into gigabytes before any
refusal, and PyYAML builds a document recursively, so that a deep one ends in a RecursionError).
"""

from __future__ import annotations

import os
import re
from typing import Any

import yaml

from weightsync.job.errors import SpecError
from weightsync.job.files import MAX_DEPTH, FileProblem, read_regular

# A job file's bounds: the API server takes objects of about this size, and a job's YAML with
# its aliases expanded is a few thousand values.
MAX_FILE_BYTES = 1 << 20
MAX_EXPANDED_NODES = 100_000


class TooDeep(yaml.YAMLError):
    """A document nested deeper than MAX_DEPTH levels (PyYAML builds it recursively)."""


class KubectlLoader(yaml.SafeLoader):
    """YAML as kubectl reads it: `1e-5` is a number there (Go's YAML, like YAML 1.2), while
    PyYAML's YAML 1.1 makes it a string that the schema would then refuse. A document nested
    deeper than MAX_DEPTH levels is refused as it is read (TooDeep), before PyYAML's recursion
    (and everything that walks the job after it) reaches Python's limit."""

    depth = 0

    def compose_node(self, parent, index):
        self.depth += 1
        try:
            if self.depth > MAX_DEPTH:
                mark = self.peek_event().start_mark
                raise TooDeep(f"nested deeper than {MAX_DEPTH} levels at line {mark.line + 1}; a job is a few "
                              "levels deep: write it without the extra nesting")
            return super().compose_node(parent, index)
        finally:
            self.depth -= 1


KUBECTL_FLOAT = re.compile(r"^[-+]?(\.[0-9]+|[0-9]+(\.[0-9]*)?)([eE][-+]?[0-9]+)?$")
KubectlLoader.add_implicit_resolver("tag:yaml.org,2002:float", KUBECTL_FLOAT, list("-+0123456789."))


class KubectlDumper(yaml.SafeDumper):
    """YAML that KubectlLoader (and kubectl) reads back as it was written: a string that reads as
    a number there (`3e-3`, an argument of a trainer's command) is quoted, where PyYAML's YAML 1.1
    would leave it plain."""


KubectlDumper.add_implicit_resolver("tag:yaml.org,2002:float", KUBECTL_FLOAT, list("-+0123456789."))


def dump_document(obj: Any) -> str:
    """`obj` as one YAML document that read_document (and kubectl) reads back equal."""
    return yaml.dump(obj, Dumper=KubectlDumper, sort_keys=True)


def read_document(path: str | os.PathLike, kind: str) -> Any:
    """The one YAML document of a file holding a `kind`, or a SpecError that says what is wrong
    with the file: it is missing, too large, not a regular file, not YAML (with the line), nested
    deeper than MAX_DEPTH, aliased past MAX_EXPANDED_NODES, or holds several documents."""
    text = _read_bounded(path, kind)
    loader = KubectlLoader(text)
    try:
        documents = []
        while loader.check_node():
            node = loader.get_node()
            _check_expanded(node, path)
            document = loader.construct_document(node)
            if document is not None:
                documents.append(document)
    except TooDeep as e:
        raise SpecError([f"{path}: {e}"]) from None
    except yaml.YAMLError as e:
        raise SpecError([f"{path}: not valid YAML{_yaml_problem(e)}"]) from None
    except SpecError:
        raise
    except ValueError as e:  # Python's bound on the digits of an integer it reads (sys.get_int_max_str_digits)
        raise SpecError([f"{path}: holds an integer too long to read ({str(e).split(';')[0]}); a job's integers fit "
                         "in 64 bits"]) from None
    finally:
        loader.dispose()
    if len(documents) != 1:
        raise SpecError([f"{path}: holds {len(documents)} YAML documents; put exactly one {kind} in the file"
                         + (" (weightsync runs one job at a time)" if documents else "")])
    return documents[0]


def _read_bounded(path: str | os.PathLike, kind: str) -> str:
    """The file's text: a regular file of at most MAX_FILE_BYTES, refused otherwise before it is
    read (files.read_regular: a named pipe would hang the command, a device never end)."""
    try:
        data = read_regular(path, MAX_FILE_BYTES, f"one {kind} YAML file", "as the API server takes an object")
    except FileProblem as e:
        raise SpecError([str(e)]) from None
    try:
        return data.decode()
    except UnicodeDecodeError:
        raise SpecError([f"{path}: not a text file (YAML is UTF-8 text)"]) from None


def _check_expanded(root: yaml.Node, path) -> None:
    """Refuse a document whose aliases would expand it past MAX_EXPANDED_NODES (a "billion laughs":
    a few lines of anchors, each aliasing the one before ten times). PyYAML builds an aliased node
    once, but everything that walks the job afterwards (the schema, a copy, JSON) expands it."""
    sizes: dict[int, int] = {}

    def size(node: yaml.Node) -> int:
        if id(node) in sizes:
            return sizes[id(node)]
        sizes[id(node)] = 1  # a node that contains itself (a recursive alias) counts once
        if isinstance(node, yaml.MappingNode):
            total = 1 + sum(size(k) + size(v) for k, v in node.value)
        elif isinstance(node, yaml.SequenceNode):
            total = 1 + sum(size(v) for v in node.value)
        else:
            total = 1
        sizes[id(node)] = total = min(total, MAX_EXPANDED_NODES + 1)
        return total

    if size(root) > MAX_EXPANDED_NODES:
        raise SpecError([f"{path}: its aliases expand it past {MAX_EXPANDED_NODES} values; write the job "
                         "without nested aliases"])


def _yaml_problem(e: yaml.YAMLError) -> str:
    mark = getattr(e, "problem_mark", None)
    where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
    problem = getattr(e, "problem", None) or str(e)
    if "'\\t'" in problem:
        return f"{where}: a tab; YAML indents with spaces only"
    context = getattr(e, "context", None)
    context_mark = getattr(e, "context_mark", None)
    if context and context_mark:
        context = f"{context} that starts at line {context_mark.line + 1}"
    return f"{where}: {problem}" + (f" ({context})" if context else "")
