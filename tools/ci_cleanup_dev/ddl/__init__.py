"""GitLab's own DDL for the tables the jobs touch, vendored here (``structure.sql``, ``versions/``), and what the
dev stack, the benchmark and the tests do with it: create GitLab's schema, empty it, lock writes as a decomposed
GitLab does. The jobs never create anything, and nothing the code location loads reads these files: a run finds
its GitLab's release in the catalog (:mod:`ci_cleanup.gitlab.release`).
"""

from __future__ import annotations

import re
from pathlib import Path

from sqlalchemy import text
from sqlalchemy.engine import Connection, Engine

from ci_cleanup.gitlab.schema import (
    BUILD_TAG_TABLES,
    CI_DATABASE,
    FLAT,
    MAIN_DATABASE,
    PARTITIONED,
    GitLabSchema,
    database_of,
    metadata,
)

# The partitions GitLab's partition manager adds at run time (GitLab.com has them), beyond structure.sql's
# ci_builds (100) and ci_job_artifacts (100, 101): tests and the benchmark spread rows over all of them.
DYNAMIC_PARTITIONS = {"p_ci_builds": ("ci_builds", (101, 102)), "p_ci_job_artifacts": ("ci_job_artifacts", (102,))}
# GitLab before partitioning: plain tables whose ids and partition ids came from column defaults.
_FLAT_DEFAULTS = [
    f"ALTER SEQUENCE {table}_id_seq OWNED BY {table}.id;\n"
    f"ALTER TABLE ONLY {table} ALTER COLUMN id SET DEFAULT nextval('{table}_id_seq'::regclass);\n"
    f"ALTER TABLE ONLY {table} ALTER COLUMN partition_id SET DEFAULT 100;"
    for table in ("ci_builds", "ci_job_artifacts")
]
# Tables GitLab's triggers write beside the ones the jobs touch (emptied with them by :func:`truncate_all`), and
# the database each is in (``gitlab_shared``'s loose-FK records: both).
_TRIGGER_TABLES = {"ci_runner_machines_archived": (CI_DATABASE,),
                   "loose_foreign_keys_deleted_records": (MAIN_DATABASE, CI_DATABASE)}


# A dollar quote's delimiter: $$ or $tag$ (19.x's loose-FK functions are $_$ bodies holding $1).
_DOLLAR_QUOTE = re.compile(r"\$(?:[A-Za-z_][A-Za-z_0-9]*)?\$")


def _statements(sql: str) -> list[str]:
    """``structure.sql`` split into statements (a ``;`` ends one at the end of a line, outside ``$tag$`` bodies)."""
    statements, current, body = [], [], None
    for line in sql.splitlines():
        if not current and (not line.strip() or line.startswith("--")):
            continue
        current.append(line)
        for quote in _DOLLAR_QUOTE.findall(line):
            body = quote if body is None else (None if quote == body else body)
        if body is None and line.rstrip().endswith(";"):
            statements.append("\n".join(current))
            current = []
    return statements


# GitLab's schema at the releases ci_cleanup is tested on (``versions/``, each file's header names its source
# commit): the release's name -> its file. ``18.x`` is ``structure.sql`` plus the dynamic partitions.
RELEASES = {
    "16.0": "16.0-f8df4215.sql",
    "17.x": "17.x-cf815822.sql",
    "18.x": "18.x-0016ea05.sql",
    "18.y": "18.y-00084369.sql",
    "19.x": "19.x-84f51c2a.sql",
}


# The releases whose builds' tags are in taggings (GitLab before 17.3's p_ci_build_tags).
TAGGINGS_RELEASES = ("16.0",)


def _queue_sources(taggings: bool) -> list[str]:
    """The tables a stop action's queue row is built from (``queue_sources.sql``), with the build's tags in
    ``taggings`` (before GitLab 17.3) or ``p_ci_build_tags``: not in the releases' vendored subsets."""
    sql = Path(__file__).parent
    return _file_statements(sql / "queue_sources.sql") + _file_statements(
        sql / ("taggings.sql" if taggings else "build_tags.sql"))


def _file_statements(path: Path) -> list[str]:
    """A vendored DDL file's statements, without ``CREATE EXTENSION``: nothing here needs btree_gist or pg_trgm,
    and the embedded PostgreSQL ships neither."""
    return [s for s in _statements(path.read_text()) if not s.startswith("CREATE EXTENSION")]


def ddl(layout: str = PARTITIONED, release: str | None = None) -> list[str]:
    """GitLab's DDL for the tables the jobs touch, in the layout asked for (see ``structure.sql``), or as the
    ``release`` given has them (:data:`RELEASES`; the layout is then the release's own).

    ``partitioned``: as GitLab ships today, plus the dynamic partitions in :data:`DYNAMIC_PARTITIONS`,
    created the way GitLab's partition manager does. ``flat``: GitLab before partitioning, the same
    statements without ``p_ci_builds`` / ``p_ci_job_artifacts``.
    """
    sql = Path(__file__).parent
    if release is not None:
        if release not in RELEASES:
            raise ValueError(f"release must be one of {', '.join(RELEASES)}, not {release!r}")
        return _file_statements(sql / "versions" / RELEASES[release]) + _queue_sources(release in TAGGINGS_RELEASES)
    statements = _file_statements(sql / "structure.sql")
    if layout == FLAT:
        return ([s for s in statements if not re.search(r"\bp_ci_(builds|job_artifacts)", s)] + _FLAT_DEFAULTS
                + _queue_sources(taggings=True))
    if layout != PARTITIONED:
        raise ValueError(f"layout must be {PARTITIONED!r} or {FLAT!r}, not {layout!r}")
    return statements + _queue_sources(taggings=False) + [
        f"CREATE TABLE IF NOT EXISTS gitlab_partitions_dynamic.{name}_{value} "
        f"PARTITION OF {parent} FOR VALUES IN ({value});"
        for parent, (name, values) in DYNAMIC_PARTITIONS.items()
        for value in values
    ]


def create_schema(engine: Engine, layout: str = PARTITIONED, release: str | None = None) -> None:
    """Create GitLab's tables, indexes and triggers (of ``release`` if given), unless there already (dev stack,
    benchmark and tests only)."""
    with engine.begin() as conn:
        if conn.scalar(text("SELECT to_regclass('ci_pending_builds')")) is not None:
            return
        cursor = conn.connection.dbapi_connection.cursor()
        for statement in ddl(layout, release):
            cursor.execute(statement)


def truncate_all(
    conn: Connection, schema: GitLabSchema, also: tuple[str, ...] = (), database: str | None = None
) -> None:
    """Empty every table the jobs touch, those GitLab's triggers write and ``also`` (tests, demo, benchmark only);
    given a ``database`` (``main`` / ``ci``), only its own tables: the other's copies are write-locked there."""
    tables = [t.name for t in schema.metadata.sorted_tables if database in (None, database_of(t))]
    names = [name for name in tables if name not in BUILD_TAG_TABLES]
    # GitLab's own trigger tables where this release has them (16.0 has neither, 18.y no _archived copy), and the
    # one table of a build's tags it has.
    names += conn.scalars(
        text("SELECT name FROM unnest(CAST(:names AS text[])) name WHERE to_regclass(name) IS NOT NULL"),
        {"names": [name for name, where in _TRIGGER_TABLES.items() if database in (None, *where)]
         + [name for name in BUILD_TAG_TABLES if name in tables]},
    ).all() + list(also)
    conn.execute(text("TRUNCATE " + ", ".join(f'"{name}"' for name in names) + " RESTART IDENTITY"))


# GitLab's lock-writes (``rake gitlab:db:lock_writes``, ``Gitlab::Database::LockWritesManager``): each database
# of a decomposed GitLab keeps the other's tables, empty, behind a statement trigger that refuses writes.
_PREVENT_WRITE_FUNCTION = """
CREATE OR REPLACE FUNCTION gitlab_schema_prevent_write() RETURNS TRIGGER AS $$
BEGIN
    IF COALESCE(NULLIF(current_setting(CONCAT('lock_writes.', TG_TABLE_NAME), true), ''), 'true') THEN
      RAISE EXCEPTION 'Table: "%" is write protected within this Gitlab database.', TG_TABLE_NAME
        USING ERRCODE = 'modifying_sql_data_not_permitted',
        HINT = 'Make sure you are using the right database connection';
    END IF;
    RETURN NEW;
END
$$ LANGUAGE PLPGSQL"""


def lock_writes(conn: Connection, database: str) -> list[str]:
    """Lock writes, as GitLab's rake task does, on every table (and partition) of this schema that lives in the
    *other* database than ``database``; the tables locked (dev stack, benchmark and tests only)."""
    foreign = [t.name for t in metadata.sorted_tables if database_of(t) != database]
    foreign += [name for name, where in _TRIGGER_TABLES.items() if database not in where]
    if database == MAIN_DATABASE:
        foreign += ["ci_builds", "ci_job_artifacts"]  # the flat layout's tables (partitions of the parents else)
    conn.execute(text(_PREVENT_WRITE_FUNCTION))
    tables = conn.execute(
        text("WITH RECURSIVE t(oid) AS (SELECT to_regclass(n) FROM unnest(CAST(:names AS text[])) n "
             "  UNION SELECT inhrelid FROM pg_inherits JOIN t ON inhparent = t.oid) "
             "SELECT oid::regclass::text, relname FROM t JOIN pg_class USING (oid)"),
        {"names": foreign},
    ).all()
    for qualified, name in tables:
        conn.execute(text(
            f"CREATE TRIGGER gitlab_schema_write_trigger_for_{name} BEFORE INSERT OR UPDATE OR DELETE OR TRUNCATE "
            f"ON {qualified} FOR EACH STATEMENT EXECUTE FUNCTION gitlab_schema_prevent_write()"
        ))
    return [qualified for qualified, _ in tables]
