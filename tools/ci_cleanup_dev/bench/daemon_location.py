"""The benchmark's code location for dagster-daemon: ci_cleanup's definitions plus one schedule that fires
every minute (running from the start), so a scheduled run is measured without waiting for the real crons."""

from dagster import DefaultScheduleStatus, Definitions, ScheduleDefinition

import ci_cleanup
from ci_cleanup.drop_canceling_builds.job import drop_canceling_builds

SCHEDULE = "bench_drop_canceling_builds_every_minute"

every_minute = ScheduleDefinition(
    name=SCHEDULE,
    job=drop_canceling_builds,
    cron_schedule="* * * * *",
    execution_timezone="UTC",
    default_status=DefaultScheduleStatus.RUNNING,
)

defs = Definitions.merge(ci_cleanup.defs, Definitions(schedules=[every_minute]))
