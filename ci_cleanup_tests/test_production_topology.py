"""The production instance (deploy/dagster.yaml) and the repo root's dagster.yaml, which is it without storage."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from dagster import DagsterInstance
from dagster._core.instance.ref import InstanceRef

from ci_cleanup.devstack import DAGSTER_YAML, REPO_ROOT

from .harness import clean_env

BIN = Path(sys.executable).parent
DEPLOY = REPO_ROOT / "deploy"


def yaml_of(path: Path) -> dict:
    return yaml.safe_load(path.read_text())


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
