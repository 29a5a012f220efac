"""Running a job in process against the test stack, the way the code location would."""

from __future__ import annotations

from dagster import DagsterInstance, ExecuteInProcessResult, JobDefinition

from ci_cleanup.resources import job_resources


def run_job(
    job: JobDefinition, stack, *, run_config: dict | None = None, dry_run: bool = False,
    database_url: str | None = None, raise_on_error: bool = True, instance: DagsterInstance | None = None,
    tags: dict | None = None,
) -> ExecuteInProcessResult:
    return job.execute_in_process(
        run_config=run_config or {},
        # Decomposed (GitLab as deployed): the ci database too, unless the test points the job elsewhere.
        resources=job_resources(database_url or stack.url(), stack.redis_url, dry_run=dry_run,
                                ci_database_url=None if database_url else stack.ci_url()),
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
