"""The shared multi-process harness's pool (tests/harness.py): a task it cannot send fails the
caller at once (the queue's feeder thread would drop it and the call would wait its timeout)."""

import pickle
import time

import pytest

from tests.harness import run_ranks


def _identity(value):
    return value


def test_a_task_that_cannot_be_pickled_fails_at_once():
    start = time.monotonic()
    with pytest.raises((pickle.PicklingError, AttributeError, TypeError)):
        run_ranks(_identity, 2, lambda: None, timeout=600)
    assert time.monotonic() - start < 5
