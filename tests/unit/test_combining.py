"""The combiner: concurrent calls of a key go together, one batch of a key at a time."""

from __future__ import annotations

import asyncio

import pytest
from switchboard_server.combining import AGAIN, Again, Combiner


class Recorder:
    """A batch runner that records its batches and can be held mid-batch."""

    def __init__(self) -> None:
        self.batches: list[tuple[str, list[int]]] = []
        self.gate = asyncio.Event()
        self.gate.set()
        self.entered = asyncio.Event()

    async def run(self, key: str, calls: list[int]) -> list[int | Again]:
        self.batches.append((key, list(calls)))
        self.entered.set()
        await self.gate.wait()
        return [call * 10 for call in calls]


async def test_a_lone_call_runs_at_once_in_a_batch_of_its_own() -> None:
    rec = Recorder()
    combiner: Combiner[str, int, int] = Combiner(rec.run, max_batch=10)
    assert await combiner.submit("k", 1) == 10
    assert rec.batches == [("k", [1])]


async def test_calls_arriving_while_a_batch_runs_go_together_in_the_next() -> None:
    rec = Recorder()
    rec.gate.clear()
    combiner: Combiner[str, int, int] = Combiner(rec.run, max_batch=10)
    first = asyncio.create_task(combiner.submit("k", 1))
    await rec.entered.wait()
    rest = [asyncio.create_task(combiner.submit("k", n)) for n in range(2, 7)]
    await asyncio.sleep(0)
    rec.gate.set()
    assert await first == 10
    assert [await t for t in rest] == [20, 30, 40, 50, 60]
    assert rec.batches == [("k", [1]), ("k", [2, 3, 4, 5, 6])]


async def test_batches_hold_at_most_max_batch_calls_oldest_first() -> None:
    rec = Recorder()
    rec.gate.clear()
    combiner: Combiner[str, int, int] = Combiner(rec.run, max_batch=2)
    tasks = [asyncio.create_task(combiner.submit("k", n)) for n in range(5)]
    await rec.entered.wait()
    rec.gate.set()
    assert [await t for t in tasks] == [0, 10, 20, 30, 40]
    assert [calls for _, calls in rec.batches] == [[0, 1], [2, 3], [4]]


async def test_keys_run_apart_and_at_the_same_time() -> None:
    rec = Recorder()
    rec.gate.clear()
    combiner: Combiner[str, int, int] = Combiner(rec.run, max_batch=10)
    a = asyncio.create_task(combiner.submit("a", 1))
    b = asyncio.create_task(combiner.submit("b", 2))
    for _ in range(3):
        await asyncio.sleep(0)
    assert rec.batches == [("a", [1]), ("b", [2])]  # b did not wait for a's batch
    rec.gate.set()
    assert (await a, await b) == (10, 20)


async def test_a_call_answered_again_goes_first_into_the_next_batch() -> None:
    batches: list[list[int]] = []
    gate, entered = asyncio.Event(), asyncio.Event()

    async def run(key: str, calls: list[int]) -> list[int | Again]:
        batches.append(list(calls))
        entered.set()
        await gate.wait()
        return [calls[0], *([AGAIN] * (len(calls) - 1))]  # serves the first call only

    combiner: Combiner[str, int, int] = Combiner(run, max_batch=10)
    tasks = [asyncio.create_task(combiner.submit("k", n)) for n in range(3)]
    await entered.wait()
    late = asyncio.create_task(combiner.submit("k", 3))
    await asyncio.sleep(0)
    gate.set()
    assert [await t for t in [*tasks, late]] == [0, 1, 2, 3]
    assert batches == [[0, 1, 2], [1, 2, 3], [2, 3], [3]]


async def test_an_error_is_the_answer_of_every_call_of_its_batch_only() -> None:
    gate, entered = asyncio.Event(), asyncio.Event()

    async def run(key: str, calls: list[int]) -> list[int | Again]:
        entered.set()
        await gate.wait()
        if 0 in calls:
            raise ValueError("boom")
        return list(calls)

    combiner: Combiner[str, int, int] = Combiner(run, max_batch=10)
    first = asyncio.create_task(combiner.submit("k", 0))
    await entered.wait()
    later = [asyncio.create_task(combiner.submit("k", n)) for n in (1, 2)]
    await asyncio.sleep(0)
    gate.set()
    with pytest.raises(ValueError, match="boom"):
        await first
    assert [await t for t in later] == [1, 2]  # the next batch ran and served them


async def test_a_caller_cancelled_before_its_batch_is_left_out() -> None:
    rec = Recorder()
    rec.gate.clear()
    combiner: Combiner[str, int, int] = Combiner(rec.run, max_batch=10)
    first = asyncio.create_task(combiner.submit("k", 1))
    await rec.entered.wait()
    gone = asyncio.create_task(combiner.submit("k", 2))
    stays = asyncio.create_task(combiner.submit("k", 3))
    await asyncio.sleep(0)
    gone.cancel()
    rec.gate.set()
    assert (await first, await stays) == (10, 30)
    assert gone.cancelled()
    assert rec.batches == [("k", [1]), ("k", [3])]


async def test_an_answer_whose_caller_went_away_mid_batch_is_handed_to_orphaned() -> None:
    rec = Recorder()
    rec.gate.clear()
    orphans: list[tuple[str, int, int]] = []
    combiner: Combiner[str, int, int] = Combiner(
        rec.run, max_batch=10, orphaned=lambda k, c, r: orphans.append((k, c, r))
    )
    gone = asyncio.create_task(combiner.submit("k", 4))
    await rec.entered.wait()
    gone.cancel()
    await asyncio.sleep(0)
    rec.gate.set()
    assert await combiner.submit("k", 5) == 50  # the lane still works
    assert gone.cancelled()
    assert orphans == [("k", 4, 40)]


async def test_a_runner_answering_the_wrong_number_fails_its_calls_instead_of_hanging() -> None:
    async def run(key: str, calls: list[int]) -> list[int | Again]:
        return []

    combiner: Combiner[str, int, int] = Combiner(run, max_batch=10)
    with pytest.raises(ValueError):
        await asyncio.wait_for(combiner.submit("k", 1), 5)


def test_max_batch_must_be_positive() -> None:
    async def run(key: str, calls: list[int]) -> list[int | Again]:
        return list(calls)

    with pytest.raises(ValueError, match="max_batch"):
        Combiner(run, max_batch=0)
