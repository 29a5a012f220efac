"""Each registered batch's workshop module (``<batch>.py`` here): its demo rows and its benchmark entries.

The per-job tables of the demo and the benchmark are read from these modules, in the registry's order
(``ci_cleanup.batches.BATCHES``): a batch of the registry without a module stops the demo and the benchmark,
naming it. A module leaves out an entry its batch has no use for (``seed = None``, no ``RUNNERS``), and says why
in its ``EXEMPT`` (per-job table -> reason), which ``ci_cleanup_tests/test_registry.py`` checks: a batch is in
every per-job table, or its own module says why not.
"""

from __future__ import annotations

import importlib
from types import ModuleType

from ci_cleanup.batches import BATCHES, Batch

from ..bench.jobs import BenchJob


def workshop(batch: Batch) -> ModuleType:
    name = f"{__name__}.{batch.name}"
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as e:
        if e.name != name:
            raise
        raise LookupError(f"Batch {batch.name} (ci_cleanup.batches.BATCHES) has no workshop module: add tools/"
                          f"ci_cleanup_dev/batches/{batch.name}.py, its demo rows and benchmark entries") from None


MODULES = {batch.name: workshop(batch) for batch in BATCHES}


def per_batch(entry: str) -> dict:
    """Each batch's ``entry`` (its module's attribute of that name), for the batches whose module has one."""
    return {name: getattr(module, entry) for name, module in MODULES.items()
            if getattr(module, entry, None) is not None}


SEEDERS = per_batch("seed")  # seed(conn, redis, schema, rng, now): its rows in the demo dataset
RUNNERS = per_batch("RUNNERS")  # (job, raw, per_row): its service, a raw SQL loop, a per-row loop (bench.jobs)
FLOORS = per_batch("FLOOR")  # floor(url, redis) -> (rows changed, batches) (bench.floor)
SCOPED = per_batch("SCOPED")  # the tables whose candidate rows its launched runs may change (bench.launched)
RUN_CONFIG = per_batch("RUN_CONFIG")  # the run config it is launched with, as JSON
CASES = per_batch("CASES")  # cases(conn, redis, before): the cases its guards decide, beyond its plain candidates
# (table, batch) for each per-job table a batch is left out of, its module's EXEMPT giving why
EXEMPT = {(table, name) for name, reasons in per_batch("EXEMPT").items() for table in reasons}
JOBS = [BenchJob(batch.name, batch.table, *RUNNERS[batch.name]) for batch in BATCHES if batch.name in RUNNERS]
BY_NAME = {job.name: job for job in JOBS}
