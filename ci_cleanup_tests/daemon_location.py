"""A test-only code location: ci_cleanup's definitions plus one schedule that fires every minute,
so the daemon test does not wait for (or change) the real crons."""

from dagster import DefaultScheduleStatus, Definitions, ScheduleDefinition

import ci_cleanup
from ci_cleanup.drop_canceling_builds.job import drop_canceling_builds

every_minute = ScheduleDefinition(
    name="test_drop_canceling_builds_every_minute",
    job=drop_canceling_builds,
    cron_schedule="* * * * *",
    execution_timezone="UTC",
    default_status=DefaultScheduleStatus.RUNNING,
)

defs = Definitions.merge(ci_cleanup.defs, Definitions(schedules=[every_minute]))
