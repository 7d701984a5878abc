"""Fixtures of the operations tests."""

from __future__ import annotations

import pytest
from opskit import NotifySocket


@pytest.fixture
def notify_socket():
    n = NotifySocket()
    yield n
    n.close()
