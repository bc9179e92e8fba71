"""A worker loop for Switchboard fleets: claim, heartbeat, settle, and wait at the server when idle.

:class:`Worker` drives claims against ``DispatchService``::

    async def handle(todo: Todo) -> None:
        ...  # do the work; raise PermanentFailure to dead-letter the todo

    async with channel("localhost:50051") as ch:  # from switchboard_dispatch.connect
        worker = Worker(ch, token, handle, claimant="worker-1")
        await worker.run()  # until worker.stop()

The channel is any ``grpc.aio`` channel; :func:`switchboard_dispatch.connect.channel`
makes one over TLS when the server serves TLS (``channel(target,
cacert="ca.pem")``, plus ``cert=`` and ``key=`` under mutual TLS), and
:func:`switchboard_dispatch.connect.channel_from_env` from ``SWITCHBOARD_SERVER``,
``SWITCHBOARD_CACERT``, ``SWITCHBOARD_CERT`` and ``SWITCHBOARD_KEY``.

By default the worker holds one todo at a time. Each turn of the loop calls
``ClaimNext`` with a ``wait``: with work there the server answers at once;
with nothing claimable it holds the call and claims for the worker as soon as
something becomes claimable (a todo created, retried or come due, a window
reopening, a slot freeing, a policy raised, a queue resumed), woken by the
events that ring doorbells, never by polling. With a todo the worker runs the
handler while the lease is heartbeated every ``heartbeat_every``, then calls
``Complete`` (or ``Fail`` when the handler raised). So an idle worker makes one
``ClaimNext`` per ``max_idle_wait`` (at most 60 s, the server's limit on a
held call; the call's deadline is that plus ``rpc_timeout``), needs no
``WatchReopen`` stream and keeps no clock of its own: window boundaries are the
server's. A deferral is never a failure: it touches no todo and is only
counted in ``stats.deferred_waits`` (a held call whose wait ended with deferred
queues). An empty answer that comes back well before its wait (a server that
stops, or one older than held claims, which ignores ``wait``) is followed by a
growing pause, so the worker never spins.

Batches: with ``concurrency`` above 1 the worker runs up to that many
handlers at once, and with ``prefetch`` above 1 it claims up to that many
todos per ``ClaimNext`` (``max_todos``). It only claims todos it has free
handler slots for, so a claimed todo never waits for a slot, and it claims
again once a good share of its slots is free (half of ``concurrency``, or a
full ``prefetch`` when that is less), not for every slot that frees. Every
held lease is heartbeated, all in one ``HeartbeatTodos`` call per tick when
more than one is held. Outcomes of finished handlers are gathered and sent
with ``SettleTodos``: when ``settle_batch`` of them are waiting, when the
oldest has waited ``settle_linger``, when no handler is running any more, and
at once on stop. A batch is also bounded by its size: a ``SettleTodos`` call
carries at most ``MAX_BATCH`` settlements and 1 MiB of them encoded (the
server takes requests of up to 1 MiB + 64 KiB,
``switchboard_dispatch.connect.MAX_SEND_BYTES``), so a larger batch (long
error texts) goes as several calls at once. A todo counts against
``concurrency`` until it is settled.
A batch that the queue's admission budget cut short is a deferral
(``stats.cut_short``): the next claim is held by the server until the queue
admits more.

Failure handling:

- a handler that raises :class:`PermanentFailure` is failed with
  ``permanent``: the todo is dead-lettered;
- any other exception fails the todo with the error text; the server
  retries it after its backoff (or dead-letters it when it is out of
  attempts);
- a heartbeat refused for a lease (``FAILED_PRECONDITION`` or ``NOT_FOUND``
  from ``Heartbeat``, any refusal of an item of ``HeartbeatTodos``) means the
  lease is stale: the todo was taken over (or reaped) and belongs to someone
  else now; its handler is cancelled and the worker leaves the todo alone
  (``stats.lost``); other todos of the batch carry on;
- a heartbeat refused because an operator cancelled the todo
  (``CancelTodo``: ``FAILED_PRECONDITION`` with ``ErrorInfo`` reason
  ``TODO_CANCELLED``, or an item ``NOT_CLAIMED`` in state cancelled) cancels
  its handler the same way; nothing is sent for the todo
  (``stats.cancelled``), and nothing is raised;
- a settlement refused for a stale lease is not retried (``stats.lost``; a
  todo cancelled meanwhile: ``stats.cancelled``);
- transient RPC errors (``UNAVAILABLE``, ``DEADLINE_EXCEEDED`` and the like)
  are retried with jittered exponential backoff, settlements while their
  leases last (then ``stats.unsettled``: the server's reaper takes the
  todos back); any other error from ``ClaimNext`` (a bad token, a missing
  grant) ends :meth:`Worker.run`;
- a ``SettleTodos`` call is one transaction, but its answer can be lost after
  the server applied it; on the retry its items come back ``NOT_CLAIMED``.
  Such an item whose todo is now in the state the settlement would have left
  it in is counted as settled; any other refusal as stale. Neither raises.

Shutdown: :meth:`Worker.stop` lets the running handlers finish, for at most
``shutdown_grace``, and completes (or fails) their todos; when the grace runs
out the handlers are cancelled and their todos are released (pending again
at once; the attempt still counts, so a todo on its last attempt is
dead-lettered by the release). Outcomes waiting to be sent are sent at once.
A held ``ClaimNext`` is cancelled at once (the server gives back a claim it
made for a call that went away; an answer that arrived first is handled
within the grace like any todo held). :meth:`Worker.run` returns once the
worker has settled everything it held. The channel belongs to the caller and
is left open.

The package depends only on ``grpcio`` and ``protobuf`` and uses plain
asyncio; call :meth:`Worker.stop` from the event loop's thread (from another
thread, use ``loop.call_soon_threadsafe(worker.stop)``).

The worker is composed of parts with one job each, each owning its state
(the names are for the TypeScript worker helper's parts too):

- ``HeldTodos`` (``held``): what the worker holds: each claimed todo from its
  claim until it is settled or lost, and the free handler slots;
- ``Handlers`` (``handlers``): runs the handler of each todo held and turns its
  end into the todo's settlement; stops a handler whose lease is lost;
- ``Settler`` (``settler``): sends settlements, batched in ``SettleTodos`` (or
  one by one with ``Complete``, ``Fail``, ``Release``), retried while leases last;
- ``LeaseKeeper`` (``lease_keeper``): heartbeats every lease held in one call
  (``Heartbeat``, ``HeartbeatTodos``) and reports leases lost;
- ``Claimer`` (``claimer``): ``ClaimNext`` with a ``wait`` into free slots, a
  thin loop over the server's held claim;
- :class:`Worker` (``_core``): builds the parts from the options, runs them,
  stops them (the shutdown grace, then every todo held settled).

Beside them: ``_options`` (the settings, checked), ``_rpc`` (the stub, the
credential, the deadlines, ``stats.rpc_calls``), ``stats`` (:class:`WorkerStats`),
``tracing`` (the handler's span) and ``_common`` (the public types, limits,
retry codes, backoff).
"""

from __future__ import annotations

from switchboard_dispatch.worker._common import MAX_BATCH, Handler, PermanentFailure, Todo
from switchboard_dispatch.worker._common import TRANSIENT_CODES as TRANSIENT_CODES
from switchboard_dispatch.worker._common import log as log
from switchboard_dispatch.worker._core import Worker
from switchboard_dispatch.worker.stats import WorkerStats

__all__ = ["MAX_BATCH", "Handler", "PermanentFailure", "Todo", "Worker", "WorkerStats"]

# Named as before the split, so reprs and tracebacks (the handler failures the worker
# logs) keep saying switchboard_dispatch.worker. Not WorkerStats: typing.get_type_hints resolves a
# dataclass's field annotations in its __module__'s namespace, and its repr has no module.
for _public in (PermanentFailure, Worker):
    _public.__module__ = __name__
del _public
