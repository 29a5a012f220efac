"""``StuckExportJobsWorker`` on Dagster, as a job and its hourly schedule.

find (schema check, count) -> fail in chunks -> report (the run's totals, the stuck_export_jobs event).
No lease: GitLab's worker relies on its two checks (Sidekiq status, then the row re-read and a guarded
update), which make a repeated or concurrent run harmless.
"""

import datetime as dt
from dataclasses import dataclass

from dagster import OpExecutionContext, op
from pydantic import Field

from ..batch import RunMode, Start, batch_job, find_process_report, finish, paced, start
from ..gitlab.loop_helpers import Hooks
from ..gitlab.schema import utc_now
from ..resources import GitLabDatabase, GitLabRedis, RunOptions
from ..runs import MAX_IDS_REPORTED, ROWS_CHANGED, ROWS_WITH_ERRORS, BatchObserver, observe, track_exception
from ..settings import BoundedConfig
from . import service
from .uses import USES

ASSET = ("gitlab", "project_export_jobs")
# No lease bounds this hourly job: run monitoring fails a run still going at half the hour, which alerts
# and frees the run queue for the next one.
MAX_RUNTIME_SECONDS = 30 * 60


class StuckExportJobsConfig(BoundedConfig):
    chunk_size: int = Field(
        default=service.CHUNK_SIZE, ge=1, le=10_000,
        description="Export jobs read, and jids asked of Sidekiq's Redis in one EXISTS pipeline, per chunk",
    )
    relation_exports_grace_hours: int = Field(
        default=int(service.EXPORT_JOBS_EXPIRATION.total_seconds() // 3600), ge=0, le=7 * 24,
        description="A parallel export (with relation exports) younger than this is spared "
        "(GitLab's EXPORT_JOBS_EXPIRATION, 6 h)",
    )


@dataclass(frozen=True)
class StuckExportPlan:
    start: Start
    limits: service.Limits
    candidates: int
    preview: service.StuckResult | None = None  # dry run: what a run would find and fail


@op
def find_enqueued_export_jobs(
    context: OpExecutionContext, config: StuckExportJobsConfig, gitlab_db: GitLabDatabase, gitlab_redis: GitLabRedis,
    run_options: RunOptions,
) -> StuckExportPlan:
    """Check the schema and count the queued and started export jobs; a dry run asks Sidekiq's Redis about each
    and finds the ones a run would fail, changing nothing."""
    schema = gitlab_db.schema
    gitlab_tables = gitlab_db.require(USES)
    engine = gitlab_db.engine_for(schema.project_export_jobs)
    with engine.connect() as conn:
        enqueued = service.count_enqueued(conn, schema)
    begun = start(context, run_options)
    grace_cutoff = utc_now() - dt.timedelta(hours=config.relation_exports_grace_hours)
    limits = service.Limits(grace_cutoff, config.chunk_size, enqueued.first_id, enqueued.dense, MAX_IDS_REPORTED)
    preview = None
    if begun.mode is RunMode.DRY_RUN:
        preview = service.find_stuck_jobs(engine, schema, gitlab_redis.sidekiq_status, limits)
    context.add_output_metadata(
        {"candidates": enqueued.count, "grace_cutoff": grace_cutoff.isoformat(), **gitlab_tables,
         **begun.metadata}
    )
    return StuckExportPlan(begun, limits, enqueued.count, preview)


@dataclass(frozen=True)
class FailedExportJobs:
    """What the chunks did, with the plan they followed: the report op's input."""

    plan: StuckExportPlan
    result: service.StuckResult


@op
def fail_stuck_export_jobs_in_chunks(
    context: OpExecutionContext, plan: StuckExportPlan, gitlab_db: GitLabDatabase, gitlab_redis: GitLabRedis
) -> FailedExportJobs:
    """Chunk by chunk: ask Sidekiq's Redis, fail the stuck jobs in one guarded statement (job by job if the
    database refuses it), each chunk observed on the table."""
    # GitLab's worker retries on Redis::ConnectionError; here the run fails, naming the server (as every job's
    # Redis errors do), and the next hour's run picks up.
    context.add_output_metadata(gitlab_redis.store_used("sidekiq_status"))
    if not plan.start.runs:
        return FailedExportJobs(plan, plan.preview or service.StuckResult())
    # Each chunk's numbers and failed jobs, observed on the table at a bounded rate.
    observer = BatchObserver(context, ASSET, ["project_export_job_id", "jid"], log_name="failed_export_jobs",
                             keys=["enqueued", "running", "failed"], brake=plan.start.brake)

    def on_chunk(chunk: service.StuckChunk, outcome: service.FailOutcome | None) -> None:
        if outcome is not None:
            observer.add(
                {"enqueued": chunk.candidates, "running": chunk.running, "failed": len(outcome.failed)},
                ({"project_export_job_id": job.id, "jid": job.jid} for job in outcome.failed),
            )

    def report_error(job_id: int, error: BaseException) -> None:
        track_exception(context, error, project_export_job_id=job_id)

    schema = gitlab_db.schema
    with observer, paced(context, plan.start, gitlab_db, schema.project_export_jobs):
        result = service.mark_stuck_jobs_as_failed(
            gitlab_db.engine_for(schema.project_export_jobs), schema, gitlab_redis.sidekiq_status, plan.limits,
            Hooks(on_chunk, report_error, plan.start.brake),
        )
    return FailedExportJobs(plan, result)


@op
def report_stuck_export_jobs(context: OpExecutionContext, failed: FailedExportJobs) -> None:
    """GitLab's 'Marked stuck export jobs as failed' log line and its stuck_export_jobs event."""
    plan, result = failed.plan, failed.result
    if not plan.start.runs:
        finish(
            context, plan.start,
            {ROWS_CHANGED: 0, "candidates": result.candidates, "running_count": result.running,
             "reenqueued_count": result.reenqueued, "parallel_in_grace_count": result.parallel_in_grace},
            would={"would_fail_count": result.stuck, "would_fail_job_ids": result.stuck_jids,
                   "would_fail_export_job_ids": result.stuck_ids},
        )
        return
    if result.stuck:
        context.log.info(f"Marked stuck export jobs as failed: job_ids={result.stuck_jids}")
    finish(
        context, plan.start,
        {
            ROWS_CHANGED: result.stuck,
            "failed_jobs_count": result.stuck,
            "job_ids": result.stuck_jids,
            "failed_export_job_ids": result.stuck_ids,
            "candidates": result.candidates,
            "running_count": result.running,
            "changed_meanwhile_count": result.changed_meanwhile,
            "reenqueued_count": result.reenqueued,
            "parallel_in_grace_count": result.parallel_in_grace,
            "chunks": result.chunks,
            "errors_count": result.errors_count,
            ROWS_WITH_ERRORS: result.errors_count,
            "errors": [f"export job {job_id}: {error}" for job_id, error in result.errors],
        }
    )
    # Gitlab::Metrics.add_event(:stuck_export_jobs, failed_jobs_count:): one point per run, charted across runs.
    observe(context, ASSET, {"stuck_export_jobs": result.stuck, "failed_jobs_count": result.stuck,
                             "errors_count": result.errors_count})


stuck_export_jobs, stuck_export_jobs_schedule = batch_job(
    "stuck_export_jobs",
    find_process_report(find_enqueued_export_jobs, fail_stuck_export_jobs_in_chunks, report_stuck_export_jobs),
    description="Fail project exports whose Sidekiq job is gone (StuckExportJobsWorker)",
    seed="002", max_runtime_seconds=MAX_RUNTIME_SECONDS, cron="30 * * * *",  # GitLab's cron: every hour at :30
)
