"""The env tests share one rule: the worker processes a test module's tool calls started
(``runtime.workers.shared_pool``) are stopped when the module ends."""

from __future__ import annotations

import pytest

from rlhf_lightning.runtime.workers import close_shared_pools


@pytest.fixture(scope="module", autouse=True)
def _stop_shared_workers():
    yield
    close_shared_pools()
