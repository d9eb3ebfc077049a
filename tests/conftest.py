"""Test session settings."""

from __future__ import annotations

import pytest


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Run the vLLM tests last.

    vLLM's CPU engine, started in the test process, binds the process's OpenMP threads and
    memory to a NUMA node and reduces torch's threads; tests collected after it (timing
    tests of the control loop among them) would otherwise run in that changed process.
    """
    items.sort(key=lambda item: item.nodeid.startswith("tests/test_llm.py"))
