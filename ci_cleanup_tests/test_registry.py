"""Every per-job table covers every batch of the registry (``BATCHES``), or this names the batch it lacks: a batch
left out of the benchmark, the demo or the crash and concurrency trials is then a decision written below, never
an accident."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from ci_cleanup.batches import BATCHES
from ci_cleanup.cron_handover import HANDOVERS
from ci_cleanup.gitlab.release import KNOWN
from ci_cleanup_dev import batches as workshop
from ci_cleanup_dev.ddl import RELEASES

from .reliability import SCENARIOS

# The batches a table leaves out, each with why. A line here that no longer holds (the table has the batch) fails too.
EXEMPT = {
    # schedule_bulk_delete_job_artifacts' module seeds the ci_deleted_objects rows whose files this batch removes
    ("SEEDERS", "delete_expired_artifact_files"),
    # its rows are the Dagster instance's own runs and events: the demo's runs are its rows
    ("SEEDERS", "prune_dagster_history"),
    # never benchmarked: its work is removing stored files, one storage call a row, not a SQL batch a floor bounds
    ("RUNNERS", "delete_expired_artifact_files"),
    ("FLOORS", "delete_expired_artifact_files"),
    ("SCOPED", "delete_expired_artifact_files"),
    # on Dagster's tables, not GitLab's: measured apart, on cloned runs (python -m ci_cleanup_dev.bench.prune)
    ("RUNNERS", "prune_dagster_history"),
    ("FLOORS", "prune_dagster_history"),
    ("SCOPED", "prune_dagster_history"),
    # on Dagster's tables, not GitLab's: test_prune_dagster_history has its own trials of a held lease and of a run
    # killed mid-deletion
    ("SCENARIOS", "prune_dagster_history"),
    # issue 67 hands over its GitLab cron, ci_schedule_delete_objects_worker (Ci::ScheduleDeleteObjectsCronWorker):
    # this line goes when HANDOVERS names it
    ("HANDOVERS", "delete_expired_artifact_files"),
    # no GitLab cron does its work: it bounds this project's own Dagster history
    ("HANDOVERS", "prune_dagster_history"),
}
TABLES = {
    "SEEDERS": set(workshop.SEEDERS),  # the demo's rows (ci_cleanup_dev/batches/<batch>.py, seed)
    "RUNNERS": set(workshop.RUNNERS),  # the benchmark's service, raw SQL and per-row loops
    "FLOORS": set(workshop.FLOORS),  # the benchmark's true floors
    "SCOPED": set(workshop.SCOPED),  # the tables a launched run may change
    "SCENARIOS": set(SCENARIOS),  # ci_cleanup_tests/reliability.py: crash and concurrency trials
    "HANDOVERS": {handover.job for handover in HANDOVERS},  # cron_handover.py: the GitLab crons each batch retires
}
NAMES = [batch.name for batch in BATCHES]


@pytest.mark.parametrize("table", sorted(TABLES))
def test_every_batch_is_in_each_per_job_table_or_exempt_with_its_reason(table):
    missing = [name for name in NAMES if name not in TABLES[table] and (table, name) not in EXEMPT]
    stale = [name for name in NAMES if name in TABLES[table] and (table, name) in EXEMPT]
    unknown = sorted(TABLES[table] - set(NAMES))
    assert missing == [], f"{table} lacks {', '.join(missing)}: add it, or exempt it in EXEMPT with the reason"
    assert stale == [], f"{table} has {', '.join(stale)}: remove its line from EXEMPT"
    assert unknown == [], f"{table} names {', '.join(unknown)}, which is not in ci_cleanup.batches.BATCHES"
    assert all(batch in NAMES for _, batch in EXEMPT)


def test_every_batch_has_a_workshop_module_and_the_optional_entries_name_only_registered_batches():
    assert list(workshop.MODULES) == NAMES
    assert set(workshop.RUN_CONFIG) <= set(NAMES) and set(workshop.CASES) <= set(NAMES)
    assert [job.name for job in workshop.JOBS] == [name for name in NAMES if name in workshop.RUNNERS]


def test_a_batch_without_a_workshop_module_is_named():
    with pytest.raises(LookupError, match="Batch toy_batch .* add tools/ci_cleanup_dev/batches/toy_batch.py"):
        workshop.workshop(SimpleNamespace(name="toy_batch"))


def test_the_releases_the_cli_offers_are_the_vendored_ones():
    """``--release`` offers the runtime's KNOWN releases; each has its vendored DDL in ci_cleanup_dev.ddl."""
    assert list(KNOWN) == list(RELEASES)
