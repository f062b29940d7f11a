"""Fixtures of the speculative decoding tests."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def tiny(target):
    """The tiny Llama as a Target: conftest.py's `target`, under the name these tests give it."""
    return target
