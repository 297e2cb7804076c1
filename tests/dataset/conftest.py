"""The dataset tests' fixtures: scripted hsx stand-ins (``tests/dataset/standins.py``)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest

from tests.dataset.standins import Reply, Scripted


@pytest.fixture
def servers() -> Iterator[Callable[[Callable[[dict[str, Any]], Reply]], Scripted]]:
    made: list[Scripted] = []

    def make(script: Callable[[dict[str, Any]], Reply]) -> Scripted:
        made.append(Scripted(script))
        return made[-1]

    yield make
    for server in made:
        server.close()
