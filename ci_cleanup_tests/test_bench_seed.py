"""A big seed builds GitLab's indexes after its rows and leaves the schema exactly as ``create_schema`` made it
(a scratch database each)."""

from __future__ import annotations

import pytest
from sqlalchemy import create_engine, text
from sqlalchemy.exc import IntegrityError

from ci_cleanup_dev.bench import seed
from ci_cleanup_dev.ddl import create_schema

from .harness import gitlab_database

OURS = "IN ('public', 'gitlab_partitions_dynamic')"
CATALOG = {
    "indexes": f"SELECT schemaname, tablename, indexname, indexdef FROM pg_indexes WHERE schemaname {OURS}",
    "constraints": "SELECT conrelid::regclass::text, conname, pg_get_constraintdef(oid), conindid::regclass::text, "
                   f"conparentid::regclass::text FROM pg_constraint WHERE connamespace::regnamespace::text {OURS}",
    "attached": "SELECT inhrelid::regclass::text, inhparent::regclass::text FROM pg_inherits "
                "JOIN pg_class c ON c.oid = inhrelid AND c.relkind IN ('i', 'I')",
    "flags": "SELECT indexrelid::regclass::text, indisvalid, indisready, indislive, indisunique, indisprimary, "
             "indisclustered, indisreplident FROM pg_index WHERE indrelid::regclass::text NOT LIKE 'pg_%'",
    # the order the planner meets a table's indexes in
    "order": "SELECT indrelid::regclass::text, string_agg(indexrelid::regclass::text, ' ' ORDER BY indexrelid) "
             "FROM pg_index WHERE indrelid::regclass::text NOT LIKE 'pg_%' GROUP BY 1",
    "triggers": "SELECT tgrelid::regclass::text, tgname, pg_get_triggerdef(oid) FROM pg_trigger WHERE NOT tgisinternal",
}


def _catalog(conn) -> dict[str, list[tuple]]:
    return {name: sorted(tuple(row) for row in conn.execute(text(query))) for name, query in CATALOG.items()}


def _index_count(conn) -> int:
    return conn.scalar(text(f"SELECT count(*) FROM pg_indexes WHERE schemaname {OURS}"))


def test_a_big_insert_builds_the_indexes_after_its_rows_and_leaves_the_schema_as_it_was(
        scratch_database, monkeypatch):
    engine = gitlab_database(scratch_database)
    with engine.connect() as conn:
        created = _catalog(conn)
    monkeypatch.setattr(seed, "REBUILD_FROM", 200)
    indexes_during = {}
    for table, insert in seed.INSERTS.items():
        def spy(conn, n, every, now, table=table, insert=insert):
            indexes_during[table] = _index_count(conn)
            insert(conn, n, every, now)
        monkeypatch.setitem(seed.INSERTS, table, spy)
        seed.insert(engine, table, 300, every=10)  # into an empty table: indexes built after
    with engine.connect() as conn:
        assert _catalog(conn) == created
        everyone = _index_count(conn)
        assert conn.execute(text("SELECT min(id), max(id), count(*) FROM p_ci_builds")).one() == (1, 300, 300)
        assert conn.scalar(text("SELECT count(*) FROM deployments")) == 600
    assert all(during < everyone - 40 for table, during in indexes_during.items() if table == "ci_builds")
    assert all(during < everyone for during in indexes_during.values())

    indexes_during.clear()
    seed.insert(engine, "ci_builds", 200, every=10)  # no more rows than the table holds: indexes kept up
    assert indexes_during == {"ci_builds": everyone}
    with engine.connect() as conn:
        assert conn.execute(text("SELECT min(id), max(id), count(*) FROM p_ci_builds")).one() == (1, 500, 500)
        assert conn.scalar(text("SELECT count(*) FROM ci_running_builds")) == 50
    engine.dispose()


def test_a_duplicate_found_when_the_indexes_are_built_rolls_the_whole_insert_back(scratch_database):
    engine = gitlab_database(scratch_database)
    with engine.connect() as conn:
        created = _catalog(conn)
    duplicate = text("""INSERT INTO p_ci_job_artifacts (partition_id, project_id, job_id, file_type, file_store,
                                                        locked, created_at, updated_at)
                        SELECT 100, 1, 7, 1, 2, 0, now(), now() FROM generate_series(1, 2)""")
    with pytest.raises(IntegrityError, match="could not create unique index"):
        with engine.begin() as conn, seed.indexes_built_after(conn, "p_ci_job_artifacts"):
            conn.execute(duplicate)  # GitLab's unique index is not there to refuse it
    with engine.connect() as conn:
        assert _catalog(conn) == created
        assert conn.scalar(text("SELECT count(*) FROM p_ci_job_artifacts")) == 0
    engine.dispose()


def test_growing_the_bench_tables_builds_the_big_ones_indexes_after(scratch_database, monkeypatch):
    """``bench``'s grow: no transaction of its own stays open (its lock would block dropping the indexes)."""
    gitlab_database(scratch_database).dispose()
    engine = create_engine(scratch_database, connect_args={"options": "-c lock_timeout=10s"})
    with engine.connect() as conn:
        created = _catalog(conn)
    monkeypatch.setattr(seed, "REBUILD_FROM", 200)
    seed.grow(engine, 300, log=lambda line: None)  # builds and artifacts at once, the others (30) row by row
    with engine.connect() as conn:
        assert _catalog(conn) == created
        counts = {table: seed.rows_in(engine, table) for table in seed.INSERTS}
    assert counts == {"ci_builds": 300, "ci_runner_machines": 30, "project_export_jobs": 30, "environments": 30,
                      "ci_job_artifacts": 300}
    engine.dispose()


def test_runner_machines_are_seeded_in_the_order_they_were_registered(scratch_database):
    """As GitLab appends them: ids and each partition's pages follow created_at, so the machines registered this
    week (the only rows a stale sub-batch with nothing to delete reads) are the table's last rows."""
    engine = gitlab_database(scratch_database)
    seed.insert(engine, "ci_runner_machines", 400)  # the background mix: 20 registered this week, never contacted
    with engine.connect() as conn:
        by_created = conn.scalars(text("SELECT id FROM ci_runner_machines ORDER BY created_at, id")).all()
        assert by_created == sorted(by_created) and len(by_created) == 400
        in_pages = conn.execute(text("""SELECT tableoid::regclass::text, array_agg(id ORDER BY ctid)
                                        FROM ci_runner_machines GROUP BY 1""")).all()
        assert len(in_pages) == 3 and all(ids == sorted(ids) for _, ids in in_pages)
        never, older = conn.execute(text("""
            SELECT array_agg(id ORDER BY id) FILTER (WHERE contacted_at IS NULL),
                   max(id) FILTER (WHERE created_at <= now() - interval '7 days')
            FROM ci_runner_machines""")).one()
        assert len(never) == 20 and never[0] > older  # after every machine registered before the week
    engine.dispose()


def test_the_newest_release_is_seeded_in_its_partitions_with_0016ea05s_indexes_where_its_columns_allow(
        scratch_database):
    """18.y's DDL ships no non-unique index, two partitions of builds and artifacts, and organization_id where
    runner machines had sharding_key_id: the seed fills what it has, and the borrowed indexes make its batches
    the index scans they are on 0016ea05."""
    engine = create_engine(scratch_database)
    create_schema(engine, release="18.y")
    skipped = []
    seed.borrow_indexes(engine, "18.y", log=skipped.append)
    for table in seed.INSERTS:
        seed.insert(engine, table, 60, every=10)
    with engine.connect() as conn:
        assert conn.execute(text("SELECT partition_id, count(*) FROM p_ci_builds GROUP BY 1 ORDER BY 1")).all() == [
            (100, 30), (101, 30)]
        assert conn.execute(text("SELECT partition_id, count(*) FROM p_ci_job_artifacts GROUP BY 1 ORDER BY 1")
                            ).all() == [(100, 30), (101, 30)]
        assert conn.execute(text("""SELECT runner_type, count(*), count(organization_id) FROM ci_runner_machines
                                    GROUP BY 1 ORDER BY 1""")).all() == [(1, 20, 0), (2, 20, 20), (3, 20, 20)]
        indexes = set(conn.scalars(text(f"SELECT indexname FROM pg_indexes WHERE schemaname {OURS}")))
    assert {"p_ci_builds_status_type_runner_id_idx", "index_ci_runner_machines_687967fa8a_on_created_at_and_id_desc",
            "index_environments_on_state_and_auto_stop_at"} <= indexes
    assert skipped[0] == "GitLab 18.y's DDL has no non-unique index: 18.x's borrowed"
    assert all("sharding_key_id" in line for line in skipped[1:]) and len(skipped) > 1
    logged = len(skipped)
    seed.borrow_indexes(engine, "18.x", log=skipped.append)  # a release that ships its indexes borrows none
    assert len(skipped) == logged
    engine.dispose()


def test_a_release_bench_stops_on_a_database_that_holds_another_releases_tables(scratch_database):
    """create_schema leaves tables already there: the bench would measure 0016ea05's and call it 18.y's."""
    from ci_cleanup_dev.bench import run

    engine = gitlab_database(scratch_database)  # 0016ea05's
    create_schema(engine, release="18.y")
    with pytest.raises(SystemExit, match=r"--release 18.y: the database holds another GitLab schema \(like 17.x, "
                                         r"18.x\): bench into a database of its own"):
        run.require_release(engine, "18.y")
    run.require_release(engine, "18.x")
    engine.dispose()
