"""The public contract (job and schedule names, crons in UTC) and the ways a user starts things: the dagster CLI,
ci-cleanup demo (ci-cleanup dev: test_web_ui, on the stack its UI tests use)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import redis
from dagster import DagsterInstance
from sqlalchemy import create_engine, inspect, text

from ci_cleanup import defs
from ci_cleanup.batches import BATCHES
from ci_cleanup_dev.demo import seed

from .harness import clean_env, servers_of

BIN = Path(sys.executable).parent
REPO_ROOT = Path(__file__).resolve().parents[1]
# The schedules the product contract names, with their crons; the registry may add others.
SCHEDULES = {
    "drop_canceling_builds_schedule": ("drop_canceling_builds", "45 * * * *"),
    "stale_runner_machines_cleanup_schedule": ("stale_runner_machines_cleanup", "36 * * * *"),
    "stuck_export_jobs_schedule": ("stuck_export_jobs", "30 * * * *"),
    "environments_auto_stop_schedule": ("environments_auto_stop", "24 * * * *"),
    "schedule_bulk_delete_job_artifacts_schedule": ("schedule_bulk_delete_job_artifacts", "*/7 * * * *"),
    "prune_dagster_history_schedule": ("prune_dagster_history", "13 4 * * *"),
}
# Per job, a fingerprint of the rows it works on: a run over the demo dataset must change it.
# prune_dagster_history works on the Dagster instance, not GitLab: test_prune_dagster_history runs it from the CLI.
WORK = {
    "drop_canceling_builds": "SELECT md5(string_agg(status || id, ',' ORDER BY id)) FROM p_ci_builds",
    "stale_runner_machines_cleanup": "SELECT count(*) FROM ci_runner_machines",
    "stuck_export_jobs": "SELECT md5(string_agg(status || '-' || id, ',' ORDER BY id)) FROM project_export_jobs",
    "environments_auto_stop": "SELECT md5(string_agg(state || id, ',' ORDER BY id)) FROM environments",
    "schedule_bulk_delete_job_artifacts": "SELECT count(*) FROM p_ci_job_artifacts",
    "delete_expired_artifact_files": "SELECT count(*) FROM ci_deleted_objects",
}


def test_every_schedule_of_the_contract_runs_its_job_on_its_cron_in_utc():
    schedules = {s.name: s for s in defs.schedules}
    assert set(SCHEDULES) <= set(schedules)
    for name, (job_name, cron) in SCHEDULES.items():
        assert (schedules[name].job_name, schedules[name].cron_schedule, schedules[name].execution_timezone) == (
            job_name, cron, "UTC"
        )


def test_every_registered_batch_is_in_the_code_location_with_its_schedule_in_utc():
    assert [job.name for job in defs.jobs] == [batch.name for batch in BATCHES]
    schedules = {s.name: s for s in defs.schedules}
    assert set(schedules) == {f"{batch.name}_schedule" for batch in BATCHES}
    for batch in BATCHES:
        schedule = schedules[f"{batch.name}_schedule"]
        assert (schedule.job_name, schedule.execution_timezone) == (batch.name, "UTC")
        assert batch.report_op in batch.job.graph.node_dict


def test_definitions_validate(tmp_path):
    done = subprocess.run(
        [BIN / "dagster", "definitions", "validate", "-m", "ci_cleanup"],
        env=clean_env(DAGSTER_HOME=str(tmp_path)), capture_output=True, text=True, cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Validation successful" in done.stdout + done.stderr


# Through `dagster job execute`: the job README shows, and the one that also reads CI_CLEANUP_ARTIFACTS_ROOT. Every
# job runs in this process too, on the code location's own definitions and the same variables alone (a Dagster
# process is a few CPU-seconds; what loads the module and reads the variables is the same for every job).
THROUGH_THE_CLI = ("drop_canceling_builds", "delete_expired_artifact_files")


@pytest.mark.parametrize("job_name", sorted(WORK))
def test_dagster_job_execute_works_with_only_the_two_env_vars(
    stack, engine, redis_client, tmp_path, monkeypatch, job_name
):
    seed(engine, redis_client)
    with engine.connect() as conn:
        before = conn.scalar(text(WORK[job_name]))
    env = clean_env(
        CI_CLEANUP_DATABASE_URL=stack.url(), CI_CLEANUP_REDIS_URL=stack.redis_url,
        CI_CLEANUP_ARTIFACTS_ROOT=str(tmp_path),  # read by delete_expired_artifact_files only
    )

    if job_name in THROUGH_THE_CLI:
        done = subprocess.run(
            [BIN / "dagster", "job", "execute", "-m", "ci_cleanup", "-j", job_name],
            env=env, capture_output=True, text=True, cwd=tmp_path, timeout=300,
        )
        assert done.returncode == 0, done.stderr[-3000:]
        assert "RUN_SUCCESS" in done.stderr
    else:
        for name in set(os.environ) - set(env):
            monkeypatch.delenv(name)
        for name, value in env.items():
            monkeypatch.setenv(name, value)
        monkeypatch.chdir(tmp_path)
        result = defs.resolve_job_def(job_name).execute_in_process(instance=DagsterInstance.ephemeral())
        assert result.success
    with engine.connect() as conn:
        assert conn.scalar(text(WORK[job_name])) != before


LAUNCHES = [
    ["dagster", "job", "execute", "-m", "ci_cleanup", "-j", "drop_canceling_builds"],
    ["dg", "launch", "--job", "drop_canceling_builds"],
]
NO_DATABASE = ("No GitLab database: set CI_CLEANUP_DATABASE_URL (and CI_CLEANUP_CI_DATABASE_URL when GitLab is "
               "decomposed), or CI_CLEANUP_GITLAB_CONFIG_DIR to GitLab's config folder (database.yml)")
NO_REDIS = ("No Redis for GitLab's cluster_shared_state store: none of CI_CLEANUP_REDIS_CLUSTER_SHARED_STATE_URL, "
            "CI_CLEANUP_REDIS_SHARED_STATE_URL, CI_CLEANUP_REDIS_URL is set, and CI_CLEANUP_GITLAB_CONFIG_DIR is not "
            "set")
RAW_AT = ("CI_CLEANUP_DATABASE_URL has a raw '@' or ':' in its password (or cannot be parsed): percent-encode the "
          "password ('@' as %40, ':' as %3A, '/' as %2F)")


def _launch_fails_in_one_line(launch: list[str], error: str, **env: str) -> None:
    """The launch fails with ``error`` on one line, and no stack trace."""
    done = subprocess.run(
        [BIN / launch[0], *launch[1:]], env=clean_env(**env), capture_output=True, text=True, cwd=REPO_ROOT,
        timeout=300,
    )

    output = done.stdout + done.stderr
    assert done.returncode == 1, output[-3000:]
    assert [line for line in output.splitlines() if error.split(":")[0] in line] == [error], output[-3000:]
    assert "Traceback" not in output and "Stack Trace" not in output and 'File "' not in output, output[-3000:]
    assert "SupersessionWarning" not in output


@pytest.mark.parametrize("launch", LAUNCHES)
def test_a_launch_in_the_repo_root_with_nothing_configured_names_every_variable_to_set_in_one_line(launch):
    _launch_fails_in_one_line(launch, f"ci_cleanup.resources.NotConfigured: {NO_DATABASE}; {NO_REDIS}")


def test_a_launch_with_only_redis_configured_names_the_database_alone(stack):
    _launch_fails_in_one_line(LAUNCHES[0], f"ci_cleanup.resources.NotConfigured: {NO_DATABASE}",
                              CI_CLEANUP_REDIS_URL=stack.redis_url)


def test_a_launch_with_a_raw_at_sign_in_the_password_fails_in_one_line_naming_the_variable(stack):
    _launch_fails_in_one_line(LAUNCHES[0], f"ci_cleanup.resources.ServiceUnavailable: {RAW_AT}",
                              CI_CLEANUP_DATABASE_URL="postgresql://gitlab:p@ss@localhost/gitlabhq_production",
                              CI_CLEANUP_REDIS_URL=stack.redis_url)


def test_a_launch_on_a_gitlab_config_folder_without_database_yml_fails_in_one_line_naming_the_file(stack, tmp_path):
    """A host where GitLab's files are not where CI_CLEANUP_GITLAB_CONFIG_DIR says (a source install, a typo)."""
    _launch_fails_in_one_line(LAUNCHES[0], f"ci_cleanup.resources.UnusableSetting: {tmp_path}/database.yml: does not "
                              "exist", CI_CLEANUP_GITLAB_CONFIG_DIR=str(tmp_path), CI_CLEANUP_REDIS_URL=stack.redis_url)


def _demo(data_dir, *args: str, **env) -> subprocess.CompletedProcess:
    done = subprocess.run(
        [BIN / "ci-cleanup", "--data-dir", str(data_dir), "demo", *args],
        env=clean_env(**env), capture_output=True, text=True, timeout=600,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert servers_of(data_dir) == []
    return done


def _counts(demo: subprocess.CompletedProcess) -> list[str]:
    """What a demo printed after seeding, but the one clock reading (prune's oldest_kept: its first run's end)."""
    lines = demo.stdout.splitlines()
    return [line for line in lines[lines.index("Seeded the demo GitLab dataset"):] if "oldest_kept" not in line]


def test_demo_runs_every_job_in_data_flow_order_on_the_embedded_stack_and_reports_the_same_every_time(
    servers_dir, stack, scratch_database,
):
    data_dir = servers_dir / "demo"
    # An operator's exported production variables: the demo must not touch what they point at.
    configured = dict(CI_CLEANUP_DATABASE_URL=scratch_database, CI_CLEANUP_REDIS_URL=f"{stack.redis_url}?db=7")
    configured_redis = redis.Redis.from_url(configured["CI_CLEANUP_REDIS_URL"])
    configured_redis.flushdb()

    # No login session (no XDG_RUNTIME_DIR), as on a fresh server: the demo leaves nothing in the temporary folder.
    temp = servers_dir / "demo_tmp"
    temp.mkdir()
    first = _demo(data_dir, TMPDIR=str(temp), XDG_RUNTIME_DIR="", **configured)
    assert list(temp.iterdir()) == []
    dry = _demo(data_dir, "--dry-run", **configured)
    again = _demo(data_dir, **configured)  # on the data the first one and the dry run left

    assert _counts(again) == _counts(first)
    ran = [line.split()[0] for line in first.stdout.splitlines() if line.split()[1:2] == ["ok"]]
    assert ran == [batch.name for batch in BATCHES]  # schedule_bulk_… queues the files delete_expired_… removes
    assert "drop_canceling_builds                    ok     rows_changed=120" in first.stdout
    removed = [int(line.split(": ")[1]) for line in first.stdout.splitlines() if line.startswith("    files_removed:")]
    assert removed[0] > 0
    assert "    size: 693.4 MiB" in first.stdout  # the deleted artifacts' bytes
    assert "    limit_reached: none" in first.stdout and "    max_deletions_reached: false" in first.stdout
    assert "%2F" not in first.stdout  # the socket folder as a path
    assert "The demo never uses CI_CLEANUP_DATABASE_URL / CI_CLEANUP_REDIS_URL" in first.stdout
    assert "XDG_RUNTIME_DIR" not in first.stderr and "Traceback" not in first.stderr
    # Sizes read as the README promises: no size anywhere as a bare count of bytes.
    assert re.search(r"size[:=] ?\d+(,|;|$)", first.stdout, re.M) is None
    # Where Redis is, said once by the seed's line: not under each run, cut mid-path, naming a variable it ignores.
    assert "redis_" not in first.stdout and "(CI_CLEANUP_REDIS_URL)" not in first.stdout

    would = {  # what each job would change in the same seed's rows
        "drop_canceling_builds": "would_drop_count: 120",
        "stale_runner_machines_cleanup": "would_delete_count: 130",
        "stuck_export_jobs": "would_fail_count: 30",
        "environments_auto_stop": "would_stop_count: 110",
        "schedule_bulk_delete_job_artifacts": "would_delete_by_bucket: mod_bucket=0, count=",
    }
    printed: dict[str, list[str]] = {}  # job -> the lines under its "<job> ok rows_changed=0" line
    for line in dry.stdout.splitlines():
        if line.endswith(" ok     rows_changed=0"):
            job = printed.setdefault(line.split()[0], [])
        elif line.startswith("    ") and printed:
            job.append(line.strip())
    for name, line in would.items():
        assert any(shown.startswith(line) for shown in printed[name]), (name, printed[name])
    assert "TableMetadataValue" not in dry.stdout
    assert any(line.startswith("would_remove_files: ") for line in printed["delete_expired_artifact_files"])
    assert servers_of(data_dir) == []
    engine = create_engine(scratch_database)
    assert inspect(engine).get_table_names() == []
    engine.dispose()
    assert configured_redis.dbsize() == 0
    configured_redis.close()


def test_dry_run_from_the_cli_changes_nothing(stack, engine, redis_client, tmp_path):
    seed(engine, redis_client)
    with engine.connect() as conn:
        before = conn.scalar(text(WORK["drop_canceling_builds"]))
    (tmp_path / "dry.yaml").write_text("resources: {run_options: {config: {dry_run: true}}}\n")

    done = subprocess.run(
        [BIN / "dagster", "job", "execute", "-m", "ci_cleanup", "-j", "drop_canceling_builds", "-c", "dry.yaml"],
        env=clean_env(CI_CLEANUP_DATABASE_URL=stack.url(), CI_CLEANUP_REDIS_URL=stack.redis_url),
        capture_output=True, text=True, cwd=tmp_path, timeout=300,
    )

    assert done.returncode == 0, done.stderr[-3000:]
    assert "RUN_SUCCESS" in done.stderr and "Dry run: finding what would change" in done.stderr
    # What would change, in the run's log on the console: an ephemeral instance leaves no UI to look in.
    [shown] = [line for line in done.stderr.splitlines() if "Dry run, nothing changed" in line]
    assert " - INFO - " in shown and shown.endswith(" - report_dropped_builds - Dry run, nothing changed: "
                                                   "would_drop_count 120"), shown
    with engine.connect() as conn:
        assert conn.scalar(text(WORK["drop_canceling_builds"])) == before
    assert redis_client.keys("gitlab:exclusive_lease:*") == []


def test_an_out_of_range_setting_through_dagsters_cli_is_one_line_and_changes_nothing(
        stack, engine, redis_client, tmp_path):
    """Dagster's config schema has no bounds, so the run starts and its first op refuses batch_size 0 in one line.
    With the jobs' console logger named in the run config (docs/configuration.md) the run's log is five lines;
    Dagster's default console prints the same line, with no stack trace."""
    seed(engine, redis_client)
    with engine.connect() as conn:
        before = conn.scalar(text(WORK["drop_canceling_builds"]))
    bad = "ops: {find_canceling_builds: {config: {batch_size: 0}}}\n"
    (tmp_path / "bad.yaml").write_text(bad)
    (tmp_path / "short.yaml").write_text(bad + "loggers: {console: {config: {log_level: INFO}}}\n")
    env = clean_env(CI_CLEANUP_DATABASE_URL=stack.url(), CI_CLEANUP_REDIS_URL=stack.redis_url)
    runs = {name: subprocess.run(
        [BIN / "dagster", "job", "execute", "-m", "ci_cleanup", "-j", "drop_canceling_builds", "-c", f"{name}.yaml"],
        env=env, capture_output=True, text=True, cwd=tmp_path, timeout=300) for name in ("bad", "short")}

    cause = "ValueError: batch_size must be at least 1, not 0"
    short = runs["short"].stderr.splitlines()
    assert runs["short"].returncode == 1 and len(short) == 5, short
    assert short[0].endswith(f' - find_canceling_builds - STEP_FAILURE - Execution of step "find_canceling_builds" '
                             f"failed. {cause}"), short[0]
    assert short[3].endswith(f"Steps failed: ['find_canceling_builds']. {cause}")
    assert runs["bad"].returncode == 1 and cause in runs["bad"].stderr.splitlines()
    assert "Stack Trace" not in runs["bad"].stderr and "Traceback" not in runs["bad"].stderr
    with engine.connect() as conn:
        assert conn.scalar(text(WORK["drop_canceling_builds"])) == before


def test_a_run_is_re_executed_whole_never_from_a_later_step(stack, engine, redis_client, tmp_path, monkeypatch):
    """The outputs stay in the run's process: re-executing from the act step, which would act without the lease
    the first op took, is refused before any step runs; the whole run re-executes and does its work."""
    from dagster import ReexecutionOptions, execute_job
    from dagster._core.definitions.reconstruct import ReconstructableRepository

    for name, value in {"CI_CLEANUP_DATABASE_URL": stack.url(), "CI_CLEANUP_REDIS_URL": stack.redis_url}.items():
        monkeypatch.setenv(name, value)
    job = ReconstructableRepository.for_module("ci_cleanup", "defs", str(REPO_ROOT)).get_reconstructable_job(
        "drop_canceling_builds")
    with DagsterInstance.local_temp(str(tmp_path)) as instance:
        parent = execute_job(job, instance)
        assert parent.success
        seed(engine, redis_client)
        with engine.connect() as conn:
            before = conn.scalar(text(WORK["drop_canceling_builds"]))
        later = ReexecutionOptions(parent.run_id, step_selection=["drop_canceling_builds_in_batches"])
        refused = execute_job(job, instance, reexecution_options=later, raise_on_error=False)
        assert not refused.success
        assert "Cannot perform reexecution with in-memory io managers" in str(refused.get_run_failure_event())
        assert [e.step_key for e in refused.all_events if e.event_type_value == "STEP_START"] == []
        with engine.connect() as conn:
            assert conn.scalar(text(WORK["drop_canceling_builds"])) == before
        whole = execute_job(job, instance, reexecution_options=ReexecutionOptions(parent.run_id))
        assert whole.success
        with engine.connect() as conn:
            assert conn.scalar(text(WORK["drop_canceling_builds"])) != before


def test_a_launched_runs_batches_are_collected_without_dagsters_objects_and_it_exits_without_a_last_collection(
        stack, tmp_path):
    """``gc.freeze()`` when the first op starts and at exit (batch.freeze_startup_objects): the collections during
    the batches walk only the run's own objects, and the process skips the interpreter's last ones (~0.6 s); every
    event of the run written before. An exit handler registered before Dagster starts runs after every other one."""
    probe = ("import atexit, gc, sys\n"
             "seen = []\n"
             "gc.callbacks.append(lambda phase, info: phase == 'start' and seen.append(gc.get_freeze_count()))\n"
             "atexit.register(lambda: print('collections with objects frozen:', sum(1 for n in seen if n)))\n"
             "atexit.register(lambda: print('frozen at exit:', gc.get_freeze_count() > 0))\n"
             "from dagster._cli import main\n"
             "sys.argv = ['dagster', 'job', 'execute', '-m', 'ci_cleanup', '-j', 'stale_runner_machines_cleanup']\n"
             "main()\n")
    done = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, cwd=tmp_path, timeout=300,
        env=clean_env(CI_CLEANUP_DATABASE_URL=stack.url(), CI_CLEANUP_REDIS_URL=stack.redis_url),
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "RUN_SUCCESS" in done.stderr
    *_, at_exit, during = done.stdout.strip().splitlines()  # exit handlers run last registered first
    assert at_exit == "frozen at exit: True"
    assert int(during.rsplit(" ", 1)[1]) > 5  # while the run's events and the batch's objects were made
