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

# The batches a table leaves out: each workshop module's EXEMPT says why (tools/ci_cleanup_dev/batches/<batch>.py),
# so a batch's coverage is declared in the one module of the workshop it has. A line that no longer holds (the table
# has the batch) fails too.
EXEMPT = workshop.EXEMPT
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
    assert missing == [], (f"{table} lacks {', '.join(missing)}: add it, or say why not in the batch's workshop "
                           "module's EXEMPT")
    assert stale == [], f"{table} has {', '.join(stale)}: remove its line from the workshop module's EXEMPT"
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
