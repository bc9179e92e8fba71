"""The combiner: concurrent calls of a key go together, one batch of a key at a time."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from switchboard_server import errors
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


class Poisoned:
    """A batch runner that fails a whole batch holding a poisoned call (all or
    nothing); its first run, and the run numbered ``hold``, wait for ``gate``."""

    def __init__(self, *poison: int, error: Exception | None = None, hold: int = 0) -> None:
        self.poison = set(poison)
        self.error = error
        self.hold = hold
        self.batches: list[list[int]] = []
        self.gate = asyncio.Event()
        self.entered = asyncio.Event()
        self.held = asyncio.Event()
        self.release = asyncio.Event()

    async def run(self, key: str, calls: list[int]) -> list[int | Again]:
        self.batches.append(list(calls))
        self.entered.set()
        await self.gate.wait()
        if self.hold and len(self.batches) == self.hold:
            self.held.set()
            await self.release.wait()
        bad = self.poison.intersection(calls)
        if bad:
            raise self.error or ValueError(f"poisoned by {min(bad)}")
        return [call * 10 for call in calls]


async def combined(combiner: Combiner[str, int, int], rec: Poisoned, calls: range) -> list[Any]:
    """Submits ``calls`` behind a first call held mid-batch, so they go in one batch;
    each call's answer or error."""
    first = asyncio.create_task(combiner.submit("k", -1))
    await rec.entered.wait()
    tasks = [asyncio.create_task(combiner.submit("k", n)) for n in calls]
    await asyncio.sleep(0)
    rec.gate.set()
    assert await first == -10
    return list(await asyncio.gather(*tasks, return_exceptions=True))


async def test_a_poisoned_call_gets_its_error_and_the_others_of_its_batch_their_answers() -> None:
    rec = Poisoned(11)
    combiner: Combiner[str, int, int] = Combiner(rec.run, max_batch=100)
    answers = await combined(combiner, rec, range(32))
    assert isinstance(answers[11], ValueError) and str(answers[11]) == "poisoned by 11"
    assert answers[:11] + answers[12:] == [n * 10 for n in range(32) if n != 11]
    # The batch of 32, then two halves per level down to the poisoned call.
    assert len(rec.batches) - 1 == 1 + 2 * 5
    assert rec.batches[1] == list(range(32))
    assert [11] in rec.batches


async def test_the_runs_grow_with_the_poisoned_calls_not_with_the_batch() -> None:
    rec = Poisoned(3, 40, 77)
    combiner: Combiner[str, int, int] = Combiner(rec.run, max_batch=100)
    answers = await combined(combiner, rec, range(100))
    failed = [n for n, a in enumerate(answers) if isinstance(a, ValueError)]
    assert failed == [3, 40, 77]
    assert all(answers[n] == n * 10 for n in range(100) if n not in failed)
    assert len(rec.batches) - 1 <= 1 + 3 * 2 * 7  # k poisoned: O(k log n), not n


async def test_an_unavailable_database_answers_every_call_of_the_batch_in_one_run() -> None:
    down = errors.Unavailable()
    rec = Poisoned(*range(10), error=down)
    combiner: Combiner[str, int, int] = Combiner(rec.run, max_batch=100)
    answers = await combined(combiner, rec, range(10))
    assert all(a is down for a in answers)
    assert rec.batches == [[-1], list(range(10))]  # not run again, not split


class Conflict(errors.Aborted):
    """A lock not taken in time: one row's trouble, not the database's."""


async def test_a_conflict_runs_the_batch_again_one_call_at_a_time() -> None:
    """Each run that meets a conflict waits out a lock timeout: one more run per
    call (each fast but the poisoned one), not one wait per halving."""
    rec = Poisoned(6, error=Conflict())
    combiner: Combiner[str, int, int] = Combiner(rec.run, max_batch=100)
    answers = await combined(combiner, rec, range(8))
    assert isinstance(answers[6], Conflict)
    assert [a for n, a in enumerate(answers) if n != 6] == [0, 10, 20, 30, 40, 50, 70]
    assert rec.batches[1:] == [list(range(8)), *([n] for n in range(8))]
    assert sum(6 in batch for batch in rec.batches) == 2, "the conflict was met twice"


async def test_a_shared_error_in_a_part_answers_the_parts_still_to_run() -> None:
    rec = Poisoned(5)

    async def run(key: str, calls: list[int]) -> list[int | Again]:
        if len(rec.batches) == 2:  # the database goes away after the first split
            rec.batches.append(list(calls))
            raise ValueError("down")
        return await rec.run(key, calls)

    combiner: Combiner[str, int, int] = Combiner(
        run, max_batch=100, shared=lambda exc: str(exc) == "down"
    )
    answers = await combined(combiner, rec, range(8))
    assert [str(a) for a in answers] == ["down"] * 8
    assert rec.batches[1:] == [list(range(8)), [0, 1, 2, 3]]


async def test_a_call_answered_again_in_a_part_keeps_its_place_for_the_next_batch() -> None:
    batches: list[list[int]] = []
    gate, entered = asyncio.Event(), asyncio.Event()

    async def run(key: str, calls: list[int]) -> list[int | Again]:
        batches.append(list(calls))
        entered.set()
        await gate.wait()
        if 2 in calls and len(calls) > 1:
            raise ValueError("poisoned")
        return [calls[0], *([AGAIN] * (len(calls) - 1))]  # serves the first call only

    combiner: Combiner[str, int, int] = Combiner(run, max_batch=10)
    first = asyncio.create_task(combiner.submit("k", 0))
    await entered.wait()
    tasks = [asyncio.create_task(combiner.submit("k", n)) for n in range(1, 5)]
    await asyncio.sleep(0)
    gate.set()
    assert await first == 0
    assert [await t for t in tasks] == [1, 2, 3, 4]
    # [1..4] fails; [1, 2] fails, [1] and [2] served; [3, 4] serves 3; 4 goes again.
    assert batches == [[0], [1, 2, 3, 4], [1, 2], [1], [2], [3, 4], [4]]


async def test_a_caller_gone_while_its_batch_failed_is_not_run_again_nor_orphaned() -> None:
    rec = Poisoned(3, hold=2)  # holds the batch of 0..3 mid-run
    orphans: list[int] = []
    combiner: Combiner[str, int, int] = Combiner(
        rec.run, max_batch=10, orphaned=lambda k, c, r: orphans.append(c)
    )
    first = asyncio.create_task(combiner.submit("k", -1))
    await rec.entered.wait()
    tasks = [asyncio.create_task(combiner.submit("k", n)) for n in range(4)]
    await asyncio.sleep(0)
    rec.gate.set()
    await asyncio.wait_for(rec.held.wait(), 5)
    tasks[1].cancel()
    rec.release.set()
    answers = await asyncio.gather(*tasks, return_exceptions=True)
    assert await first == -10
    assert isinstance(answers[1], asyncio.CancelledError)
    assert answers[0] == 0 and answers[2] == 20 and isinstance(answers[3], ValueError)
    assert rec.batches[1] == [0, 1, 2, 3]
    assert all(1 not in b for b in rec.batches[2:])
    assert orphans == []


async def test_a_cancelled_lane_cancels_the_calls_of_a_batch_being_split() -> None:
    rec = Poisoned(0, hold=3)  # holds the first half of the failed batch
    combiner: Combiner[str, int, int] = Combiner(rec.run, max_batch=10)
    first = asyncio.create_task(combiner.submit("k", -1))
    await rec.entered.wait()
    tasks = [asyncio.create_task(combiner.submit("k", n)) for n in range(4)]
    await asyncio.sleep(0)
    rec.gate.set()
    await asyncio.wait_for(rec.held.wait(), 5)
    assert rec.batches[1:] == [[0, 1, 2, 3], [0, 1]]
    running = combiner._lanes["k"].running
    assert running is not None
    running.cancel()
    answers = await asyncio.gather(*tasks, return_exceptions=True)
    assert all(isinstance(a, asyncio.CancelledError) for a in answers)
    assert await first == -10
    assert "k" not in combiner._lanes
