"""The jobs' console logger: Dagster's own, with an error as its cause's one line instead of a stack trace.

``dagster job execute`` and a run worker's console print each failed step's error, and again the run's, with every
frame of Dagster's executor: 80 lines for ``batch_size: 0``. With this logger (run config ``loggers: {console:
{config: {log_level: INFO}}}``) an event's error is the innermost cause's first line (``ValueError: batch_size must
be at least 1, not 0``); at ``log_level: DEBUG`` the whole of it, stack traces included, as in the UI and the run's
event log, which this logger does not change.
"""

from __future__ import annotations

import logging

from dagster import Field, logger

# Private: where a Dagster log record keeps its event (an error's cause), and Dagster's own console logger, which
# this one wraps: no public API names either.
from dagster._core.log_manager import LOG_RECORD_METADATA_ATTR
from dagster._utils.log import create_console_logger

from .errors import cause_line


class _ShortErrors(logging.Formatter):
    """Formats as ``inner`` does, an event's error cut to :func:`cause_line`; the record itself is left as it is
    (other handlers read it)."""

    def __init__(self, inner: logging.Formatter):
        super().__init__()
        self.inner = inner

    def format(self, record: logging.LogRecord) -> str:
        event = (getattr(record, LOG_RECORD_METADATA_ATTR, None) or {}).get("dagster_event")
        error = getattr(getattr(event, "event_specific_data", None), "error", None)
        if error is None:
            return self.inner.format(record)
        short = logging.makeLogRecord(record.__dict__)
        short.msg = f"{record.getMessage().split(chr(10) * 2)[0]} {cause_line(error)}"
        short.args = ()
        return self.inner.format(short)


@logger(
    Field(
        {
            "log_level": Field(str, is_required=False, default_value="INFO", description="The logger's threshold; "
                               "DEBUG also prints each error whole, with its stack trace"),
            "name": Field(str, is_required=False, default_value="dagster", description="The logger's name"),
        },
    ),
    description="Dagster's colored console logger, each error in one line below DEBUG",
)
def console_logger(init_context) -> logging.Logger:
    config = init_context.logger_config
    console = create_console_logger(name=config["name"], level=config["log_level"].upper())
    if console.level > logging.DEBUG:
        for handler in console.handlers:
            handler.setFormatter(_ShortErrors(handler.formatter))
    return console



# A job's loggers: Dagster uses a job's own logger only where the run config names it (``loggers: {console: …}``, as
# ``ci-cleanup run`` does); else its DEBUG console, stack traces included. A job's config dict as the default of
# ``loggers:`` would do it, but a config mapping pins every resource's defaults, and an in-process run given other
# resources (``ci-cleanup demo`` on its embedded stack) would then fall back to CI_CLEANUP_DATABASE_URL.
LOGGER_DEFS = {"console": console_logger}
