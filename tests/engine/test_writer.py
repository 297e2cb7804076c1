"""The writer pool on its own (no engine): real local storage, a real completion channel."""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import math
import os
import re
import threading
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from service.config import StorageSettings
from service.engine import writer
from service.engine.completion import CompletionReceiver, CompletionSender
from service.engine.jobs import CopyOut, PendingSave, WriteJob
from service.engine.objects import object_metadata
from service.engine.statistics import layer_statistics
from service.engine.wire import Completion, WriteFailure
from service.engine.writer import InFlightBudget, WriterPool
from service.glibc import glibc as _glibc
from service.masks import Span
from service.storage.keys import new_object_key

FAULTY = "tests.engine.faulty:open_faulty_storage"


class Rig:
    """A writer pool writing under ``root``, its completions received here."""

    def __init__(self, root: Path, receiver: CompletionReceiver, **options: Any) -> None:
        self.root, self.receiver = root, receiver
        self.pool = WriterPool(
            StorageSettings(url=str(root)),
            CompletionSender(receiver.address, receiver.secret),
            max_bytes_in_flight=options.pop("max_bytes_in_flight", 10**9),
            max_concurrent_writes=2,
            **options,
        )

    def job(
        self,
        states: torch.Tensor,
        namespace: str = "team",
        loss_spans: tuple[Span, ...] | None = None,
    ) -> WriteJob:
        key = new_object_key("hsx", namespace)
        token_ids = tuple(range(states.shape[0]))
        layer_ids = tuple(range(states.shape[1]))
        metadata = object_metadata("m", layer_ids, "float32")
        save = PendingSave("r", key, token_ids, (), metadata, layer_ids, loss_spans=loss_spans)
        return WriteJob(save, CopyOut({"hidden_states": states}), states.numel() * 4)

    async def write(self, job: WriteJob) -> Completion:
        waiter = self.receiver.expect(job.key)
        assert self.pool.budget.reserve(job.nbytes)
        self.pool.submit(job)
        return await asyncio.wait_for(waiter, 30)


@pytest.fixture
async def receiver(tmp_path: Path) -> AsyncIterator[CompletionReceiver]:
    receiver = CompletionReceiver(f"ipc://{tmp_path / 'c.sock'}")
    receiver.start()
    yield receiver
    await receiver.close()


@pytest.fixture
async def rig(tmp_path: Path, receiver: CompletionReceiver) -> AsyncIterator[Rig]:
    rig = Rig(tmp_path / "objects", receiver, storage_factory=FAULTY)
    yield rig
    await asyncio.to_thread(rig.pool.close)


def states(tokens: int = 5, layers: int = 3, hidden: int = 8) -> torch.Tensor:
    return torch.randn(tokens, layers, hidden)


async def test_a_written_object_is_reported_with_its_storage_calls(rig: Rig) -> None:
    job = rig.job(states())
    completion = await rig.write(job)
    assert completion.stored is not None
    data = (rig.root / job.key).read_bytes()
    assert completion.stored.size == len(data)
    assert completion.stored.sha256 == hashlib.sha256(data).hexdigest()
    assert completion.stored.shape == (5, 3, 8)
    assert completion.bytes_in_flight == 0  # released before it was sent
    assert completion.peak_bytes_in_flight == job.nbytes
    puts = [op for op in completion.storage_ops if op.operation == "put"]
    assert [(op.written, op.error) for op in puts] == [(len(data), None)]


async def test_the_idle_trim_waits_until_the_writer_has_stayed_idle(
    rig: Rig, monkeypatch: pytest.MonkeyPatch
) -> None:
    """At one prompt in flight the writer goes idle after every object: the trim that
    gives the heap back must not run then (it would cost every answer), only once no
    write came for ``IDLE_TRIM_S``."""
    if _glibc() is None:
        pytest.skip("malloc_trim is glibc's")
    monkeypatch.setattr(writer, "IDLE_TRIM_S", 0.6)
    trimmer = rig.pool._trimmer
    for _ in range(3):  # each write restarts the wait
        await rig.write(rig.job(states()))
        assert trimmer.count == 0
    deadline = asyncio.get_running_loop().time() + 10
    while trimmer.count == 0 and asyncio.get_running_loop().time() < deadline:
        await asyncio.sleep(0.05)
    assert trimmer.count == 1  # one trim for the idle period, not one per object
    await asyncio.sleep(1.0)
    assert trimmer.count == 1


async def test_a_loss_mask_is_stored_and_its_tokens_counted(rig: Rig) -> None:
    job = rig.job(states(tokens=6), loss_spans=((1, 3), (4, 6)))
    completion = await rig.write(job)
    assert completion.stored is not None
    assert completion.stored.num_loss_tokens == 4
    stored = load_file(rig.root / job.key)
    assert stored["loss_mask"].dtype == torch.uint8
    assert stored["loss_mask"].tolist() == [0, 1, 1, 0, 1, 1]
    assert stored["token_ids"].tolist() == list(range(6))  # aligned, not shifted
    plain = await rig.write(rig.job(states()))
    assert plain.stored is not None
    assert plain.stored.num_loss_tokens is None


@pytest.mark.parametrize("namespace", ["team", "fail-here"])
async def test_the_host_copy_is_released_once_after_the_put_that_reads_it(
    rig: Rig, namespace: str
) -> None:
    # Storage writes a raw object straight from the host copy's memory (a pinned buffer
    # on CUDA): giving the buffer back before the put would let the next copy-out
    # overwrite bytes still being written.
    job = rig.job(states(), namespace=namespace)
    released: list[bool] = []
    copy = dataclasses.replace(
        job.copy, release=lambda: released.append((rig.root / job.key).exists())
    )
    job = dataclasses.replace(job, copy=copy)
    completion = await rig.write(job)
    stored = completion.stored is not None
    assert released == [stored]  # once; after the object was durable, when it was
    assert stored != namespace.startswith("fail")


def test_the_ceiling_holds_but_lets_one_large_object_through(tmp_path: Path) -> None:
    async def run() -> None:
        receiver = CompletionReceiver(f"ipc://{tmp_path / 'c.sock'}")
        receiver.start()
        rig = Rig(tmp_path / "objects", receiver, max_bytes_in_flight=1000)
        pool = rig.pool
        assert pool.budget.reserve(5000)  # alone and over the ceiling: let through
        assert not pool.budget.reserve(1)
        await asyncio.to_thread(pool.report_failure, "hsx/t/k", _failure(), 5000)
        assert pool.budget.in_flight == 0
        assert pool.budget.reserve(600)
        assert not pool.budget.reserve(600)
        assert pool.budget.reserve(400)
        assert pool.budget.in_flight == 1000
        await asyncio.to_thread(pool.report_failure, "hsx/t/k", _failure(), 1000)
        await asyncio.to_thread(pool.close)
        await receiver.close()

    asyncio.run(run())


def test_the_budget_lets_one_large_reservation_through_and_tracks_its_peak() -> None:
    budget = InFlightBudget(1000)
    assert budget.reserve(5000)  # alone and over the ceiling: let through
    assert not budget.reserve(1)
    assert budget.release(5000) == (0, 5000)
    assert budget.reserve(600)
    assert not budget.reserve(600)
    assert budget.reserve(400)
    assert (budget.in_flight, budget.peak) == (1000, 5000)
    assert budget.release(1000) == (0, 5000)


def test_the_budget_counts_a_shrunk_reservation_at_its_new_size() -> None:
    budget = InFlightBudget(1000)
    assert budget.reserve(800)
    assert budget.shrink(800, 200) == 200  # encoded: the host copy went
    assert budget.in_flight == 200
    assert budget.reserve(800)  # room again
    assert budget.shrink(200, 300) == 200  # never grows
    assert budget.release(200) == (800, 1000)
    assert budget.release(800) == (0, 1000)


def test_the_budget_is_exact_under_threads() -> None:
    budget = InFlightBudget(10**9)

    def churn() -> None:
        for _ in range(2000):
            assert budget.reserve(7)
            budget.release(budget.shrink(7, 3))

    threads = [threading.Thread(target=churn) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert budget.in_flight == 0
    assert 7 <= budget.peak <= 28


def _failure() -> WriteFailure:
    return WriteFailure(type="internal_error", message="copy-out failed")


#: [tokens, layers, hidden] of states under and over ``writer.STATISTICS_ASIDE_BYTES``.
SMALL, LARGE = (5, 3, 8), (160, 4, 512)


@pytest.mark.parametrize("shape", [SMALL, LARGE], ids=["before-the-put", "beside-the-put"])
async def test_the_statistics_describe_the_stored_states_wherever_they_run(
    rig: Rig, shape: tuple[int, int, int]
) -> None:
    assert (math.prod(shape) * 4 >= writer.STATISTICS_ASIDE_BYTES) == (shape == LARGE)
    values = states(*shape)
    completion = await rig.write(rig.job(values.clone()))
    assert completion.stored is not None
    assert completion.stored.statistics == layer_statistics(values)
    assert torch.equal(load_file(rig.root / completion.key)["hidden_states"], values)
    assert completion.bytes_in_flight == 0


@pytest.mark.parametrize(
    ("shape", "codec", "where"),
    [(LARGE, "raw", "hsx-writer"), (SMALL, "raw", "hsx-encode"), (LARGE, "bf16", "hsx-encode")],
    ids=["raw-large-in-place", "small-on-an-encoder", "transforming-codec-on-an-encoder"],
)
async def test_large_raw_states_are_validated_without_a_thread_hop(
    rig: Rig, monkeypatch: pytest.MonkeyPatch, shape: tuple[int, int, int], codec: str, where: str
) -> None:
    from service.engine import validation

    threads: list[str] = []
    check = validation.check_states

    def recording(states: torch.Tensor, layer_ids: Any = None) -> None:
        threads.append(threading.current_thread().name)
        check(states, layer_ids)

    monkeypatch.setattr(validation, "check_states", recording)
    job = rig.job(states(*shape))
    job = dataclasses.replace(job, save=dataclasses.replace(job.save, codec=codec))
    completion = await rig.write(job)
    assert completion.stored is not None
    assert len(threads) == 1
    assert threads[0].startswith(where), threads
    assert load_file(rig.root / job.key)["token_ids"].shape == (shape[0],)


async def test_large_invalid_states_validated_in_place_are_refused(rig: Rig) -> None:
    bad = states(*LARGE)
    bad[100, 2, 7] = float("nan")
    job = rig.job(bad)
    completion = await rig.write(job)
    assert completion.failure is not None
    assert (completion.failure.type, completion.failure.reason) == (
        "invalid_hidden_states",
        "non_finite",
    )
    assert not (rig.root / job.key).exists()
    assert [op for op in completion.storage_ops if op.operation == "put"] == []
    assert completion.bytes_in_flight == 0


async def test_a_failed_put_waits_for_the_statistics_beside_it(rig: Rig) -> None:
    # The states are the host copy's memory: released after the put, so the statistics
    # thread must be done with them by then, also when the put fails.
    job = rig.job(states(*LARGE), namespace="fail-here")
    reading: list[bool] = []
    original = writer._Encoded.with_statistics

    def slow(encoded: writer._Encoded) -> writer._Encoded:
        reading.append(True)
        time.sleep(0.3)  # longer than the failing put
        done = original(encoded)
        reading.append(False)
        return done

    copy = dataclasses.replace(job.copy, release=lambda: reading.append(reading[-1]))
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(writer._Encoded, "with_statistics", slow)
        completion = await rig.write(dataclasses.replace(job, copy=copy))
    assert completion.failure is not None
    assert completion.failure.type == "storage_error"
    assert reading == [True, False, False]  # released once, after the statistics ended
    assert completion.bytes_in_flight == 0


async def test_an_object_whose_statistics_fail_is_removed(
    rig: Rig, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(_states: torch.Tensor) -> None:
        raise RuntimeError("injected statistics failure")

    monkeypatch.setattr(writer, "layer_statistics", broken)
    job = rig.job(states(*LARGE))
    completion = await rig.write(job)
    assert completion.failure is not None
    assert completion.failure.type == "internal_error"
    assert "injected statistics failure" in completion.failure.message
    # Written beside the statistics, then removed: no key stays that nobody reports.
    assert [op.operation for op in completion.storage_ops] == ["put", "delete"]
    assert not (rig.root / job.key).exists()
    assert [p.name for p in rig.root.rglob("*") if p.is_file()] == []
    assert completion.bytes_in_flight == 0


async def test_failures_are_reported_and_release_their_bytes(rig: Rig) -> None:
    job = rig.job(states(), namespace="fail-here")
    completion = await rig.write(job)
    assert completion.failure is not None
    assert completion.failure.type == "storage_error"
    assert "injected write failure" in completion.failure.message
    assert completion.bytes_in_flight == 0
    assert [op.error for op in completion.storage_ops if op.operation == "put"] == ["error"]
    assert not (rig.root / job.key).exists()
    waiter = rig.receiver.expect("hsx/t/x")
    await asyncio.to_thread(rig.pool.report_failure, "hsx/t/x", _failure())
    assert (await asyncio.wait_for(waiter, 10)).failure == _failure()


@pytest.mark.parametrize(
    ("reason", "layer"),
    [("non_finite", float("nan")), ("non_finite", float("-inf")), ("all_zero_layer", 0.0)],
)
async def test_invalid_states_are_refused_and_nothing_is_stored(
    rig: Rig, reason: str, layer: float
) -> None:
    bad = states()
    if layer == 0.0:
        bad[:, 1] = 0.0
    else:
        bad[3, 1, 2] = layer
    job = rig.job(bad)
    completion = await rig.write(job)
    assert completion.failure is not None
    assert (completion.failure.type, completion.failure.reason) == ("invalid_hidden_states", reason)
    assert "layer ids [1]" in completion.failure.message
    assert not (rig.root / job.key).exists()
    assert [op for op in completion.storage_ops if op.operation == "put"] == []


async def test_close_drains_queued_writes(
    tmp_path: Path, receiver: CompletionReceiver, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HSX_TEST_WRITE_DELAY_S", "0.2")  # read when the storage opens
    rig = Rig(tmp_path / "objects", receiver, storage_factory=FAULTY)
    arrived: list[Completion] = []
    receiver.on_message = arrived.append
    jobs = [rig.job(states()) for _ in range(4)]
    waiters = [receiver.expect(job.key) for job in jobs]
    for job in jobs:
        assert rig.pool.budget.reserve(job.nbytes)
        rig.pool.submit(job)
    await asyncio.to_thread(rig.pool.close)  # returns once every write is done
    assert all((rig.root / job.key).is_file() for job in jobs)
    completions = await asyncio.wait_for(asyncio.gather(*waiters), 10)
    assert all(c.stored is not None for c in completions)
    assert completions[-1].bytes_in_flight == 0 or any(c.bytes_in_flight == 0 for c in completions)


def os_thread_name(thread: threading.Thread, wait_s: float = 2.0) -> str:
    """The kernel's name of ``thread``: a pool thread names itself in its start-up hook,
    just after it starts, so a thread started a moment ago gets a little time."""
    comm = Path(f"/proc/self/task/{thread.native_id}/comm")
    deadline = time.monotonic() + wait_s
    while (name := comm.read_text().strip()) != thread.name and time.monotonic() < deadline:
        time.sleep(0.01)
    return name


@pytest.mark.skipif(
    not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2,
    reason="needs two CPUs and Linux affinity",
)
def test_writer_threads_run_off_the_cpu_of_the_thread_that_started_them(tmp_path: Path) -> None:
    # vLLM's CPU worker binds the forward pass's thread to one CPU before our connector
    # starts the pool from it; the writer's threads must not all share that CPU. Each
    # carries its name to the OS too (what /proc, top -H and perf show).
    forward = min(os.sched_getaffinity(0))
    seen: dict[str, set[int]] = {}
    os_names: dict[str, str] = {}
    # Only this pool's threads: a full run has other tests' storage threads alive,
    # started from unbound threads, and bound to every CPU.
    before = set(threading.enumerate())  # Thread objects: idents are reused

    def forward_thread() -> None:
        os.sched_setaffinity(0, {forward})

        async def run() -> None:
            receiver = CompletionReceiver(f"ipc://{tmp_path / 'c.sock'}")
            receiver.start()
            rig = Rig(tmp_path / "objects", receiver)
            # Past storage.local.PARALLEL_HASH_BYTES: hashed on a thread of its own.
            done = await rig.write(rig.job(torch.randn(600, 2, 512)))
            assert done.stored is not None
            for thread in threading.enumerate():
                if thread in before or thread.native_id is None:
                    continue
                if thread.name.startswith("hsx-"):
                    seen[thread.name] = os.sched_getaffinity(thread.native_id)
                    os_names[thread.name] = os_thread_name(thread)
            await asyncio.to_thread(rig.pool.close)
            await receiver.close()

        asyncio.run(run())

    worker = threading.Thread(target=forward_thread)
    worker.start()
    worker.join(60)
    names = {re.sub(r"_\d+$", "", name) for name in seen}
    assert {"hsx-writer", "hsx-encode", "hsx-local", "hsx-hash"} <= names
    assert all(cpus and forward not in cpus for cpus in seen.values()), seen
    assert os_names == {name: name for name in seen}
