"""The environment each side of the peer bench starts with (``peer_bench.side_environment``)."""

from __future__ import annotations

import pytest

from experiments.peer_lab.peer_bench import side_environment
from experiments.peer_lab.peer_side import SIDES
from service.engine.allocator import STEADY_HEAP_TUNABLES


@pytest.mark.parametrize("side", SIDES)
def test_every_side_gets_the_same_steady_heap(side: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("GLIBC_TUNABLES", raising=False)
    assert side_environment(side)["GLIBC_TUNABLES"] == STEADY_HEAP_TUNABLES


def test_a_heap_setting_of_the_caller_applies_to_every_side(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("GLIBC_TUNABLES", "glibc.malloc.arena_max=1")
    assert {side_environment(s)["GLIBC_TUNABLES"] for s in ("hsx", "peer")} == {
        "glibc.malloc.arena_max=1"
    }


def test_only_hsx_sides_ask_for_huge_pages(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("THP_MEM_ALLOC_ENABLE", raising=False)
    assert side_environment("hsx").get("THP_MEM_ALLOC_ENABLE") == "1"
    assert "THP_MEM_ALLOC_ENABLE" not in side_environment("stock")
