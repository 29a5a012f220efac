"""Running a job in process against the test stack, the way the code location would."""

from __future__ import annotations

from dagster import DagsterInstance, ExecuteInProcessResult, JobDefinition

from ci_cleanup.resources import job_resources

from .harness import DeployedStack


def run_job(
    job: JobDefinition, stack, *, run_config: dict | None = None, dry_run: bool = False,
    database_url: str | None = None, ci_database_url: str | None = None, raise_on_error: bool = True,
    instance: DagsterInstance | None = None, tags: dict | None = None,
) -> ExecuteInProcessResult:
    return job.execute_in_process(
        run_config=run_config or {},
        # Decomposed (GitLab as deployed): the ci database too, unless the test points the job elsewhere.
        resources=job_resources(database_url or stack.url(), stack.redis_url, dry_run=dry_run,
                                ci_database_url=ci_database_url or (None if database_url else stack.ci_url())),
        instance=instance or DagsterInstance.ephemeral(),
        raise_on_error=raise_on_error,
        tags=tags,
    )


def failure_messages(result) -> str:
    """Every error the run's events carry (a step failure, a resource that could not start), with causes."""
    messages = []
    for event in result.all_events:
        error = getattr(event.event_specific_data, "error", None)
        while error is not None:
            messages.append(error.message)
            error = error.cause
    return "\n".join(messages)


def step_failure_message(result: ExecuteInProcessResult) -> str:
    """The first failed step's error: its cause's message when it has one (the error Dagster wrapped)."""
    failure = next(e for e in result.all_events if e.event_type_value == "STEP_FAILURE")
    error = failure.step_failure_data.error
    return error.cause.message if error.cause else error.message


def op_metadata(result: ExecuteInProcessResult, op_name: str) -> dict:
    """The metadata an op put on its output, as plain values."""
    for event in result.events_for_node(op_name):
        if event.event_type_value == "STEP_OUTPUT":
            return {k: v.value for k, v in event.step_output_data.metadata.items()}
    raise AssertionError(f"{op_name} produced no output")


def observed_per_batch(result: ExecuteInProcessResult, key: str) -> list[int]:
    """``key`` of every batch, in order, from the run's observations (each carries its batches' ``per_batch``)."""
    return [
        count
        for event in result.all_events if event.event_type_value == "ASSET_OBSERVATION"
        for count in event.event_specific_data.asset_observation.metadata["per_batch"].value[key]
    ]


def in_time_zone(url: str, zone: str) -> str:
    """``url`` whose every session is in ``zone`` (libpq's ``options`` startup parameter)."""
    return url + ("&" if "?" in url else "?") + f"options=-c%20timezone%3D{zone.replace('/', '%2F')}"


def run_in_time_zone(job: JobDefinition, stack, zone: str) -> ExecuteInProcessResult:
    """``job`` with every session of its GitLab database(s) in ``zone``. Deployed: straight to main and ci, as
    PgBouncer refuses the ``options`` startup parameter (and would hand a session's setting to other clients)."""
    if isinstance(stack, DeployedStack):
        main, ci = in_time_zone(stack.direct_url(stack.MAIN), zone), in_time_zone(stack.direct_url(stack.CI), zone)
    else:
        main, ci = in_time_zone(stack.url(), zone), None
    return job.execute_in_process(resources=job_resources(main, stack.redis_url, ci_database_url=ci),
                                  instance=DagsterInstance.ephemeral())
