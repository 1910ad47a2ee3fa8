"""The vLLM release weightsync's backend is tested with is said in one version everywhere: the
Makefile's pin (VLLM_VERSION, what the tests install), vllm_backend.VLLM_TESTED (what a server
that refuses to start names), the README and docs/jobs.md; none says "or later"."""

from __future__ import annotations

import re
from pathlib import Path

from weightsync.vllm_backend import VLLM_TESTED

ROOT = Path(__file__).resolve().parents[3]


def test_the_makefile_pins_the_release_the_backend_names():
    pin = re.search(r"^VLLM_VERSION := (\S+)$", (ROOT / "Makefile").read_text(), re.M)
    assert pin is not None and pin.group(1) == VLLM_TESTED, (pin and pin.group(1), VLLM_TESTED)


def test_the_docs_say_the_same_release_and_no_later_one():
    for doc in ("README.md", "docs/jobs.md"):
        text = " ".join((ROOT / doc).read_text().split())
        said = re.findall(r"Tested with vLLM (\d[\d.]*\d)", text)
        assert said == [VLLM_TESTED], (doc, said)
        assert not re.search(r"vLLM \S+ or later", text), doc
