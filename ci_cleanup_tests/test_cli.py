"""A new operator's first hour with ``ci-cleanup``: which servers each command uses, what it refuses, what it prints."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path
from urllib.parse import unquote

import pytest
import redis
from dagster import DagsterInstance
from sqlalchemy import create_engine, inspect, text
from sqlalchemy.engine import make_url

from ci_cleanup.cli import dagster_pg_url, main
from ci_cleanup.resources import job_resources
from ci_cleanup.stuck_export_jobs.job import stuck_export_jobs
from ci_cleanup_dev.demo import seed
from ci_cleanup_dev.devstack import DAGSTER_YAML, EmbeddedStack

from .harness import clean_env, free_port, gitlab_database, servers_of, wait_for_ui
from .runner import failure_messages
from .test_code_location import WORK

BIN = Path(sys.executable).parent
REPO = Path(__file__).resolve().parents[1]


def cli(*args: str, data_dir: Path, timeout: int = 300, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [BIN / "ci-cleanup", "--data-dir", str(data_dir), *args],
        env=clean_env(**env), capture_output=True, text=True, timeout=timeout,
    )


@pytest.fixture
def cli_here(monkeypatch, capsys):
    """``cli`` in this process (``ci_cleanup.cli.main``, the ``ci-cleanup`` entry point), for the answers that start
    no server: the same arguments, the same variables alone, its exit code and output. A ``ci-cleanup`` process is a
    few CPU-seconds; each command still runs as a process elsewhere in this module."""

    def run(*args: str, data_dir: Path, **env: str) -> subprocess.CompletedProcess:
        with monkeypatch.context() as patched:
            for name in [k for k in os.environ if k.startswith(("CI_CLEANUP_", "DAGSTER_"))]:
                patched.delenv(name)
            for name, value in env.items():
                patched.setenv(name, value)
            handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}  # main sets its own
            capsys.readouterr()
            try:
                main(["--data-dir", str(data_dir), *args])
                code = 0
            except SystemExit as exit_:
                code = exit_.code if isinstance(exit_.code, int) else 1
            finally:
                for sig, handler in handlers.items():
                    signal.signal(sig, handler)
            out = capsys.readouterr()
        return subprocess.CompletedProcess(["ci-cleanup", *args], code, out.out, out.err)

    return run


def tables_of(url: str) -> list[str]:
    engine = create_engine(url)
    try:
        return sorted(inspect(engine).get_table_names())
    finally:
        engine.dispose()


def count(url: str, table: str) -> int:
    engine = create_engine(url)
    try:
        with engine.connect() as conn:
            return conn.scalar(text(f'SELECT count(*) FROM "{table}"'))
    finally:
        engine.dispose()


def test_a_command_run_beside_a_running_stack_leaves_its_servers_running(servers_dir):
    """`make dev` holds the stack; any other command on the same folder uses it and must not stop it."""
    data_dir = servers_dir / "shared"
    with EmbeddedStack(data_dir) as running:
        done = cli("schema", "create", data_dir=data_dir)

        assert done.returncode == 0, done.stdout + done.stderr
        assert "already running" in done.stdout
        assert redis.Redis.from_url(running.redis_url).ping()
        assert tables_of(running.url())  # the command created the schema in the shared PostgreSQL, still up
    assert servers_of(data_dir) == []  # and the stack's owner stopped both


def test_schema_create_with_only_the_database_url_creates_the_schema_there(servers_dir, scratch_database):
    done = cli("schema", "create", data_dir=servers_dir / "schema_db", CI_CLEANUP_DATABASE_URL=scratch_database)

    assert done.returncode == 0, done.stdout + done.stderr
    where = unquote(make_url(scratch_database).render_as_string(hide_password=True))  # socket folder as a path
    assert f"GitLab schema created in {where}" in done.stdout
    assert {"ci_builds", "ci_runner_machines", "environments"} <= set(tables_of(scratch_database))
    assert not (servers_dir / "schema_db").exists()  # no embedded stack was started


def test_schema_create_of_gitlabs_flat_layout_then_the_demo_seed_on_it(servers_dir, scratch_database, stack):
    env = dict(CI_CLEANUP_DATABASE_URL=scratch_database)
    done = cli("schema", "create", "--layout", "flat", data_dir=servers_dir / "schema_flat", **env)
    assert done.returncode == 0, done.stdout + done.stderr
    assert {"ci_builds", "ci_job_artifacts"} <= set(tables_of(scratch_database))
    assert not {"p_ci_builds", "p_ci_job_artifacts"} & set(tables_of(scratch_database))

    name = make_url(scratch_database).database
    seeded = cli("seed", "--into", name, data_dir=servers_dir / "schema_flat",
                 CI_CLEANUP_REDIS_URL=f"{stack.redis_url}?db=6", **env)
    assert seeded.returncode == 0, seeded.stdout + seeded.stderr
    engine = create_engine(scratch_database)
    with engine.connect() as conn:  # the demo's rows went into the flat tables it found
        assert conn.scalar(text("SELECT count(*) FROM ci_builds")) > 0
        assert conn.scalar(text("SELECT count(*) FROM ci_job_artifacts")) > 0
    engine.dispose()


def test_schema_create_with_only_the_redis_url_refuses_naming_the_database_url(servers_dir, stack, cli_here):
    done = cli_here("schema", "create", data_dir=servers_dir / "schema_redis", CI_CLEANUP_REDIS_URL=stack.redis_url)

    assert done.returncode == 1
    assert done.stderr.splitlines() == [
        "ci-cleanup schema: CI_CLEANUP_REDIS_URL is set but CI_CLEANUP_DATABASE_URL is not: "
        "`ci-cleanup schema` uses CI_CLEANUP_DATABASE_URL",
        "  Set CI_CLEANUP_DATABASE_URL too, or unset CI_CLEANUP_REDIS_URL to use the embedded stack",
    ]
    assert not (servers_dir / "schema_redis").exists()


def test_seeding_a_configured_database_needs_its_name_and_refuses_gitlab_data(
    servers_dir, scratch_database, stack, cli_here
):
    env = dict(CI_CLEANUP_DATABASE_URL=scratch_database, CI_CLEANUP_REDIS_URL=f"{stack.redis_url}?db=5")
    name = make_url(scratch_database).database
    where = unquote(make_url(scratch_database).render_as_string(hide_password=True))  # socket folder as a path
    queues = redis.Redis.from_url(env["CI_CLEANUP_REDIS_URL"])
    queues.flushdb()

    unnamed = cli_here("seed", data_dir=servers_dir / "seed", **env)
    misnamed = cli_here("seed", "--into", "gitlabhq_production", data_dir=servers_dir / "seed", **env)
    bench = cli("bench", data_dir=servers_dir / "seed", **env)  # it seeds millions of rows

    assert bench.returncode == 1 and bench.stderr.splitlines()[1] == (
        f"  If that database is yours to fill, name it: ci-cleanup bench --into {name}"
    )

    for refused in (unnamed, misnamed):
        assert refused.returncode == 1
        assert refused.stderr.splitlines() == [
            f"ci-cleanup seed: CI_CLEANUP_DATABASE_URL points at {where}: "
            "`ci-cleanup seed` would write fake GitLab rows there",
            f"  If that database is yours to fill, name it: ci-cleanup seed --into {name}",
        ]
    assert tables_of(scratch_database) == [] and queues.dbsize() == 0

    named = cli("seed", "--into", name, data_dir=servers_dir / "seed", **env)

    assert named.returncode == 0, named.stdout + named.stderr
    assert f"Writing the demo dataset (fake GitLab rows, Sidekiq status keys) into {where} and Redis" in named.stdout
    assert (count(scratch_database, "p_ci_builds"), count(scratch_database, "ci_runner_machines")) == (220, 170)
    assert queues.dbsize() == 15  # the exports Sidekiq still has

    again = cli_here("seed", "--into", name, data_dir=servers_dir / "seed", **env)

    # A database this command seeded is seeded anew, its rows replaced (not added to), however often.
    assert again.returncode == 0, again.stderr
    assert again.stdout.splitlines()[-1] == "Seeded the demo GitLab dataset (the rows of the earlier seed replaced)"
    assert (count(scratch_database, "p_ci_builds"), count(scratch_database, "ci_runner_machines")) == (220, 170)
    assert queues.dbsize() == 15
    assert not (servers_dir / "seed").exists()
    queues.flushdb()
    queues.close()


def test_seed_and_schema_create_refuse_a_database_with_projects(servers_dir, scratch_database, stack, cli_here):
    engine = create_engine(scratch_database)
    with engine.begin() as conn:  # GitLab's projects table, as far as this check cares
        conn.execute(text("CREATE TABLE projects (id bigint PRIMARY KEY)"))
        conn.execute(text("INSERT INTO projects VALUES (1)"))
    engine.dispose()
    name = make_url(scratch_database).database

    seeded = cli("seed", "--into", name, data_dir=servers_dir / "projects",
                 CI_CLEANUP_DATABASE_URL=scratch_database, CI_CLEANUP_REDIS_URL=stack.redis_url)
    created = cli_here("schema", "create", data_dir=servers_dir / "projects", CI_CLEANUP_DATABASE_URL=scratch_database)

    for refused in (seeded, created):
        assert refused.returncode == 1
        assert "holds GitLab data (projects is not empty): refusing to write to it" in refused.stderr
    assert tables_of(scratch_database) == ["projects"]


def test_one_run_of_a_job_from_the_repo_root_as_the_readme_shows_and_its_dry_run(stack, engine, redis_client):
    readme = (REPO / "README.md").read_text()
    assert ".venv/bin/ci-cleanup run drop_canceling_builds --dry-run" in readme
    assert ".venv/bin/ci-cleanup run drop_canceling_builds      # one run, no instance needed" in readme
    seed(engine, redis_client)
    env = dict(CI_CLEANUP_DATABASE_URL=stack.url(), CI_CLEANUP_REDIS_URL=stack.redis_url)
    with engine.connect() as conn:
        before = conn.scalar(text(WORK["drop_canceling_builds"]))

    dry = subprocess.run(
        [".venv/bin/ci-cleanup", "run", "drop_canceling_builds", "--dry-run"],
        env=clean_env(**env), capture_output=True, text=True, cwd=REPO, timeout=300,
    )

    assert dry.returncode == 0, dry.stdout + dry.stderr
    assert dry.stdout.splitlines()[-3:] == [
        "drop_canceling_builds                    ok     rows_changed=0",
        "    would_drop_count: 120",  # what would change first
        "    status: dry run",
    ]
    with engine.connect() as conn:
        assert conn.scalar(text(WORK["drop_canceling_builds"])) == before

    done = subprocess.run(
        [".venv/bin/ci-cleanup", "run", "drop_canceling_builds"],
        env=clean_env(**env), capture_output=True, text=True, cwd=REPO, timeout=300,
    )

    assert done.returncode == 0, done.stdout + done.stderr
    assert "drop_canceling_builds                    ok     rows_changed=120" in done.stdout
    assert "    dropped_count: 120" in done.stdout
    with engine.connect() as conn:
        assert conn.scalar(text("SELECT count(*) FROM p_ci_builds WHERE status = 'canceling'")) == 10  # the recent ones

    nothing_to_do = subprocess.run(
        [".venv/bin/ci-cleanup", "run", "drop_canceling_builds", "--dry-run"],
        env=clean_env(**env), capture_output=True, text=True, cwd=REPO, timeout=300,
    )

    assert nothing_to_do.returncode == 0, nothing_to_do.stdout + nothing_to_do.stderr
    assert nothing_to_do.stdout.splitlines()[-3:] == [  # a dry run says what it would change, zeros included
        "drop_canceling_builds                    ok     rows_changed=0",
        "    would_drop_count: 0",  # what would change first
        "    status: dry run",
    ]


def test_a_named_error_is_one_line_and_what_to_do_and_the_traceback_only_with_debug(servers_dir, stack):
    unreachable = "postgresql://gitlab:s3cr3t-pw@/gitlabhq_production?host=/nonexistent"
    env = dict(CI_CLEANUP_DATABASE_URL=unreachable, CI_CLEANUP_REDIS_URL=stack.redis_url)

    plain = cli("run", "stuck_export_jobs", data_dir=servers_dir / "errors", **env)
    debug = cli("--debug", "run", "stuck_export_jobs", data_dir=servers_dir / "errors", **env)
    bad_url = cli("run", "stuck_export_jobs", data_dir=servers_dir / "errors",
                  CI_CLEANUP_DATABASE_URL="mysql://gitlab:s3cr3t-pw@db/gitlab", CI_CLEANUP_REDIS_URL=stack.redis_url)

    assert plain.returncode == 1 and plain.stdout == ""
    assert plain.stderr.splitlines() == [
        "ci-cleanup run: Cannot reach the GitLab database (PostgreSQL) at "
        "postgresql+psycopg2://gitlab:***@/gitlabhq_production?host=/nonexistent: connection to server on socket "
        '"/nonexistent/.s.PGSQL.5432" failed: No such file or directory Is the server running locally and '
        "accepting connections on that socket?",
        "  Check that the server named above is up and that its URL is right "
        "(ci-cleanup --debug … shows the traceback)",
    ]
    assert debug.returncode == 1 and "Traceback (most recent call last)" in debug.stderr
    assert bad_url.returncode == 1 and bad_url.stderr.splitlines() == [
        "ci-cleanup run: CI_CLEANUP_DATABASE_URL must be postgresql+psycopg2://…, not mysql://",
        "  Set CI_CLEANUP_DATABASE_URL=postgresql+psycopg2://user:password@host:5432/database",
    ]
    assert all("s3cr3t-pw" not in done.stdout + done.stderr for done in (plain, debug, bad_url))


def test_a_gitlab_config_folder_without_database_yml_is_one_line_naming_the_file_before_anything_runs(
        servers_dir, stack, tmp_path):
    done = cli("run", "drop_canceling_builds", "--dry-run", data_dir=servers_dir / "errors",
               CI_CLEANUP_GITLAB_CONFIG_DIR=str(tmp_path), CI_CLEANUP_REDIS_URL=stack.redis_url)

    assert done.returncode == 1 and done.stderr.splitlines() == [
        f"ci-cleanup run: {tmp_path}/database.yml: does not exist",
        "  Fix the file or setting named above, or set the server's URL variable instead "
        "(ci-cleanup --debug … shows the traceback)",
    ]
    assert done.stdout == (f"Using GitLab's config files in {tmp_path} (CI_CLEANUP_GITLAB_CONFIG_DIR)\n"
                           "drop_canceling_builds acts on:\n")


def test_a_failed_run_prints_its_error_in_one_line(servers_dir, stack, scratch_database):
    gitlab_database(scratch_database, "ALTER TABLE ci_runner_machines DROP COLUMN contacted_at").dispose()

    done = cli("run", "stale_runner_machines_cleanup", data_dir=servers_dir / "mismatch",
               CI_CLEANUP_DATABASE_URL=scratch_database, CI_CLEANUP_REDIS_URL=stack.redis_url)

    assert done.returncode == 1
    # What it acts on comes first, before anything is changed, passwords hidden (test_a_run_prints_its_targets…).
    lines = done.stdout.splitlines()[4:]
    assert lines[0] == "stale_runner_machines_cleanup            FAILED rows_changed=-"
    assert lines[1].startswith("    error: ") and "column ci_runner_machines.contacted_at is missing" in lines[1]
    assert len(lines) == 2 and "Traceback" not in done.stdout + done.stderr
    assert done.stderr == "A run failed (its error is above; ci-cleanup --debug … prints the whole of it)\n"

    debug = cli("--debug", "run", "stale_runner_machines_cleanup", data_dir=servers_dir / "mismatch",
                CI_CLEANUP_DATABASE_URL=scratch_database, CI_CLEANUP_REDIS_URL=stack.redis_url)

    assert debug.returncode == 1 and "Stack Trace:" in debug.stdout and "SchemaMismatch" in debug.stdout


def _busy_port() -> socket.socket:
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    return listener


def test_dev_on_a_busy_port_fails_at_once_naming_the_port_and_starts_nothing(servers_dir):
    data_dir = servers_dir / "busy"
    with _busy_port() as listener:
        port = listener.getsockname()[1]
        done = cli("dev", "--port", str(port), data_dir=data_dir, timeout=120)

    assert done.returncode == 1
    assert done.stderr.splitlines() == [
        f"ci-cleanup dev: Port {port} on 127.0.0.1 is in use (Address already in use): another `ci-cleanup dev` "
        "or web server?",
        f"  Stop it, or choose another port: ci-cleanup dev --port {port + 1} (make dev ARGS='--port {port + 1}')",
    ]
    assert not data_dir.exists()


def test_dev_exits_with_an_error_when_dagster_dev_stops_on_its_own(servers_dir, stack, tmp_path):
    (tmp_path / "dagster.yaml").write_text("storage:\n  no_such_storage: {}\n")

    done = cli("dev", "--port", "0", data_dir=servers_dir / "crash", timeout=300,
               CI_CLEANUP_DATABASE_URL=stack.url(), CI_CLEANUP_REDIS_URL=stack.redis_url, DAGSTER_HOME=str(tmp_path))

    assert done.returncode == 1
    assert done.stderr.splitlines()[-2:] == [
        "ci-cleanup dev: dagster dev stopped with exit status 1",
        "  Its output above says why; the servers this command started are stopped",
    ]


def test_the_dagster_instance_url_gets_the_installed_driver():
    """SQLAlchemy 2.1 reads postgresql:// as psycopg 3, which is not installed: dev hands Dagster psycopg2's."""
    env = dagster_pg_url({"CI_CLEANUP_DAGSTER_PG_URL": "postgresql://dagster:pw@db:5432/dagster"})

    assert env == {"CI_CLEANUP_DAGSTER_PG_URL": "postgresql+psycopg2://dagster:pw@db:5432/dagster"}


def _make(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["make", *args], cwd=tmp_path, capture_output=True, text=True, timeout=60)


def test_make_refuses_a_python_that_is_not_3_11_and_rebuilds_a_venv_left_by_one(tmp_path):
    for name in ("Makefile", "pyproject.toml", "dagster_cli.pth"):
        (tmp_path / name).write_text((REPO / name).read_text())
    python312 = tmp_path / "python312"  # answers like a Python 3.12 would, and can make nothing
    python312.write_text('#!/bin/sh\n[ "$1" = -V ] && echo "Python 3.12.3" && exit 0\nexit 1\n')
    python312.chmod(0o755)

    refused = _make(tmp_path, "demo", "PYTHON=./python312")

    assert refused.returncode != 0
    assert refused.stderr.splitlines()[:2] == [
        "ci_cleanup needs Python 3.11, and ./python312 is Python 3.12.3.",
        "Run again with one: make demo PYTHON=python3.11",
    ]
    assert not (tmp_path / ".venv").exists()

    (tmp_path / ".venv" / "bin").mkdir(parents=True)  # what an earlier make with that Python left
    (tmp_path / ".venv" / "bin" / "python").symlink_to(python312)
    (tmp_path / ".venv" / ".installed").touch()

    planned = _make(tmp_path, "-n", "demo", f"PYTHON={sys.executable}")

    assert planned.returncode == 0, planned.stderr
    lines = planned.stdout.splitlines()
    assert lines.index("rm -rf .venv") + 1 == lines.index(f"{sys.executable} -m venv .venv")

    cleaned = _make(tmp_path, "clean")

    assert cleaned.returncode == 0, cleaned.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["Makefile", "dagster_cli.pth", "pyproject.toml", "python312"]


def test_a_resource_field_set_in_the_launchpad_needs_no_url(stack, engine, monkeypatch):
    """The README's Launchpad example: only the field changed; the URLs are read from the environment when the run
    starts, and none is in the stored run config."""
    from dagster import DagsterInstance

    from ci_cleanup import defs

    from .factories import ago, create

    monkeypatch.setenv("CI_CLEANUP_DATABASE_URL", stack.url())
    monkeypatch.setenv("CI_CLEANUP_REDIS_URL", stack.redis_url)
    stale = create(engine, "ci_runner_machines", created_at=ago(days=30), contacted_at=ago(days=8))
    run_config = {"resources": {"gitlab_db": {"config": {"pool_size": 4}}}}
    readme = " ".join((REPO / "README.md").read_text().split())
    assert "`resources: {gitlab_db: {config: {pool_size: 4}}}`" in readme
    assert "never paste a URL with its password there" in readme

    with DagsterInstance.ephemeral() as instance:
        result = defs.resolve_job_def("stale_runner_machines_cleanup").execute_in_process(
            run_config=run_config, instance=instance,
        )
        stored = instance.get_run_by_id(result.run_id).run_config

    assert result.success
    assert stored["resources"]["gitlab_db"] == {"config": {"pool_size": 4}}
    with engine.connect() as conn:
        assert conn.scalar(text("SELECT count(*) FROM ci_runner_machines WHERE id = :id"), {"id": stale}) == 0


def test_dev_on_configured_servers_takes_a_bare_postgresql_url_for_the_dagster_instance(stack, tmp_path):
    """`CI_CLEANUP_DAGSTER_PG_URL=postgresql://…` must not end in "No module named 'psycopg'"."""
    import json
    import os
    import signal
    import urllib.request

    (tmp_path / "dagster.yaml").write_text(DAGSTER_YAML.read_text())
    port = free_port()
    bare = stack.url("dagster").replace("postgresql+psycopg2://", "postgresql://")
    process = subprocess.Popen(
        [BIN / "ci-cleanup", "--data-dir", str(tmp_path / "unused"), "dev", "--port", str(port)],
        env=clean_env(CI_CLEANUP_DATABASE_URL=stack.url(), CI_CLEANUP_REDIS_URL=stack.redis_url,
                      CI_CLEANUP_DAGSTER_PG_URL=bare, DAGSTER_HOME=str(tmp_path)),
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
    )
    try:
        wait_for_ui(f"http://127.0.0.1:{port}", process)
        request = urllib.request.Request(  # reads the instance's run storage, in PostgreSQL
            f"http://127.0.0.1:{port}/graphql", data=json.dumps({"query": "{ runsOrError { __typename } }"}).encode(),
            headers={"Content-Type": "application/json"},
        )
        answer = json.load(urllib.request.urlopen(request, timeout=30))
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGINT)
        output, _ = process.communicate(timeout=60)

    assert answer == {"data": {"runsOrError": {"__typename": "Runs"}}}
    assert "No module named 'psycopg'" not in output
    assert process.returncode == 0, output[-3000:]
    assert not (tmp_path / "unused").exists()  # the configured servers only


def test_one_run_with_only_gitlabs_config_folder_as_beside_an_omnibus_gitlab(stack, engine, redis_client, tmp_path):
    """CI_CLEANUP_GITLAB_CONFIG_DIR alone: database.yml and resque.yml as Omnibus writes them (socket folder,
    ``unix:/…`` Redis URL); the run uses them, not the embedded stack."""
    seed(engine, redis_client)
    socket_dir = make_url(stack.url()).query["host"]
    (tmp_path / "database.yml").write_text(
        f"production:\n  main:\n    adapter: postgresql\n    database: gitlab\n    username: postgres\n"
        f"    host: {socket_dir}\n  ci:\n    adapter: postgresql\n    database: gitlab\n    username: postgres\n"
        f"    host: {socket_dir}\n    database_tasks: false\n")
    (tmp_path / "resque.yml").write_text(f"production:\n  url: unix:{stack.redis_url.removeprefix('unix://')}\n")

    done = subprocess.run(
        [".venv/bin/ci-cleanup", "run", "drop_canceling_builds"],
        env=clean_env(CI_CLEANUP_GITLAB_CONFIG_DIR=str(tmp_path)), capture_output=True, text=True, cwd=REPO,
        timeout=300,
    )

    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.splitlines()[0] == f"Using GitLab's config files in {tmp_path} (CI_CLEANUP_GITLAB_CONFIG_DIR)"
    assert "drop_canceling_builds                    ok     rows_changed=120" in done.stdout
    with engine.connect() as conn:  # the demo's 120 outdated canceling builds, dropped in the files' database
        assert conn.scalar(text("SELECT count(*) FROM p_ci_builds WHERE failure_reason = 3")) == 120


@pytest.fixture
def password_user(stack):
    """A user ``ci_cleanup_auth`` whose password is ``right``, in the stack's PostgreSQL (scram-sha-256 for that user
    alone: every other user is still trusted) and its Redis (an ACL user); removed after."""
    name = "ci_cleanup_auth"
    admin = create_engine(stack.url("postgres"), isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        hba = Path(conn.scalar(text("SHOW hba_file")))
        original = hba.read_text()
        hba.write_text(f"local all {name} scram-sha-256\n{original}")
        conn.execute(text(f"CREATE ROLE {name} LOGIN PASSWORD 'right'"))
        conn.execute(text("SELECT pg_reload_conf()"))
    client = redis.Redis.from_url(stack.redis_url)
    client.acl_setuser(name, enabled=True, passwords=["+right"], keys=["*"], commands=["+@all"])
    try:
        yield name
    finally:
        client.acl_deluser(name)
        client.close()
        with admin.connect() as conn:
            hba.write_text(original)
            conn.execute(text("SELECT pg_reload_conf()"))
            conn.execute(text(f"DROP ROLE {name}"))
        admin.dispose()


def test_a_wrong_password_is_reported_as_failed_authentication_not_as_a_server_down(
    servers_dir, stack, password_user, cli_here
):
    wrong_pg = make_url(stack.url()).set(username=password_user, password="wrong").render_as_string(False)
    wrong_redis = stack.redis_url.replace("unix://", f"unix://{password_user}:wrong@")
    hint = ("  The server is up and refused the user or password: check them in the URL named above "
            "(ci-cleanup --debug … shows the traceback)")

    database = cli_here("run", "stuck_export_jobs", data_dir=servers_dir / "auth",
                        CI_CLEANUP_DATABASE_URL=wrong_pg, CI_CLEANUP_REDIS_URL=stack.redis_url)
    redis_ = cli_here("run", "stuck_export_jobs", data_dir=servers_dir / "auth",
                      CI_CLEANUP_DATABASE_URL=stack.url(), CI_CLEANUP_REDIS_URL=wrong_redis)

    assert database.returncode == 1 and database.stderr.splitlines()[1:] == [hint]
    first = database.stderr.splitlines()[0]
    assert first.startswith(f"ci-cleanup run: Authentication failed for the GitLab database (PostgreSQL) at "
                            f"postgresql+psycopg2://{password_user}:***@/gitlab?host="), first
    assert first.endswith(f'password authentication failed for user "{password_user}"'), first
    assert redis_.returncode == 1 and redis_.stderr.splitlines()[1:] == [hint]
    assert redis_.stderr.splitlines()[0].startswith(
        "ci-cleanup run: Authentication failed for Redis (CI_CLEANUP_REDIS_URL) at unix://"), redis_.stderr
    assert "invalid username-password pair" in redis_.stderr
    assert "wrong" not in database.stderr + redis_.stderr + database.stdout + redis_.stdout
    no_role = cli_here("run", "stuck_export_jobs", data_dir=servers_dir / "auth", CI_CLEANUP_REDIS_URL=stack.redis_url,
                       CI_CLEANUP_DATABASE_URL=make_url(stack.url()).set(username="no_such_role").render_as_string())
    assert no_role.returncode == 1 and no_role.stderr.splitlines()[1:] == [hint]
    assert no_role.stderr.splitlines()[0].startswith("ci-cleanup run: Authentication failed for the GitLab database")
    assert no_role.stderr.splitlines()[0].endswith('role "no_such_role" does not exist'), no_role.stderr

    # The same through the resources, as a scheduled run starts them.
    for url, redis_url, what in ((wrong_pg, stack.redis_url, "the GitLab database (PostgreSQL)"),
                                 (stack.url(), wrong_redis, "Redis")):
        result = stuck_export_jobs.execute_in_process(
            resources=job_resources(url, redis_url), raise_on_error=False, instance=DagsterInstance.ephemeral())
        assert not result.success
        assert f"Authentication failed for {what}" in failure_messages(result), failure_messages(result)


def test_seed_into_a_database_of_the_embedded_stack_seeds_that_one_and_again_replaces_its_rows(servers_dir):
    data_dir = servers_dir / "seed_embedded"

    first = cli("seed", "--into", "gitlab_dev", data_dir=data_dir)
    again = cli("seed", "--into", "gitlab_dev", data_dir=data_dir)

    assert first.returncode == 0 and again.returncode == 0, first.stderr + again.stderr
    assert "into postgresql+psycopg2://postgres@/gitlab_dev?host=" in first.stdout
    assert again.stdout.splitlines()[-2:] == [
        "Seeded the demo GitLab dataset (the rows of the earlier seed replaced)",
        "  ci-cleanup dev (make dev) uses gitlab, not gitlab_dev: to run the jobs on gitlab_dev, set "
        "CI_CLEANUP_DATABASE_URL to the URL above"]
    with EmbeddedStack(data_dir) as stack:
        assert count(stack.url("gitlab_dev"), "p_ci_builds") == 220
        assert count(stack.url(), "p_ci_builds") == 0  # dev's own database, which --into did not name
    assert servers_of(data_dir) == []


def test_a_run_prints_what_it_acts_on_before_it_changes_anything(servers_dir, stack, engine, redis_client):
    password = make_url(stack.url()).set(password="s3cr3t-pw").render_as_string(False)  # trusted: any password
    redis_url = stack.redis_url.replace("unix://", "unix://:s3cr3t-pw@")
    redis_client.config_set("requirepass", "s3cr3t-pw")
    try:
        done = cli("run", "stale_runner_machines_cleanup", data_dir=servers_dir / "targets",
                   CI_CLEANUP_DATABASE_URL=password, CI_CLEANUP_REDIS_URL=redis_url)
    finally:
        redis.Redis.from_url(redis_url).config_set("requirepass", "")

    assert done.returncode == 0, done.stdout + done.stderr
    socket_dir = make_url(stack.url()).query["host"]
    assert done.stdout.splitlines()[:5] == [
        "stale_runner_machines_cleanup acts on:",
        f"  main database    postgresql+psycopg2://postgres:***@/gitlab?host={socket_dir}",
        f"  Redis            Redis (CI_CLEANUP_REDIS_URL) at unix://***@{stack.redis_url.removeprefix('unix://')} "
        "(leases, artifact buckets, sidekiq status)",
        "",
        "stale_runner_machines_cleanup            ok     rows_changed=0",
    ]
    assert "s3cr3t-pw" not in done.stdout + done.stderr


NO_GITLAB = [
    "ci-cleanup run: No GitLab to run on: none of CI_CLEANUP_GITLAB_CONFIG_DIR, CI_CLEANUP_DATABASE_URL and "
    "CI_CLEANUP_REDIS_URL is set",
    "  Set CI_CLEANUP_GITLAB_CONFIG_DIR to GitLab's config folder (or the two URLs); to try the job on the embedded "
    "stack instead: ci-cleanup run --embedded …",
]


def test_run_with_no_gitlab_configured_refuses_and_starts_no_embedded_stack(servers_dir, tmp_path, cli_here):
    """A cron line, or a sudo that dropped the environment: never a green run on a stack GitLab does not read."""
    here = cli_here("run", "drop_canceling_builds", data_dir=servers_dir / "no_gitlab")
    elsewhere = subprocess.run(  # from another folder, with the default data folder
        [BIN / "ci-cleanup", "run", "drop_canceling_builds", "--dry-run"], env=clean_env(
            CI_CLEANUP_DEV_DIR=str(tmp_path / "dev")), cwd=tmp_path, capture_output=True, text=True, timeout=120)

    for refused in (here, elsewhere):
        assert (refused.returncode, refused.stdout, refused.stderr.splitlines()) == (1, "", NO_GITLAB)
    assert not (servers_dir / "no_gitlab").exists() and list(tmp_path.iterdir()) == []


def test_run_on_the_embedded_stack_when_asked_and_it_says_so(servers_dir):
    """And never on what the variables name, not even GitLab's ci database, which the run's resources would
    otherwise read from its variable."""
    data_dir = servers_dir / "run_embedded"
    nowhere = "postgresql+psycopg2://gitlab@/gitlabhq_production?host=/nonexistent"

    done = cli("run", "--embedded", "stale_runner_machines_cleanup", data_dir=data_dir,
               CI_CLEANUP_DATABASE_URL=nowhere, CI_CLEANUP_CI_DATABASE_URL=nowhere)

    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    assert lines[:2] == [
        "The run never uses CI_CLEANUP_CI_DATABASE_URL / CI_CLEANUP_DATABASE_URL: it runs on the embedded stack",
        f"Embedded stack (PostgreSQL and Redis) in {data_dir.resolve()}"]
    assert "  main database    postgresql+psycopg2://postgres@/gitlab?host=" in "\n".join(lines)
    redis_line = next(line for line in lines if line.startswith("  Redis"))
    assert redis_line.startswith("  Redis            the embedded Redis at unix://"), redis_line  # no variable
    assert "stale_runner_machines_cleanup            ok     rows_changed=0" in lines
    assert servers_of(data_dir) == []


def test_a_run_lists_every_refused_row_with_its_reason_and_exits_3(stack, engine, redis_client, tmp_path):
    from .factories import ago, create

    root = tmp_path / "artifacts"
    (root / "ab").mkdir(parents=True)
    (root / "ab" / "a.zip").write_bytes(b"zip")
    done_row = create(engine, "ci_deleted_objects", store_dir="ab", file="a.zip", file_store=1, project_id=1,
                      pick_up_at=ago(hours=2))
    refused = [create(engine, "ci_deleted_objects", store_dir=f"../x{i}", file="a.zip", file_store=1, project_id=1,
                      pick_up_at=ago(hours=1)) for i in range(25)]

    done = cli("run", "delete_expired_artifact_files", data_dir=tmp_path / "unused",
               CI_CLEANUP_ARTIFACTS_ROOT=str(root), CI_CLEANUP_DATABASE_URL=stack.url(),
               CI_CLEANUP_REDIS_URL=stack.redis_url)

    assert done.returncode == 3, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    start = lines.index("    refused: 25")
    assert lines[start + 1:start + 22] == [
        *(f"      row {row_id}: store_dir '../x{i}' leaves the artifacts root"
          for i, row_id in enumerate(refused[:20])),
        "      and 5 more (the job's Dagster run lists the first 1000 in its metadata, its log names each)",
    ]
    assert "    rows_with_errors: 25" in lines and "    files_removed: 1" in lines
    assert done.stderr == ("The run finished but left 25 rows it could not process (listed above): exit status 3\n")
    with engine.connect() as conn:
        left = conn.scalars(text("SELECT id FROM ci_deleted_objects ORDER BY id")).all()
    assert done_row not in left and left == refused


def test_a_run_skipped_on_a_lease_without_ttl_names_the_key_and_that_it_never_expires(
        stack, engine, redis_client, tmp_path):
    from ci_cleanup.drop_canceling_builds.job import LEASE_KEY
    from ci_cleanup.gitlab.exclusive_lease import PREFIX

    redis_client.set(PREFIX + LEASE_KEY, "someone-by-hand")  # no EX
    try:
        done = cli("run", "drop_canceling_builds", data_dir=tmp_path / "unused",
                   CI_CLEANUP_DATABASE_URL=stack.url(), CI_CLEANUP_REDIS_URL=stack.redis_url)
    finally:
        redis_client.delete(PREFIX + LEASE_KEY)

    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    assert "    status: skipped: lease held" in lines
    assert lines[lines.index(f"    lease: {PREFIX}{LEASE_KEY}"):][:2] == [
        f"    lease: {PREFIX}{LEASE_KEY}",
        "    lease_ttl_seconds: -1: no TTL, it never expires and every run skips; delete the key once no GitLab "
        "process holds it",
    ]


def test_a_wrong_password_for_dagsters_own_database_is_one_line_at_once_without_retries(stack, password_user,
                                                                                         tmp_path):
    """dagster-postgres retries a refused login six times, warning each time, then says to check the server is up."""
    import shutil

    shutil.copy(DAGSTER_YAML, tmp_path / "dagster.yaml")
    wrong = make_url(stack.url("dagster")).set(username=password_user, password="wrong").render_as_string(False)

    done = subprocess.run([BIN / "dagster", "job", "list", "-m", "ci_cleanup"], capture_output=True, text=True,
                          env=clean_env(DAGSTER_HOME=str(tmp_path), CI_CLEANUP_DAGSTER_PG_URL=wrong), timeout=300)

    assert done.returncode == 1
    [line] = [line for line in (done.stdout + done.stderr).splitlines() if line.strip()]
    assert line.startswith("ci_cleanup: the Dagster instance (DAGSTER_HOME's dagster.yaml) cannot load: Authentication "
                           f"failed for the Dagster instance's PostgreSQL at postgresql+psycopg2://{password_user}:***@"
                           ), line
    assert line.endswith(f'password authentication failed for user "{password_user}": check the user and password in '
                         "CI_CLEANUP_DAGSTER_PG_URL"), line
