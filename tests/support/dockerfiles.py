"""Reading the project's Dockerfiles: what the tests check of them without a container engine
(the real-pod tests build and run them: tests/node)."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILES = ("Dockerfile.operator", "Dockerfile.worker")


def instructions(dockerfile: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    out, pending = [], ""
    for line in (ROOT / dockerfile).read_text().splitlines():
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        word, _, rest = (pending + line).strip().partition(" ")
        out.append((word.upper(), rest.strip()))
        pending = ""
    return out


def exec_form(dockerfile: str, instruction: str) -> list[str]:
    """The last ENTRYPOINT or CMD, which must be in exec (JSON) form."""
    found = [args for name, args in instructions(dockerfile) if name == instruction]
    return json.loads(found[-1]) if found else []


def installed_extras(dockerfile: str) -> set[str]:
    """The extras of this project that the Dockerfile's `pip install "./[...]"` installs."""
    extras = set()
    for name, args in instructions(dockerfile):
        if name == "RUN" and "pip install" in args:
            for word in shlex.split(args):
                m = re.fullmatch(r"\./\[([a-z0-9,_-]+)\]", word)
                if m:
                    extras |= set(m.group(1).split(","))
    return extras
