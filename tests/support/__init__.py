"""Helpers the tests share: real processes, jobs and clients that several test modules use.
Test modules import from here, never from one another; fixtures shared by a folder live in its conftest.py."""

from pathlib import Path

SUPPORT = Path(__file__).resolve().parent  # where the helper scripts the tests start as processes live
