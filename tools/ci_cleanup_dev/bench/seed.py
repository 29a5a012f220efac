"""Fill the GitLab schema fast, server-side (``INSERT … SELECT … FROM generate_series``).

GitLab's own schema (:func:`~ci_cleanup_dev.ddl.create_schema`): builds and artifacts go through
``p_ci_builds`` / ``p_ci_job_artifacts`` into the partitions the schema has (100, 101 and 102 on 0016ea05), ids
from GitLab's triggers.

At ``scale=1.0``: 10 M ``ci_builds`` (1 % stuck canceling), 1 M runner machines (10 % stale),
1 M export jobs (1 % stuck), 1 M environments (5 % past auto_stop_at; 2 M deployments) and 10 M job artifacts
(10 % expired and deletable). Everything else is the mix the jobs must leave alone: finished
builds, live runners, finished exports, stopped or not-yet-due environments, locked, unexpired
or trace artifacts. Values are derived from the series number, so a seed is deterministic.

Each ``insert_*`` takes ``every``: row ``g`` is a candidate when ``g % every = 0`` (1: all
candidates; :data:`NONE`: none), which is how the benchmark adds work to a big table.

A big insert into a smaller table (a seed, the benchmark growing its tables) builds the table's indexes after
its rows instead of keeping them up row by row (:func:`indexes_built_after`): each partition of ``p_ci_builds``
carries 24 of GitLab's indexes beside its primary key, and every row inserted updated all 25.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import re
import time
from collections.abc import Iterator

from sqlalchemy import text
from sqlalchemy.engine import Connection, Engine
from sqlalchemy.exc import ProgrammingError

from ci_cleanup.gitlab.release import RELEASE_TABLES, Release, read_catalog
from ci_cleanup.gitlab.schema import detect_tables, naive_utc, utc_now
from ci_cleanup_dev.ddl import create_schema, ddl
from ci_cleanup_dev.project_rows import add_projects

# The tables the jobs read builds and artifacts through (every partition); the seed's keys name the logical tables.
PARENT = {"ci_builds": "p_ci_builds", "ci_job_artifacts": "p_ci_job_artifacts"}
NONE = 2**62  # an `every` no series number reaches: no candidates
CHUNK = 1_000_000  # rows per INSERT statement
REBUILD_FROM = 1_000_000  # rows inserted at once, into a table holding fewer, from which its indexes are built after
ALSO_FILLS = {"environments": ("deployments",)}  # filled beside the table: two deployments per environment
# Building GitLab's indexes after the rows: memory to sort a 10 M-row index at once, a worker beside the leader.
INDEX_BUILD = {"maintenance_work_mem": "1GB", "max_parallel_maintenance_workers": "2"}

# (table, rows at scale 1.0, a candidate every n rows)
MIX = {
    "ci_builds": (10_000_000, 100),
    "ci_runner_machines": (1_000_000, 10),
    "project_export_jobs": (1_000_000, 100),
    "environments": (1_000_000, 20),
    "ci_job_artifacts": (10_000_000, 10),
}


def insert_builds(conn: Connection, n: int, every: int, now: dt.datetime) -> None:
    """Finished builds, and builds stuck ``canceling`` for 2 h to a year (with their ci_running_builds row)."""
    before = conn.scalar(text("SELECT coalesce(max(id), 0) FROM p_ci_builds"))
    conn.execute(text("""
        INSERT INTO p_ci_builds (partition_id, project_id, commit_id, name, type, status, runner_id, user_id,
                               lock_version, created_at, updated_at, started_at, finished_at, "when", allow_failure)
        SELECT 100 + (:before + g) % :partitions, 1 + g % 50000, (:before + g) / 8,
               (ARRAY['rspec','rubocop','build','deploy','test'])[1 + g % 5], 'Ci::Build',
               CASE WHEN g % :every = 0 THEN 'canceling'
                    ELSE (ARRAY['success','success','success','success','success','success','failed','canceled',
                                'skipped','manual'])[1 + (g / 7) % 10] END,
               1 + g % 2000, 1 + g % 100000, 0, t, t, t, CASE WHEN g % :every = 0 THEN NULL ELSE t END,
               'on_success', false
        FROM generate_series(1, :n) g,
        LATERAL (SELECT CAST(:now AS timestamp) - make_interval(secs => 7200 + (g::bigint * 7919) % 31536000) AS t) x
    """), {"n": n, "every": every, "now": naive_utc(now), "before": before,
           "partitions": partitions(conn, "p_ci_builds")})
    conn.execute(text("""
        INSERT INTO ci_running_builds (build_id, project_id, runner_id, runner_type, partition_id)
        SELECT id, project_id, runner_id, 1, partition_id FROM p_ci_builds
        WHERE status = 'canceling' AND type = 'Ci::Build' AND id > :before
    """), {"before": before})


def insert_runner_machines(conn: Connection, n: int, every: int, now: dt.datetime) -> None:
    """Live machines (contacted within the hour, or registered this week), and ones silent for 8 days to a year.

    In the order they were registered, as GitLab appends them: ids and table pages follow ``created_at``, so the
    machines registered this week sit at the table's end, not one in every 20 rows of every page. A group or
    project machine's owner is ``sharding_key_id``, or ``organization_id`` where GitLab dropped that column.
    """
    owner = "sharding_key_id" if detected_release(conn).features["runner_machines_sharding_key_id"] else \
        "organization_id"
    conn.execute(text(f"""
        INSERT INTO ci_runner_machines (runner_id, system_xid, runner_type, {owner}, created_at, updated_at,
                                        contacted_at)
        SELECT 1 + g % 200000, md5(gen_random_uuid()::text), 1 + g % 3,
               CASE WHEN g % 3 <> 0 THEN 1 + g % 50000 END,
               created, coalesce(contacted, created), contacted
        FROM generate_series(1, :n) g,
        LATERAL (SELECT CASE WHEN g % :every = 0 THEN :now - make_interval(days => 8 + g % 400)
                             WHEN g % 20 = 0 THEN :now - make_interval(secs => g % 500000)
                             ELSE :now - make_interval(days => g % 700) END AS created,
                        CASE WHEN g % :every = 0
                             THEN (CASE WHEN g % 4 = 0 THEN NULL ELSE :now - make_interval(days => 8) END)
                             WHEN g % 20 = 0 THEN NULL
                             ELSE :now - make_interval(secs => g % 3600) END AS contacted) x
        ORDER BY created
    """), {"n": n, "every": every, "now": now})


def insert_export_jobs(conn: Connection, n: int, every: int, now: dt.datetime) -> None:
    """Finished and failed exports, and queued or started ones whose Sidekiq job is gone (no status key)."""
    conn.execute(text("""
        INSERT INTO project_export_jobs (project_id, status, jid, user_id, created_at, updated_at)
        SELECT 1 + g % 50000, CASE WHEN g % :every = 0 THEN g % 2 WHEN g % 10 < 8 THEN 2 ELSE 3 END,
               md5(gen_random_uuid()::text), 1 + g % 100000, t, t
        FROM generate_series(1, :n) g, LATERAL (SELECT :now - make_interval(secs => 3600 + g % 31536000) AS t) x
    """), {"n": n, "every": every, "now": now})


def insert_environments(conn: Connection, n: int, every: int, now: dt.datetime) -> None:
    """Stopped environments, available ones without or before auto_stop_at, and review apps past it.

    Each has two deployments, the last successful one naming an ``on_stop`` action its pipeline does
    not have, so finding an environment's stop actions reads what it would on GitLab.com. Their builds
    are among the newest 2 % of ci_builds: an environment due to auto-stop was deployed days ago.
    """
    before = conn.scalar(text("SELECT coalesce(max(id), 0) FROM environments"))
    conn.execute(text("""
        INSERT INTO environments (project_id, name, slug, state, auto_stop_at, auto_stop_setting, created_at,
                                  updated_at)
        SELECT 1 + g % 50000, 'review/' || (:before + g), 'review-' || (:before + g),
               CASE WHEN g % :every = 0 OR g % 10 >= 8 THEN 'available' ELSE 'stopped' END,
               CASE WHEN g % :every = 0 THEN CAST(:now AS timestamptz) - make_interval(mins => 1 + g % 10000)
                    WHEN g % 10 = 9 THEN CAST(:now AS timestamptz) + make_interval(mins => 1 + g % 10000) END,
               0, CAST(:naive AS timestamp) - make_interval(days => g % 700), CAST(:naive AS timestamp)
        FROM generate_series(1, :n) g
    """), {"n": n, "every": every, "now": now, "naive": naive_utc(now), "before": before})
    conn.execute(text("""
        INSERT INTO deployments (iid, project_id, environment_id, ref, tag, sha, status, deployable_type, deployable_id,
                                 on_stop, created_at, updated_at)
        SELECT 2 * id + d, project_id, id, 'review/' || id, false, md5(id::text), CASE d WHEN 1 THEN 2 ELSE 3 END,
               'CommitStatus', greatest(1, newest - (id * 7919 + d) % greatest(1, newest / 50)), 'stop_review',
               created_at, created_at
        FROM environments, generate_series(1, 2) d, (SELECT coalesce(max(id), 1) AS newest FROM p_ci_builds) b
        WHERE id > :before
    """), {"before": before})
    # Their projects, as a stop action is queued from its project's settings.
    add_projects(conn, conn.scalars(text("SELECT DISTINCT project_id FROM environments WHERE id > :before"),
                                    {"before": before}))


def insert_artifacts(conn: Connection, n: int, every: int, now: dt.datetime) -> None:
    """Locked, unexpired, never-expiring and trace artifacts, and unlocked ones expired 1 to 30 days ago.

    A job's artifacts (``(:before + g) / partitions``) sit one in each partition, so GitLab's unique index
    (job_id, file_type, partition_id) holds however often the benchmark adds rows.
    """
    before = conn.scalar(text("SELECT last_value FROM ci_job_artifacts_id_seq"))
    conn.execute(text("""
        INSERT INTO p_ci_job_artifacts (partition_id, project_id, job_id, file_type, size, file, file_store,
                                        file_final_path, expire_at, locked, created_at, updated_at)
        SELECT 100 + (:before + g) % :partitions, 1 + (g / 7) % 50000, (:before + g) / :partitions,
               CASE WHEN g % :every <> 0 AND g % 10 = 9 THEN 3 ELSE 1 + g % 2 END,
               1000 + g % 100000, 'artifacts.zip', 2,
               CASE WHEN g % 2 = 0 THEN '@final/' || substr(md5(g::text), 1, 2) || '/' || md5(g::text) END,
               CASE WHEN g % :every = 0 THEN :now - make_interval(days => 1 + g % 30)
                    WHEN g % 10 < 4 THEN :now - make_interval(days => 1 + g % 300)
                    WHEN g % 10 < 7 THEN :now + make_interval(days => 1 + g % 30)
                    WHEN g % 10 = 9 THEN :now - make_interval(days => 1 + g % 30) END,
               CASE WHEN g % :every = 0 OR g % 10 >= 4 THEN 0 ELSE 1 END, created, created
        FROM generate_series(1, :n) g, LATERAL (SELECT :now - make_interval(days => 31 + g % 300) AS created) x
    """), {"n": n, "every": every, "now": now, "before": before,
           "partitions": partitions(conn, "p_ci_job_artifacts")})


def partitions(conn: Connection, parent: str) -> int:
    """How many partition_id values ``parent``'s partitions take (a partition may take two): the seed fills
    100 up, as GitLab numbers them."""
    return conn.scalar(text("""
        SELECT sum(array_length(string_to_array(pg_get_expr(c.relpartbound, c.oid), ','), 1))
        FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid WHERE i.inhparent = CAST(:parent AS regclass)
    """), {"parent": parent})


def detected_release(conn: Connection) -> Release:
    """The GitLab features of this database's tables, read as a run reads them."""
    return Release.of(read_catalog(conn, detect_tables(conn), RELEASE_TABLES))


# A vendored release whose DDL ships without GitLab's non-unique indexes (its header says so) is benchmarked with
# 0016ea05's, where its tables have their columns: without them every batch would scan its 10 M-row table.
INDEXES_FROM = "18.x"


# An index already here, or on a table this schema lacks or has as a partition (its parent's index covers it).
_NOT_BORROWED = text("""
    SELECT to_regclass(:index) IS NOT NULL
        OR coalesce((SELECT relispartition FROM pg_class WHERE oid = to_regclass(:table)), true)
""")


def borrow_indexes(engine: Engine, release: str, log=print) -> None:
    """For a ``release`` whose DDL has no non-unique index, 0016ea05's indexes on its tables: a partitioned
    table's on the table itself (each partition gets its own), none naming a column it lacks (named in the log)."""
    if any(statement.startswith("CREATE INDEX") for statement in ddl(release=release)):
        return
    log(f"GitLab {release}'s DDL has no non-unique index: {INDEXES_FROM}'s borrowed")
    tables = re.compile(r"CREATE (?:UNIQUE )?INDEX (\S+) ON (?:ONLY )?(\S+) ")
    with engine.begin() as conn:
        for statement in ddl(release=INDEXES_FROM):
            found = tables.match(statement)
            if not found or conn.scalar(_NOT_BORROWED, {"index": found[1], "table": found[2]}):
                continue
            try:
                with conn.begin_nested():
                    conn.exec_driver_sql(statement.replace(" ON ONLY ", " ON ", 1),
                                         execution_options={"no_parameters": True})
            except ProgrammingError as error:  # a column GitLab dropped since
                log(f"  not borrowed: {found[1]} ({' '.join(str(error.orig).split())})")


INSERTS = {
    "ci_builds": insert_builds,
    "ci_runner_machines": insert_runner_machines,
    "project_export_jobs": insert_export_jobs,
    "environments": insert_environments,
    "ci_job_artifacts": insert_artifacts,
}


# A table's indexes at every level of its partition tree, parents first, in the order they were created: the
# definition, the partitioned index it is attached to, and whether a constraint uses it (primary key, unique).
_INDEXES = text("""
    SELECT i.indexrelid::regclass::text AS name, pg_get_indexdef(i.indexrelid) AS definition,
           attached.inhparent::regclass::text AS attached_to,
           EXISTS (SELECT FROM pg_constraint c WHERE c.conindid = i.indexrelid) AS constrained
    FROM (SELECT relid, level FROM pg_partition_tree(CAST(:table AS regclass))
          UNION SELECT CAST(:table AS regclass), 0) tree  -- a plain table has no partition tree
    JOIN pg_index i ON i.indrelid = tree.relid
    LEFT JOIN pg_inherits attached ON attached.inhrelid = i.indexrelid
    ORDER BY tree.level, i.indexrelid
""")


@contextlib.contextmanager
def indexes_built_after(conn: Connection, *tables: str) -> Iterator[None]:
    """Inside: ``tables`` without the indexes no constraint uses (every partition's too); after: the same
    indexes built again, as :func:`~ci_cleanup_dev.ddl.create_schema` made them.

    Primary keys and unique constraints stay, and with them the ids GitLab's triggers assign are checked as
    the rows go in. A unique index checks its rows when built again: in the caller's transaction, a duplicate
    rolls the whole insert back, as the INSERT would have failed. A partitioned index comes back ``ON ONLY``
    its table, each partition's index under its own name (GitLab's for ``ci_builds``, PostgreSQL's for the
    dynamic partitions), then attached; all in the order first created, after the constraints' indexes, so a
    table's indexes keep their order (the planner meets them in OID order).
    """
    indexes, dropped = [], set()
    for index in (row for table in tables for row in conn.execute(_INDEXES, {"table": table})):
        if not index.constrained and (index.attached_to is None or index.attached_to in dropped):
            indexes.append(index)
            dropped.add(index.name)
    for index in indexes:
        if index.attached_to is None:  # a partitioned index takes its partitions' with it
            conn.execute(text(f"DROP INDEX {index.name}"))
    yield
    for name, value in INDEX_BUILD.items():
        conn.execute(text("SELECT set_config(:name, :value, true)"), {"name": name, "value": value})
    as_written = {"no_parameters": True}  # the DDL as PostgreSQL wrote it: no bind parameters in it
    for index in indexes:
        conn.exec_driver_sql(index.definition, execution_options=as_written)
    for index in reversed(indexes):  # the deepest partitions first
        if index.attached_to is not None:
            conn.exec_driver_sql(f"ALTER INDEX {index.attached_to} ATTACH PARTITION {index.name}",
                                 execution_options=as_written)


def rows_in(engine: Engine, table: str) -> int:
    """Rows of ``table`` (one of :data:`INSERTS`), every partition's; in a transaction of its own, which must not
    stay open while :func:`insert` drops indexes (its lock would block that)."""
    with engine.connect() as conn:
        return conn.scalar(text(f"SELECT count(*) FROM {PARENT.get(table, table)}"))


def insert(engine: Engine, table: str, n: int, every: int = NONE, now: dt.datetime | None = None) -> None:
    """``n`` rows of ``table``'s mix in one transaction; from ``REBUILD_FROM`` rows into a table holding fewer,
    with the indexes of the tables it fills built after the rows (:func:`indexes_built_after`)."""
    now = now or utc_now()
    fills = (PARENT.get(table, table), *ALSO_FILLS.get(table, ()))
    bulk = n >= REBUILD_FROM and n >= rows_in(engine, table)
    with engine.begin() as conn, indexes_built_after(conn, *fills) if bulk else contextlib.nullcontext():
        for start in range(0, n, CHUNK):
            INSERTS[table](conn, min(CHUNK, n - start), every, now)


def analyze(engine: Engine) -> None:
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        conn.execute(text("VACUUM ANALYZE"))


def seed_scale(engine: Engine, scale: float, *, candidates: bool = True, log=print) -> dict[str, int]:
    """The GitLab.com mix times ``scale``; returns the rows inserted per table."""
    create_schema(engine)
    counts = {}
    for table, (rows, every) in MIX.items():
        n = max(1, int(rows * scale))
        started = time.monotonic()
        insert(engine, table, n, every if candidates else NONE)
        counts[table] = n
        log(f"{table}: {n:,} rows in {time.monotonic() - started:.1f} s")
    analyze(engine)
    return counts


SMALL_TABLES = ("ci_builds", "ci_job_artifacts")  # the other tables are a tenth of these (GitLab.com's mix)


def _rows(table: str, rows: int) -> int:
    return rows if table in SMALL_TABLES else rows // 10


def grow(engine: Engine, rows: int, log) -> None:
    """Background rows (no candidates) up to ``rows`` in the two big tables, a tenth in the others."""
    for table in INSERTS:
        started = time.monotonic()
        insert(engine, table, max(0, _rows(table, rows) - rows_in(engine, table)))
        log(f"  {table}: {_rows(table, rows):,} rows ({time.monotonic() - started:.1f} s)")
    analyze(engine)
