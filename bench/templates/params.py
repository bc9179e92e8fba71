"""The policy-templates bench's size."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TemplatesParams:
    """The size of a policy-templates run."""

    mode: str
    #: Queues of each endpoint (template and explicit).
    queues: int
    #: Concurrent callers of each claim round and of the change's endpoint.
    callers: int
    #: Seconds each claim round lasts.
    claim_seconds: float
    #: Seconds of each kind's warm-up (not recorded) before the rounds.
    warmup_seconds: float
    #: Rounds of each kind (templates, explicit), interleaved.
    rounds: int
    #: Seconds of each idle window.
    idle_seconds: float
    #: The DAY window limit of every queue; an exhausted queue has used it up.
    window_limit: int
    #: Todos of each live queue: at least what the rounds can claim from it.
    todos_per_queue: int
    #: The share of queues window-exhausted before the rounds.
    exhausted_fraction: float = 0.1
    max_in_flight: int = 4
    #: Seconds of the change's endpoint's claims before the change.
    before_seconds: float = 3.0
    #: Queues of the change's endpoint (no policy).
    other_queues: int = 8
    #: Todos of the change's endpoint: more than its callers claim.
    other_todos: int = 20000
    channels: int = 4
    #: Fetches of each board page (after one not recorded).
    board_fetches: int = 10

    @property
    def exhausted(self) -> int:
        """How many queues of each endpoint are window-exhausted."""
        return round(self.queues * self.exhausted_fraction)

    @classmethod
    def full_run(cls) -> TemplatesParams:
        """3,000 queues an endpoint, 16 callers, a 3 s warm-up and 2 rounds of 10 s a
        kind, 10 s idle windows."""
        return cls(
            mode="full",
            queues=3000,
            callers=16,
            claim_seconds=10,
            warmup_seconds=3,
            rounds=2,
            idle_seconds=10,
            window_limit=20,
            todos_per_queue=20,
        )

    @classmethod
    def quick(cls) -> TemplatesParams:
        """A smoke check: 60 queues, 4 callers, a 0.5 s warm-up and 1 round of 2 s a
        kind, 2 s idle windows."""
        return cls(
            mode="quick",
            queues=60,
            callers=4,
            claim_seconds=2,
            warmup_seconds=0.5,
            rounds=1,
            idle_seconds=2,
            window_limit=40,
            todos_per_queue=40,
            before_seconds=1.0,
            other_queues=2,
            other_todos=3000,
            channels=2,
            board_fetches=3,
        )
