"""Which tier runs a test case. `make unit` is the tier a developer runs every few minutes: it
runs the first case of a matrix of real processes (a transfer between ranks on loopback, FSDP2
ranks publishing), and `make test` runs every case; the others are marked `slow`, so that they
move to the full suite and not away."""

import pytest


def first_in_unit(cases: list, ids: list[str] | None = None) -> list:
    """`cases` for pytest.mark.parametrize, each case after the first marked slow."""
    out = []
    for i, case in enumerate(cases):
        values = case if isinstance(case, tuple) else (case,)
        out.append(pytest.param(*values, id=ids[i] if ids else None, marks=() if i == 0 else pytest.mark.slow))
    return out
