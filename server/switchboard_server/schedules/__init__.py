"""Periodic schedules: their definitions, who may change them, their audit,
and the scheduler pass that turns due slots into todos.

The parts: ``service`` (:class:`Schedules`: create, get, list, update, pause,
resume, delete, audit on behalf of a principal), ``views`` (:class:`Schedule`,
a stored schedule with its recurrence), ``audit_form`` (a schedule as its audit
records it), ``scheduler`` (:func:`fire_due`: exactly one todo per slot).
Slot arithmetic is in ``recurrence.py`` (pure).
"""

from __future__ import annotations

from switchboard_server.schedules.audit_form import schedule_from_json as schedule_from_json
from switchboard_server.schedules.audit_form import schedule_json as schedule_json
from switchboard_server.schedules.scheduler import BATCH as BATCH
from switchboard_server.schedules.scheduler import RETRY_BROKEN as RETRY_BROKEN
from switchboard_server.schedules.scheduler import fire_due as fire_due
from switchboard_server.schedules.service import Schedules as Schedules
from switchboard_server.schedules.views import Schedule as Schedule
from switchboard_server.schedules.views import recurrence_of as recurrence_of
