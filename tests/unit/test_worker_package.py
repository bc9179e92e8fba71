"""The public API of ``switchboard_dispatch.worker`` (a package of modules by concern) stays put.

Guards the split of the worker helper into modules: a later move must not drop or add a
public name, nor change where the public classes say they live.
"""

from __future__ import annotations

import inspect
import typing

import switchboard_dispatch.worker

EXPECTED_ALL = ["MAX_BATCH", "Handler", "PermanentFailure", "Todo", "Worker", "WorkerStats"]


def test_all_lists_exactly_the_public_api() -> None:
    assert switchboard_dispatch.worker.__all__ == EXPECTED_ALL
    star: dict[str, object] = {}
    exec("from switchboard_dispatch.worker import *", star)
    assert sorted(k for k in star if k != "__builtins__") == sorted(EXPECTED_ALL)


def test_public_names_import_from_the_package() -> None:
    from switchboard_dispatch.v1 import todo_pb2
    from switchboard_dispatch.worker import (
        MAX_BATCH,
        TRANSIENT_CODES,
        Handler,
        PermanentFailure,
        Todo,
        Worker,
        WorkerStats,
        log,
    )

    assert MAX_BATCH == 500
    assert Todo is todo_pb2.Todo
    assert Handler is not None
    assert issubclass(PermanentFailure, Exception)
    assert "UNAVAILABLE" in {code.name for code in TRANSIENT_CODES}
    # One logger for the package, named as the module was.
    assert log.name == "switchboard_dispatch.worker"
    assert PermanentFailure.__module__ == Worker.__module__ == "switchboard_dispatch.worker"
    assert set(typing.get_type_hints(WorkerStats)) >= {"claimed", "rpc_calls"}
    assert list(inspect.signature(Worker).parameters) == [
        "channel",
        "token",
        "handler",
        "endpoint_id",
        "queues",
        "claimant",
        "lease",
        "heartbeat_every",
        "max_idle_wait",
        "shutdown_grace",
        "rpc_timeout",
        "prefetch",
        "concurrency",
        "settle_batch",
        "settle_linger",
        "trace",
    ]
    for method in ("run", "stop"):
        assert callable(getattr(Worker, method))
    for prop in ("held", "stopping"):
        assert isinstance(getattr(Worker, prop), property)


def test_the_parts_are_named_as_the_package_docs_say() -> None:
    """The parts' names are shared with the TypeScript helper: the docs list them."""
    from switchboard_dispatch.worker import claimer, handlers, held, lease_keeper, settler

    parts = {
        "HeldTodos": held,
        "Handlers": handlers,
        "Settler": settler,
        "LeaseKeeper": lease_keeper,
        "Claimer": claimer,
    }
    doc = switchboard_dispatch.worker.__doc__ or ""
    for name, module in parts.items():
        assert inspect.isclass(getattr(module, name))
        assert f"``{name}`` (``{module.__name__.rsplit('.', 1)[-1]}``)" in doc
