"""Dagster's own fixed cost per launched run: a job of one op that does nothing, run in process, in a code
location that imports nothing but Dagster. The benchmark launches it as it launches the jobs (``dagster job
execute -f`` this file, on the same instance), so each job's start-up can be set against the part of it that
no job can avoid. It freezes its objects as the jobs' processes do, and exits as they do, without the interpreter's last
garbage collections (``ci_cleanup.batch.freeze_startup_objects``, inlined here to import nothing of
ci_cleanup's): the difference is then what a job adds, not how the process ends."""

import atexit
import gc

from dagster import Definitions, in_process_executor, job, op

NAME = "bare_dagster_job"


@op
def nothing() -> None:
    """Does nothing (but freeze and exit as the jobs do)."""
    gc.freeze()
    atexit.register(gc.freeze)


@job(name=NAME, executor_def=in_process_executor)  # no step process
def bare_dagster_job() -> None:
    nothing()


defs = Definitions(jobs=[bare_dagster_job])
