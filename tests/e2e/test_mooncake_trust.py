"""``hsx serve`` on a Mooncake store it is the only member of, as the chart runs it
(issue 58): the master's metrics URL set, no memory in the store until hsx's writer
mounts its segment, keys of two namespaces accepted knowingly
(``storage.mooncake.shared_by_namespaces``), and ``/ready`` that tells a full store.

One real ``mooncake_master`` and one real server (the tiny model) serve the module.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.e2e.test_serve import tiny_model
from tests.support.mooncake import MooncakeMaster, master_fixture
from tests.support.processes import Served, hsx_serve, wait_until

pytestmark = [pytest.mark.engine, pytest.mark.slow, pytest.mark.system]
MIB = 1024 * 1024
#: The writer's segment: the store's only memory.
SEGMENT = 16 * MIB
ALICE = {"Authorization": "Bearer alice-key-0123456789"}
BOB = {"Authorization": "Bearer bob-key-0123456789ab"}

master = master_fixture("module")


@pytest.fixture(scope="module")
def served(
    master: MooncakeMaster, model_dir: Any, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Served]:
    """hsx on a fresh store (no member, no memory), with alice's and bob's keys."""
    cwd = tmp_path_factory.mktemp("hsx-mooncake")
    keys = cwd / "keys.txt"
    keys.write_text("alice:alice-key-0123456789\nbob:bob-key-0123456789ab\n")
    assert master.metrics()["master_total_capacity_bytes"] == 0
    env = {
        **master.hsx_env(segment_bytes=SEGMENT, buffer_bytes=8 * MIB, shared_by_namespaces="true"),
        **tiny_model(model_dir),
        "HSX_SERVER__API_KEYS_FILE": str(keys),
    }
    with hsx_serve(cwd, env, ready_timeout_s=300) as server:
        yield server


def test_hsx_as_the_stores_only_member_starts_and_extracts(
    served: Served, master: MooncakeMaster
) -> None:
    # Start-up said once why an empty store was no error; the writer's segment is
    # now the store's whole capacity.
    output = served.output()
    assert output.count("the Mooncake store has no memory yet") == 1
    assert "hsx: error" not in output
    assert master.metrics()["master_total_capacity_bytes"] == SEGMENT
    body = {"prompts": [{"token_ids": [5, 17, 99, 3, 250]}]}
    response = httpx.post(f"{served.url}/extract", json=body, headers=ALICE, timeout=60)
    assert response.status_code == 200, response.text
    obj = response.json()["objects"][0]
    assert obj["key"].startswith("hsx/alice/")
    assert obj["transfer"]["handle"] == obj["key"]  # what a trainer reads it by
    url = f"{served.url}/objects/{obj['key']}"
    got = httpx.get(url, headers=ALICE, timeout=30)
    assert got.status_code == 200
    assert len(got.content) > 0
    # The namespaces hold at the HTTP API (and only there: README, "Storage guarantees").
    assert httpx.get(url, headers=BOB, timeout=30).status_code == 404
    assert httpx.delete(url, headers=BOB, timeout=30).status_code == 404
    assert httpx.delete(url, headers=ALICE, timeout=30).status_code == 204
    assert httpx.get(url, headers=ALICE, timeout=30).status_code == 404


def ready_is(url: str, status: int) -> httpx.Response | None:
    response = httpx.get(f"{url}/ready", timeout=10)
    return response if response.status_code == status else None


def test_ready_is_503_while_the_store_is_full(served: Served, master: MooncakeMaster) -> None:
    """Another member fills the store (hard-pinned, as hsx's objects are): ``/ready``
    turns 503 saying why, and 200 again once the objects are deleted."""
    from mooncake.store import MooncakeDistributedStore, ReplicateConfig

    filler = MooncakeDistributedStore()
    assert filler.setup("127.0.0.1", "P2PHANDSHAKE", 0, 2 * MIB, "tcp", "", master.address) == 0
    config = ReplicateConfig()
    config.with_hard_pin = True
    keys: list[str] = []
    try:
        for size in (MIB, 64 * 1024, 4096):  # until not even 4 KiB fits
            while filler.put(f"filler-{len(keys)}", bytes(size), config) == 0:
                keys.append(f"filler-{len(keys)}")
        # The probe's answer is kept 5 s, the store's usage 1 s: poll.
        full = wait_until(lambda: ready_is(served.url, 503), 20, "/ready stayed 200")
        assert full.json() == {"status": "unavailable", "detail": "storage: full"}
        assert httpx.get(f"{served.url}/health", timeout=10).status_code == 200  # alive
    finally:
        for key in keys:
            filler.remove(key, True)
        filler.close()
    wait_until(lambda: ready_is(served.url, 200), 30, "/ready stayed 503 after the deletes")
