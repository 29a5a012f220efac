"""A run's error in one line, as the console, ``ci-cleanup run`` and the failure alert print it."""

from __future__ import annotations

from dagster_shared.error import SerializableErrorInfo

FAILURE_CLASS = "dagster._core.definitions.events.Failure: "  # how a dagster.Failure's message begins


def cause_line(error: SerializableErrorInfo) -> str:
    """The innermost cause's first line: what went wrong, not the executor's wrapper around it."""
    while error.cause is not None:
        error = error.cause
    lines = error.message.strip().splitlines() or [error.cls_name or "error"]
    return lines[0].removeprefix(FAILURE_CLASS)
