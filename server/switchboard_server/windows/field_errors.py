"""What a bad window specification raises: the field it names and why."""

from __future__ import annotations


class FieldError(ValueError):
    """An input is invalid: ``field`` names it, ``message`` explains the problem."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(field, message)
        self.field = field
        self.message = message

    def __str__(self) -> str:
        return f"{self.field}: {self.message}"


class WindowSpecError(FieldError):
    """A window specification is invalid.

    ``field`` names the offending input (``period``, ``zone``, ``start`` or
    ``weekday``); ``message`` explains the problem.
    """


class UnknownZoneError(WindowSpecError):
    """The time zone is not in the bundled IANA database (``field == "zone"``).

    Raised by :meth:`WindowSpec.parse` and also by :func:`window_at` when a
    stored zone is no longer known (e.g. after a ``tzdata`` upgrade).
    """
