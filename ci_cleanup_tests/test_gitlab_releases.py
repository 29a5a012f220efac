"""Every job on GitLab's schema at each release vendored (``tools/ci_cleanup_dev/ddl/versions/``), one database each.

Each test seeds a few rows, some the job's rule must change and some it must not, with only the columns that release
has, runs the job through Dagster and asserts the exact rows after: each job does that release's GitLab's work
(``docs/gitlab-releases.md``). A GitLab older than 16.0 is refused untouched.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import hashlib
import itertools
import os
import re
import shutil
import signal
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from sqlalchemy import create_engine, make_url, text
from sqlalchemy.engine import Engine

from ci_cleanup.cli import main
from ci_cleanup.drop_canceling_builds import uses as drop_uses
from ci_cleanup.drop_canceling_builds.job import drop_canceling_builds
from ci_cleanup.environments_auto_stop import uses as environments_uses
from ci_cleanup.environments_auto_stop.job import environments_auto_stop
from ci_cleanup.gitlab.release import KNOWN, RELEASE_TABLES, Release, detect_release, read_catalog
from ci_cleanup.gitlab.schema import (
    CI_DATABASE,
    MAIN_DATABASE,
    GitLabSchema,
    SchemaMismatch,
    WherePresent,
    database_of,
    detect_tables,
    require_columns,
    where_present,
)
from ci_cleanup.gitlab.sidekiq_status import status_key
from ci_cleanup.schedule_bulk_delete_job_artifacts import uses as artifacts_uses
from ci_cleanup.schedule_bulk_delete_job_artifacts.files_job import delete_expired_artifact_files
from ci_cleanup.schedule_bulk_delete_job_artifacts.job import schedule_bulk_delete_job_artifacts
from ci_cleanup.stale_runner_machines_cleanup import uses as runner_uses
from ci_cleanup.stale_runner_machines_cleanup.job import stale_runner_machines_cleanup
from ci_cleanup.stuck_export_jobs import uses as export_uses
from ci_cleanup.stuck_export_jobs.job import stuck_export_jobs
from ci_cleanup_dev.ddl import create_schema, ddl, lock_writes, truncate_all
from ci_cleanup_dev.devstack import PgBouncer
from ci_cleanup_dev.project_rows import add_projects

from .factories import ago, naive_ago
from .harness import scratch_database_of
from .runner import op_metadata, run_job, step_failure_message

# A 17.0 as the issue met it (not vendored): 17.x's schema without what 17.0 lacked, its runner machines 16.0's
# plain table (GitLab partitioned them by runner_type later in 17.x). It keeps what 17.0's migrations added, e.g.
# ci_running_builds.runner_owner_namespace_xid, by which the jobs know 17.0's Environment#stop_actions.
GITLAB_17_0 = "17.0-like"
LAYOUTS = {"16.0": "flat", GITLAB_17_0: "partitioned", "17.x": "partitioned", "18.x": "partitioned",
           "18.y": "partitioned_dynamic", "19.x": "partitioned_dynamic"}
NEWEST = "19.x"
_17_0_LACKS = ("runner_machines_runner_type", "runner_machines_sharding_key_id", "environments_auto_stop_setting",
               "deleted_objects_project_id", "deleted_objects_created_at", "relation_exports_project_id", "build_tags")
EXPECTED = {**KNOWN, GITLAB_17_0: Release("partitioned", True, True, False,
                                          {name: name not in _17_0_LACKS for name in KNOWN["17.x"].features})}

# (job, release) -> what its statements lack there: the case asserts GitLab's outcome and fails until they have it.
@dataclass(frozen=True)
class ReleaseDb:
    """A release's database(s): one, or (``19.x-deployed``) main and ci, reached by the jobs through PgBouncer."""

    name: str
    stack: object  # the embedded stack: its Redis
    url: str
    engine: Engine
    schema: GitLabSchema
    release: Release
    ci_url: str | None = None
    ci_engine: Engine | None = None

    @property
    def base(self) -> str:
        """The vendored release this one is (the deployed newest is 19.x)."""
        return self.name.removesuffix(DEPLOYED)

    def has(self, feature: str) -> bool:
        return self.release.features[feature]

    def engine_of(self, table: str) -> Engine:
        """The engine holding ``table``'s rows (the database's name for it)."""
        ci = database_of(self.schema.metadata.tables[table]) == CI_DATABASE
        return self.ci_engine if ci and self.ci_engine is not None else self.engine

    def insert(self, table: str, **values) -> int:
        """One row of ``table`` (GitLabSchema's name) with only these columns; its id."""
        name, columns = getattr(self.schema, table).name, ", ".join(f'"{column}"' for column in values)
        with self.engine_of(name).begin() as conn:
            return conn.scalar(text(
                f'INSERT INTO {name} ({columns}) VALUES ({", ".join(f":{column}" for column in values)}) RETURNING id'),
                values)

    def rows(self, sql: str) -> list[tuple]:
        """``sql``'s rows, read in the database of the table it reads (its ``FROM``)."""
        sql = sql.format(builds=self.schema.ci_builds.name, artifacts=self.schema.ci_job_artifacts.name)
        with self.engine_of(re.search(r"FROM (\w+)", sql).group(1)).connect() as conn:
            return [tuple(row) for row in conn.execute(text(sql))]

    def run(self, job, **kwargs):
        return run_job(job, self.stack, database_url=self.url, ci_database_url=self.ci_url, **kwargs)

    def empty(self) -> None:
        for database, engine in ((MAIN_DATABASE, self.engine), (CI_DATABASE, self.ci_engine)):
            if engine is not None:
                with engine.begin() as conn:
                    truncate_all(conn, self.schema, database=database if self.ci_engine else None)


def gitlab_17_0(engine: Engine) -> None:
    create_schema(engine, release="17.x")
    plain_machines = [s for s in ddl(release="16.0") if "ci_runner_machines" in s]
    taggings = [s for s in ddl(release="16.0") if "taggings" in s]  # p_ci_build_tags came in 17.3
    with engine.begin() as conn:
        conn.execute(text(
            "ALTER TABLE environments DROP COLUMN auto_stop_setting;"
            "ALTER TABLE ci_deleted_objects DROP COLUMN project_id, DROP COLUMN created_at;"
            "DROP TRIGGER trigger_b2612138515d ON project_relation_exports;"
            "ALTER TABLE project_relation_exports DROP COLUMN project_id;"
            "DROP TABLE ci_runner_machines, ci_runner_machines_archived, p_ci_build_tags CASCADE"))
        for statement in plain_machines + taggings:
            conn.execute(text(statement))


DEPLOYED = "-deployed"


def _detected(engine: Engine, ci_engine: Engine | None = None) -> tuple[GitLabSchema, Release]:
    """The schema and the release, each table's facts read in the database that holds its rows."""
    with (ci_engine or engine).connect() as conn:
        schema = detect_tables(conn)
    facts = []
    for database, own in ((MAIN_DATABASE, engine), (CI_DATABASE, ci_engine or engine)):
        fields = [f for f in RELEASE_TABLES if ci_engine is None or database_of(getattr(schema, f)) == database]
        with own.connect() as conn:
            facts.append(read_catalog(conn, schema, fields))
    return schema, detect_release(facts)


@contextlib.contextmanager
def deployed_newest(stack, data_dir) -> Iterator[ReleaseDb]:
    """The newest as deployed: main and ci, its DDL in both, GitLab's lock-writes triggers on the other's tables,
    the jobs through PgBouncer (transaction pooling), the test's reads and writes direct."""
    if shutil.which("pgbouncer") is None and not os.path.exists("/usr/sbin/pgbouncer"):
        if os.environ.get("CI") == "true":
            pytest.fail("pgbouncer is not installed: .ci/run installs Debian's pgbouncer")
        pytest.skip("pgbouncer is not installed (apt-get install pgbouncer)")
    with scratch_database_of(stack) as main_url, scratch_database_of(stack) as ci_url:
        engines = {}
        for database, url in ((MAIN_DATABASE, main_url), (CI_DATABASE, ci_url)):
            engines[database] = create_engine(url)
            create_schema(engines[database], release=NEWEST)
            with engines[database].begin() as conn:
                lock_writes(conn, database)
        pools = {"release_main": (make_url(main_url).database, 2), "release_ci": (make_url(ci_url).database, 2)}
        with PgBouncer.of_stack(stack, data_dir, pools) as bouncer:
            schema, release = _detected(engines[MAIN_DATABASE], engines[CI_DATABASE])
            yield ReleaseDb(NEWEST + DEPLOYED, stack, bouncer.url("release_main"), engines[MAIN_DATABASE], schema,
                            release, bouncer.url("release_ci"), engines[CI_DATABASE])
        for engine in engines.values():
            engine.dispose()


@pytest.fixture(scope="module", params=["16.0", GITLAB_17_0, "17.x", "18.x", "18.y", "19.x", NEWEST + DEPLOYED])
def release_db(request, stack, servers_dir):
    if request.param.endswith(DEPLOYED):
        with deployed_newest(stack, servers_dir / "release_pgbouncer") as db:
            yield db
        return
    with scratch_database_of(stack) as url:
        engine = create_engine(url)
        if request.param == GITLAB_17_0:
            gitlab_17_0(engine)
        else:
            create_schema(engine, release=request.param)
        yield ReleaseDb(request.param, stack, url, engine, *_detected(engine))
        engine.dispose()


@pytest.fixture
def db(request, release_db, redis_client) -> ReleaseDb:
    """The release's database(s) emptied."""
    release_db.empty()
    return release_db


def assert_release_metadata(result, op: str, db: ReleaseDb) -> None:
    metadata = op_metadata(result, op)
    assert metadata["gitlab_layout"] == LAYOUTS[db.base]
    assert metadata["gitlab_release_like"] == [name for name, known in KNOWN.items() if known == EXPECTED[db.base]]
    assert db.base in metadata["gitlab_release_like"] or db.base not in KNOWN
    assert metadata["gitlab_features"]["environments_auto_stop_setting"] == db.has("environments_auto_stop_setting")
    # Deployed: each table used in its own database.
    assert metadata["gitlab_databases"] == {
        t: database_of(db.schema.metadata.tables[t]) if db.ci_url else MAIN_DATABASE for t in metadata["gitlab_tables"]}


def test_each_release_is_detected_as_vendored(release_db):
    assert release_db.release == EXPECTED[release_db.base]
    assert release_db.release.layout == LAYOUTS[release_db.base]


def test_a_column_used_where_present_is_required_nowhere_and_checked_where_there(release_db):
    e = release_db.schema.environments
    with release_db.engine_of("environments").connect() as conn:
        assert require_columns(conn, [e], {e.name: ("id", where_present("auto_stop_setting"))}) == ["environments"]
        if release_db.has("environments_auto_stop_setting"):
            conn.execute(text("ALTER TABLE environments ALTER COLUMN auto_stop_setting TYPE text"))
            with pytest.raises(SchemaMismatch, match="environments.auto_stop_setting is TEXT, expected SMALLINT"):
                require_columns(conn, [e], {e.name: (where_present("auto_stop_setting"),)})
            conn.rollback()
        else:
            with pytest.raises(SchemaMismatch, match=r"it\): column environments.auto_stop_setting is missing$"):
                require_columns(conn, [e], {e.name: ("id", "auto_stop_setting")})


BUILD = dict(partition_id=100, project_id=7, commit_id=4242, type="Ci::Build", lock_version=0)


def test_drop_canceling_builds(db):
    old = naive_ago(hours=2)
    outdated = db.insert("ci_builds", name="rspec", status="canceling", created_at=old, updated_at=old, **BUILD)
    touched = db.insert("ci_builds", name="rspec", status="canceling", created_at=old,
                        updated_at=naive_ago(minutes=10), **BUILD)
    running = db.insert("ci_builds", name="rspec", status="running", created_at=old, updated_at=old, **BUILD)
    queue = dict(project_id=7, partition_id=100)
    for build in (outdated, running):
        db.insert("ci_pending_builds", build_id=build, **queue)
    db.insert("ci_running_builds", build_id=outdated, runner_id=3, runner_type=1, **queue)

    result = db.run(drop_canceling_builds)

    assert db.rows("SELECT id, status, failure_reason FROM {builds} ORDER BY id") == [
        (outdated, "failed", 3), (touched, "canceling", None), (running, "running", None)]
    assert db.rows("SELECT build_id FROM ci_pending_builds") == [(running,)]
    assert db.rows("SELECT build_id FROM ci_running_builds") == []
    assert_release_metadata(result, "find_canceling_builds", db)


def test_stale_runner_machines_cleanup(db):
    # An instance runner's machine: no sharding key (17.x-18.x) and no organization (18.y, 19.x) by GitLab's checks.
    kind = {"runner_type": 1} if db.has("runner_machines_runner_type") else {}

    def machine(created, contacted=None) -> int:
        return db.insert("ci_runner_machines", runner_id=1, system_xid=f"xid-{created}-{contacted}",
                         created_at=ago(days=created), updated_at=ago(days=created),
                         contacted_at=None if contacted is None else ago(hours=contacted), **kind)

    stale, contacted, young = machine(8), machine(8, contacted=1), machine(1)

    result = db.run(stale_runner_machines_cleanup)

    assert db.rows("SELECT id FROM ci_runner_machines ORDER BY id") == [(contacted,), (young,)]
    assert op_metadata(result, "report_deleted_runner_machines")["total_deleted"] == 1 and stale < contacted
    assert_release_metadata(result, "find_stale_runner_machines", db)


def test_stuck_export_jobs(db, redis_client):
    def export(jid: str, status: int, hours: int, project_id: int = 1) -> int:
        return db.insert("project_export_jobs", project_id=project_id, jid=jid, status=status,
                         created_at=ago(hours=hours), updated_at=ago(hours=hours))

    gone = export("jid-gone", 1, 7)
    # GitLab 18.6+ keys export jobs by (jid, project_id): another project's job under the same jid, gone too.
    twin = [export("jid-gone", 1, 7, project_id=2)] if db.base in ("18.y", "19.x") else []
    alive = export("jid-alive", 1, 7)
    finished = export("jid-finished", 2, 7)
    parallel = export("jid-parallel", 1, 1)  # young, with relation exports: spared (GitLab's EXPORT_JOBS_EXPIRATION)
    db.insert("project_relation_exports", project_export_job_id=parallel, relation="issues", status=1,
              created_at=ago(hours=1), updated_at=ago(hours=1))
    redis_client.set(status_key("jid-alive"), 1, ex=30 * 60)

    db.run(stuck_export_jobs)

    assert db.rows("SELECT id, status FROM project_export_jobs ORDER BY id") == [
        (gone, 3), *[(t, 3) for t in twin], (alive, 1), (finished, 2), (parallel, 1)]


# A runner as GitLab's queue query takes it (Ci::Runner: runner_type, its groups' ids, its projects, tags,
# run_untagged, access_level ref_protected).
@dataclass(frozen=True)
class Runner:
    kind: str  # instance_type, group_type, project_type
    namespace_ids: tuple[int, ...] = ()
    project_ids: tuple[int, ...] = ()
    tag_ids: tuple[int, ...] = ()
    run_untagged: bool = True
    ref_protected: bool = False


def _array(ids) -> str:
    return "'{" + ",".join(map(str, ids)) + "}'"  # GitLab's own untyped literal ('{?}'), for integer[] and bigint[]


def runner_queue(db: ReleaseDb, runner: Runner) -> list[int]:
    """The pending builds ``runner`` would be offered, as GitLab's own queue query selects them, translated from
    gitlabhq: Ci::Queue::BuildQueueService#build_candidates (app/services/ci/queue/build_queue_service.rb) and
    Ci::Queue::PendingBuildsStrategy @ e480ec63 (builds_for_shared_runner: new_builds.with_instance_runners;
    builds_for_group_runner: namespace_traversal_ids && '{?}' of runner.namespace_ids; builds_for_project_runner:
    where(project: runner.runner_projects); builds_for_protected_runner: ref_protected; builds_matching_tag_ids:
    Ci::PendingBuild.for_tags (tag_ids <@ '{?}', or tag_ids = '{}' for a runner without tags); builds_with_any_tags
    unless run_untagged: cardinality(tag_ids) > 0), in its order (build_id)."""
    where = {"instance_type": "instance_runners_enabled = true",
             "group_type": f"namespace_traversal_ids && {_array(runner.namespace_ids)}",
             "project_type": f"project_id IN (SELECT unnest(CAST({_array(runner.project_ids)} AS bigint[])))",
             }[runner.kind]
    where += " AND protected = true" if runner.ref_protected else ""
    where += f" AND tag_ids <@ {_array(runner.tag_ids)}" if runner.tag_ids else " AND tag_ids = '{}'"
    where += "" if runner.run_untagged else " AND cardinality(tag_ids) > 0"
    with db.engine_of("ci_pending_builds").connect() as conn:
        return list(conn.scalars(text(f"SELECT build_id FROM ci_pending_builds WHERE {where} ORDER BY build_id")))


DOCKER_TAG = 41  # a tags row's id (Ci::Tag), as a build's tags and a runner's tags name it


def test_environments_auto_stop_queues_each_stop_action_for_the_runners_gitlab_would_offer_it_to(db):
    """Each stop action played joins the queue as Ci::PendingBuild.upsert_from_build! writes it, and each runner's
    queue query (GitLab's own) finds exactly the stop actions GitLab's would."""
    with_setting = db.has("environments_auto_stop_setting")
    with db.engine_of("projects").begin() as conn:
        add_projects(conn, [7, 8, 9, 10])
        # Project 7 in subgroup 7 of group 70; 8 without shared runners; 9 without group runners; 10 without builds.
        conn.execute(text("UPDATE namespaces SET traversal_ids = '{70,7}', parent_id = 70 WHERE id = 7;"
                          "UPDATE projects SET shared_runners_enabled = false WHERE id = 8;"
                          "UPDATE project_ci_cd_settings SET group_runners_enabled = false WHERE project_id = 9;"
                          "UPDATE project_features SET builds_access_level = 0 WHERE project_id = 10"))

    def environment(name: str, hours: int, project_id: int = 7, **values) -> int:
        return db.insert("environments", project_id=project_id, name=name, slug=name, state="available",
                         auto_stop_at=ago(hours=hours), created_at=naive_ago(days=1), updated_at=naive_ago(days=1),
                         **values)

    def review_app(name: str, project_id: int, tags: tuple[int, ...] = (), protected: bool = False) -> tuple:
        env = environment(name, 1, project_id)
        build = {**BUILD, "project_id": project_id, "commit_id": 4200 + env}
        deploy = db.insert("ci_builds", name="deploy", status="success", **build)
        stop = db.insert("ci_builds", name="stop", status="manual", protected=protected, **build)
        for tag in tags:
            if db.has("build_tags"):
                db.insert("p_ci_build_tags", tag_id=tag, build_id=stop, partition_id=100, project_id=project_id)
            else:
                db.insert("taggings", tag_id=tag, taggable_id=stop, taggable_type="CommitStatus", context="tags")
        db.insert("deployments", iid=env, project_id=project_id, environment_id=env, ref="main", tag=False,
                  sha="a" * 40, status=2, deployable_type="CommitStatus", deployable_id=deploy, on_stop="stop",
                  created_at=naive_ago(hours=2), updated_at=naive_ago(hours=2))
        return env, deploy, stop

    due = environment("review-due", 1)
    later = environment("review-later", -24)
    plain = review_app("plain", 7)
    tagged = review_app("tagged", 7, tags=(DOCKER_TAG,), protected=True)
    no_shared = review_app("no-shared", 8)
    no_group = review_app("no-group", 9)
    no_builds = review_app("no-builds", 10)
    lost = review_app("lost", 11)  # no row in projects
    # with_action and no stop action: left available (only where the release has the setting).
    kept = environment("review-kept", 1, auto_stop_setting=1) if with_setting else None

    result = db.run(environments_auto_stop)

    queued = [plain, tagged, no_shared, no_group, no_builds]
    expected = [(due, "stopped", True), (later, "available", False)]
    expected += [(env, "stopping", False) for env, _, _ in queued] + [(lost[0], "available", False)]
    expected += [(kept, "available", False)] if with_setting else []
    assert db.rows("SELECT id, state, auto_stop_at IS NULL FROM environments ORDER BY id") == expected
    assert db.rows("SELECT id, status FROM {builds} WHERE name = 'stop' ORDER BY id") == [
        *((stop, "pending") for _, _, stop in queued), (lost[2], "manual")]
    # Every column args_from_build writes, from the same sources.
    assert db.rows("SELECT build_id, project_id, partition_id, protected, namespace_id, tag_ids, "
                   "instance_runners_enabled, namespace_traversal_ids FROM ci_pending_builds ORDER BY build_id") == [
        (plain[2], 7, 100, False, 7, [], True, [70, 7]),
        (tagged[2], 7, 100, True, 7, [DOCKER_TAG], True, [70, 7]),
        (no_shared[2], 8, 100, False, 8, [], False, [8]),
        (no_group[2], 9, 100, False, 9, [], True, []),
        (no_builds[2], 10, 100, False, 10, [], False, []),
    ]
    # Each runner is offered exactly what GitLab's would offer it.
    assert runner_queue(db, Runner("instance_type")) == [plain[2], no_group[2]]
    assert runner_queue(db, Runner("instance_type", tag_ids=(DOCKER_TAG, 99))) == [plain[2], tagged[2], no_group[2]]
    assert runner_queue(db, Runner("instance_type", tag_ids=(DOCKER_TAG,), run_untagged=False)) == [tagged[2]]
    assert runner_queue(db, Runner("instance_type", tag_ids=(DOCKER_TAG,), ref_protected=True)) == [tagged[2]]
    assert runner_queue(db, Runner("group_type", namespace_ids=(70,))) == [plain[2]]
    assert runner_queue(db, Runner("group_type", namespace_ids=(8,))) == [no_shared[2]]
    assert runner_queue(db, Runner("group_type", namespace_ids=(9, 10))) == []
    assert runner_queue(db, Runner("project_type", project_ids=(10,))) == [no_builds[2]]
    assert runner_queue(db, Runner("project_type", project_ids=(7,), tag_ids=(DOCKER_TAG,))) == [
        plain[2], tagged[2]]
    # The environment whose project has no row: one line naming it, nothing of it changed.
    report = op_metadata(result, "report_stopped_environments")
    assert (report["failed_ids"], report["rows_with_errors"]) == ([lost[0]], 1)
    assert report["errors"] == [
        f"environment {lost[0]}: project 11 has no row in projects (or its namespace none in namespaces): its stop "
        f"actions cannot be queued for a runner, so none was played and environment {lost[0]} was left available"]
    assert_release_metadata(result, "find_auto_stoppable_environments", db)


def test_environments_auto_stop_takes_stop_actions_from_the_deployment_that_releases_gitlab_would(db):
    """Environment#stop_actions: from GitLab 17.0 the last finished deployment's pipeline (success, failed or
    canceled: Deployment.last_finished_deployment_group_for_environment; 16.9-16.11 had it behind a flag, off by
    default, that 17.0 removed), before it the last successful one's (last_deployment_group). 17.0-like plays the
    failed one's."""
    finished_rule = db.base != "16.0"
    with db.engine_of("projects").begin() as conn:
        add_projects(conn, [7])
    env = db.insert("environments", project_id=7, name="review", slug="review", state="available",
                    auto_stop_at=ago(hours=1), created_at=naive_ago(days=1), updated_at=naive_ago(days=1))
    stops = {}
    for iid, status in ((1, 2), (2, 3)):  # a successful deployment, then a failed one (each its own pipeline)
        build = {**BUILD, "commit_id": 5000 + iid}
        deploy = db.insert("ci_builds", name="deploy", status="success" if status == 2 else "failed", **build)
        stops[status] = db.insert("ci_builds", name="stop", status="manual", **build)
        db.insert("deployments", iid=iid, project_id=7, environment_id=env, ref="main", tag=False, sha="a" * 40,
                  status=status, deployable_type="CommitStatus", deployable_id=deploy, on_stop="stop",
                  created_at=naive_ago(hours=3 - iid), updated_at=naive_ago(hours=3 - iid))

    db.run(environments_auto_stop)

    played = stops[3] if finished_rule else stops[2]
    assert db.rows("SELECT id, status FROM {builds} WHERE name = 'stop' ORDER BY id") == sorted(
        (stop, "pending" if stop == played else "manual") for stop in stops.values())
    assert db.rows("SELECT build_id FROM ci_pending_builds") == [(played,)]
    assert db.rows("SELECT state FROM environments") == [("stopping",)]
    # The marker the job tells them apart by: 17.0's migration AddRunnerOwnerNamespaceIdColumnToCiRunningBuilds.
    assert db.has("running_builds_runner_owner_namespace_xid") == finished_rule


def test_environments_auto_stop_plays_the_deployment_group_releases_gitlab_would(db):
    """The stop actions of a deployment group: every deployment of the environment whose job is one of its pipeline's
    latest jobs, finished from 17.0 (Pipeline#latest_finished_jobs of the last finished deployment's pipeline),
    successful before (#latest_successful_builds of the last successful one's: 16.0 plays stop_a and stop_b)."""
    finished_rule = db.base != "16.0"
    with db.engine_of("projects").begin() as conn:
        add_projects(conn, [7])
    env = db.insert("environments", project_id=7, name="review", slug="review", state="available",
                    auto_stop_at=ago(hours=1), created_at=naive_ago(days=1), updated_at=naive_ago(days=1))
    stops, iids = {}, itertools.count(1)
    # Pipeline 6001 succeeded (a job retried in it), then 6002 failed: its deploy_e canceled, its deploy_c failed.
    for pipeline, job, status, deployment_status, retried in (
            (6001, "a", "success", 2, True), (6001, "a", "success", 2, None), (6001, "b", "success", 2, None),
            (6002, "e", "canceled", 4, None), (6002, "c", "failed", 3, None)):
        build = {**BUILD, "commit_id": pipeline}
        deploy = db.insert("ci_builds", name=f"deploy_{job}", status=status, retried=retried, **build)
        on_stop = f"stop_{job}_retried" if retried else f"stop_{job}"
        stops[on_stop] = db.insert("ci_builds", name=on_stop, status="manual", **build)
        iid = next(iids)
        db.insert("deployments", iid=iid, project_id=7, environment_id=env, ref="main", tag=False, sha="a" * 40,
                  status=deployment_status, deployable_type="CommitStatus", deployable_id=deploy, on_stop=on_stop,
                  created_at=naive_ago(hours=9 - iid), updated_at=naive_ago(hours=9 - iid),
                  finished_at=ago(hours=9 - iid))

    db.run(environments_auto_stop)

    played = sorted(stops[name] for name in (("stop_e", "stop_c") if finished_rule else ("stop_a", "stop_b")))
    assert db.rows("SELECT id, status FROM {builds} WHERE name LIKE 'stop%' ORDER BY id") == [
        (stop, "pending" if stop in played else "manual") for stop in sorted(stops.values())]
    assert db.rows("SELECT build_id FROM ci_pending_builds ORDER BY build_id") == [(stop,) for stop in played]
    assert db.rows("SELECT state FROM environments") == [("stopping",)]


CREATED = ago(days=1)


def test_schedule_bulk_delete_job_artifacts(db):
    db.insert("feature_gates", feature_key="bulk_delete_job_artifacts", key="boolean", value="true",
              created_at=naive_ago(days=1), updated_at=naive_ago(days=1))

    def artifact(job_id: int, file_type: int = 2, locked: int = 0, hours: int = 2) -> int:
        return db.insert("ci_job_artifacts", project_id=1, job_id=job_id, file_type=file_type, locked=locked,
                         partition_id=100, file_store=1, file="a.zip", size=10, expire_at=ago(hours=hours),
                         created_at=CREATED, updated_at=CREATED)

    expired = artifact(1)
    kept = [artifact(2, hours=-24), artifact(3, locked=1), artifact(4, file_type=3)]  # not due, locked, a trace

    result = db.run(schedule_bulk_delete_job_artifacts)

    assert db.rows("SELECT id FROM {artifacts} ORDER BY id") == [(i,) for i in kept]
    project = ", project_id" if db.has("deleted_objects_project_id") else ""
    # JobArtifactUploader's hashed path: sha256 of the project id, the artifact's created UTC day, job and id.
    digest, day = hashlib.sha256(b"1").hexdigest(), CREATED.astimezone(dt.UTC).strftime("%Y_%m_%d")
    assert db.rows(f"SELECT file_store, store_dir, file{project} FROM ci_deleted_objects") == [
        (1, f"{digest[:2]}/{digest[2:4]}/{digest}/{day}/1/{expired}", "a.zip", *((1,) if project else ()))]
    assert_release_metadata(result, "schedule_buckets", db)


def test_delete_expired_artifact_files(db, tmp_path):
    project = {"project_id": 1} if db.has("deleted_objects_project_id") else {}

    def deleted_object(name: str, hours: int, file_store: int = 1) -> int:
        (tmp_path / "final").mkdir(exist_ok=True)
        (tmp_path / "final" / name).write_text("artifact")
        return db.insert("ci_deleted_objects", file_store=file_store, store_dir="final", file=name,
                         pick_up_at=ago(hours=hours), **project)

    deleted_object("due.zip", 1)
    later = deleted_object("later.zip", -1)
    remote = deleted_object("remote.zip", 1, file_store=2)  # object storage: counted and left

    result = db.run(delete_expired_artifact_files,
                    run_config={"ops": {"plan_artifact_file_removal": {"config": {"artifacts_root": str(tmp_path)}}}})

    assert db.rows("SELECT id FROM ci_deleted_objects ORDER BY id") == [(later,), (remote,)]
    assert sorted(p.name for p in (tmp_path / "final").iterdir()) == ["later.zip", "remote.zip"]
    assert_release_metadata(result, "plan_artifact_file_removal", db)


ALL_JOBS = (drop_canceling_builds, stale_runner_machines_cleanup, stuck_export_jobs, environments_auto_stop,
            schedule_bulk_delete_job_artifacts, delete_expired_artifact_files)


def gitlab_14_1() -> list[str]:
    """16.0's DDL as GitLab had it before partitioning began: no partition_id on any table, no ci_runner_machines
    (GitLab 15.8 added it)."""
    statements = [s for s in ddl(release="16.0") if "ci_runner_machines" not in s]
    without = [re.sub(r"\n\s*(partition_id bigint[^\n]*|CONSTRAINT partitioning_constraint[^\n]*)", "", s)
               for s in statements]
    return [re.sub(r",(\n\))", r"\1", s) for s in without]


def test_a_gitlab_older_than_16_0_is_refused_in_one_line_and_nothing_changes(stack, redis_client, tmp_path):
    with scratch_database_of(stack) as url:
        engine = create_engine(url)
        with engine.begin() as conn:
            for statement in gitlab_14_1():
                conn.execute(text(statement))
            conn.execute(text(
                "INSERT INTO ci_builds (name, type, status, created_at, updated_at, project_id, lock_version) "
                "VALUES ('rspec', 'Ci::Build', 'canceling', now() - interval '1 day', now() - interval '1 day', 1, 0);"
                "INSERT INTO environments (project_id, name, slug, auto_stop_at) VALUES (1, 'r', 'r', now() - "
                "interval '1 hour');"
                "INSERT INTO ci_job_artifacts (project_id, file_type, job_id, locked, expire_at, file, created_at, "
                "updated_at) VALUES (1, 2, 9, 0, now() - interval '1 hour', 'a.zip', now(), now());"
                "INSERT INTO project_export_jobs (project_id, status, jid, created_at, updated_at) VALUES (1, 1, "
                "'gone', now(), now())"))
        before = _snapshot(engine)
        expected = ("This GitLab is older than 16.0, the oldest release ci_cleanup supports: no partition_id on "
                    "ci_builds, no partition_id on ci_pending_builds, no partition_id on ci_running_builds, no "
                    "ci_runner_machines table. No row was read or changed")
        messages = {job.name: step_failure_message(run_job(job, stack, database_url=url, raise_on_error=False))
                    for job in ALL_JOBS}
        assert _snapshot(engine) == before
        engine.dispose()
    # Dagster's one line of the error: its class, then the message.
    assert messages == {job.name: f"ci_cleanup.gitlab.release.UnsupportedRelease: {expected}\n" for job in ALL_JOBS}
    assert redis_client.keys("*") == []  # no lease taken, no bucket


def _snapshot(engine: Engine) -> dict[str, list[tuple]]:
    tables = ("ci_builds", "environments", "ci_job_artifacts", "project_export_jobs", "ci_deleted_objects")
    with engine.connect() as conn:
        return {t: [tuple(r) for r in conn.execute(text(f"SELECT * FROM {t} ORDER BY id"))] for t in tables}


def test_a_release_without_a_column_no_job_uses_runs_and_one_a_job_uses_is_named(stack, redis_client):
    """An unknown newer release: a column gone that the job never reads is no refusal (nor builds gone, for a job
    without them: not an old GitLab); one it reads is named alone."""
    with scratch_database_of(stack) as url:
        engine = create_engine(url)
        create_schema(engine, release="18.y")
        with engine.begin() as conn:
            conn.execute(text("ALTER TABLE ci_runner_machines DROP COLUMN creation_state; DROP TABLE p_ci_builds"))
        assert run_job(stale_runner_machines_cleanup, stack, database_url=url).success
        with engine.begin() as conn:
            conn.execute(text("ALTER TABLE ci_runner_machines DROP COLUMN contacted_at"))
        message = step_failure_message(run_job(stale_runner_machines_cleanup, stack, database_url=url,
                                               raise_on_error=False))
        engine.dispose()
    assert message == ("ci_cleanup.gitlab.schema.SchemaMismatch: The database does not have what this job needs "
                       "(ci_cleanup never creates or alters tables in it): column ci_runner_machines.contacted_at is "
                       "missing\n")



def test_ci_cleanup_schema_create_makes_a_release_from_the_packaged_files(stack, tmp_path, monkeypatch, capsys):
    """``ci-cleanup schema create --release`` (the entry point in this process): the release's own layout."""
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}  # main sets its own
    with scratch_database_of(stack) as url:
        monkeypatch.setenv("CI_CLEANUP_DATABASE_URL", url)
        try:
            main(["--data-dir", str(tmp_path), "schema", "create", "--release", "18.y"])
        finally:
            for sig, handler in handlers.items():
                signal.signal(sig, handler)
        engine = create_engine(url)
        with engine.connect() as conn:
            tables = conn.execute(text(
                "SELECT to_regclass('public.ci_builds') IS NULL, to_regclass('p_ci_builds') IS NOT NULL, "
                "to_regclass('gitlab_partitions_dynamic.ci_builds_100') IS NOT NULL")).one()
        engine.dispose()
    assert tuple(tables) == (True, True, True)
    assert "Creating the GitLab schema (18.y)" in capsys.readouterr().out


# Every job's USES (its start-up check), by job: what decides whether a release is refused.
JOB_USES = {
    "drop_canceling_builds": drop_uses.USES, "stale_runner_machines_cleanup": runner_uses.USES,
    "stuck_export_jobs": export_uses.USES, "environments_auto_stop": environments_uses.USES,
    "schedule_bulk_delete_job_artifacts": artifacts_uses.USES,
    "delete_expired_artifact_files": artifacts_uses.FILES_USES,
}
RELEASES_PAGE = Path(__file__).resolve().parents[1] / "docs" / "gitlab-releases.md"


def page_table(heading: str) -> list[dict[str, str]]:
    """The first table under ``heading`` in docs/gitlab-releases.md, one dict per row keyed by its header."""
    section = ("\n" + RELEASES_PAGE.read_text()).split(f"\n{heading}\n", 1)[1].splitlines()
    table = itertools.dropwhile(lambda line: not line.startswith("|"), section)
    lines = list(itertools.takewhile(lambda line: line.startswith("|"), table))
    cells = [[c.strip() for c in re.split(r"(?<!\\)\|", line)[1:-1]] for line in lines]
    return [dict(zip(cells[0], row, strict=True)) for row in cells[2:]]


def refused_jobs(db: ReleaseDb) -> list[str]:
    """The jobs whose start-up check refuses this release's schema."""
    refused = []
    for job, uses in JOB_USES.items():
        try:
            for field, columns in uses.items():
                table = getattr(db.schema, field)
                with db.engine_of(table.fullname).connect() as conn:
                    require_columns(conn, [table], {table.name: columns})
        except SchemaMismatch:
            refused.append(job)
    return refused


def test_the_releases_page_says_which_jobs_each_release_refuses(release_db):
    """docs/gitlab-releases.md's table, row by row, against the start-up checks on that release's schema (the
    matrix's other tests run every job there, exact rows asserted)."""
    rows = {row["release"].split()[0]: row for row in page_table("# GitLab's releases")}
    row = rows[release_db.base.removesuffix("-like")]

    assert row["jobs refused"] == (", ".join(refused_jobs(release_db)) or "none")


def test_the_releases_page_says_runs_exactly_where_no_job_requires_the_missing_column():
    """Each case naming GitLab columns reads "runs" unless a job's start-up check requires one of them (``USES``,
    ``where_present`` ones not): then "refused"."""
    required = {(table, column) for uses in JOB_USES.values() for table, columns in uses.items()
                for column in columns if not isinstance(column, WherePresent)}
    checked = 0
    for row in page_table("## What each release lacks, and what that release's GitLab does"):
        named = re.findall(r"`(\w+)\.(\w+)`", row["case"])
        if not named:
            continue
        checked += 1
        expected = "refused" if required & set(named) else "runs"
        assert row["ci_cleanup today"].split()[0].strip(":,") == expected, row["case"]
    assert checked >= 5
