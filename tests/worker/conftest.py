"""Fixtures of the worker's tests: a store the ranks rendezvous through, and ranks of the transfer
path as real processes (tests/support/transfer.py)."""

from support.transfer import ranks, store  # noqa: F401 - fixtures
