"""environments_auto_stop's workshop.

Its rows in the demo dataset (``ci-cleanup demo``), some it must change and more it must not; and its entries in
the benchmark (``ci-cleanup bench``): the job's service, a raw SQL loop and a per-row loop
(:mod:`~ci_cleanup_dev.bench.jobs`), its true floor (:mod:`~ci_cleanup_dev.bench.floor`), and the tables and cases
its launched runs meet (:mod:`~ci_cleanup_dev.bench.launched`)."""

from __future__ import annotations

import datetime as dt
import json
import random

import redis
from sqlalchemy import func, insert, select, text
from sqlalchemy.engine import Connection

from ci_cleanup.environments_auto_stop import service as auto_stop
from ci_cleanup.environments_auto_stop.service import BATCH_SIZE as ENVS_BATCH
from ci_cleanup.gitlab.loop_helpers import NO_HOOKS
from ci_cleanup.gitlab.schema import GitLabSchema, naive_utc, utc_now
from ci_cleanup.gitlab.sql_files import condition
from ci_cleanup_dev.project_rows import add_projects

from ..bench.floor import on_a_connection
from ..bench.jobs import UNLIMITED, S, max_id, per_row, with_callback


def seed(
    conn: Connection, queues: redis.Redis, schema: GitLabSchema, rng: random.Random, now: dt.datetime
) -> None:
    """environments_auto_stop: expired review apps (plain ones to stop, ones with a manual stop job, with_action
    ones to leave; two batches), and environments it must not touch (not due yet, no auto-stop, already stopped)."""
    kinds = (
        ["plain"] * 110 + ["stop_action"] * 15 + ["with_action"] * 10 + ["future"] * 20 + ["production"] * 5
        + ["stopped"] * 10
    )
    rows, base = [], conn.scalar(select(func.coalesce(func.max(schema.environments.c.id), 0)))
    for i, kind in enumerate(kinds, start=base + 1):
        expired = now - dt.timedelta(hours=rng.randint(1, 72))
        auto_stop_at = {"future": now + dt.timedelta(hours=rng.randint(1, 72)), "production": None}.get(kind, expired)
        created = naive_utc(now - dt.timedelta(days=rng.randint(2, 30)))
        name = "production" if kind == "production" else f"review/feature-{i}"
        rows.append(dict(
            project_id=100 + i if kind == "production" else rng.randint(1, 20), name=name, slug=name.replace("/", "-"),
            state="stopped" if kind == "stopped" else "available", auto_stop_at=auto_stop_at,
            auto_stop_setting=1 if kind == "with_action" else 0, created_at=created, updated_at=created,
        ))
    returning_ids = insert(schema.environments).returning(schema.environments.c.id, sort_by_parameter_order=True)
    env_ids = conn.execute(returning_ids, rows).scalars().all()
    add_projects(conn, {env["project_id"] for env in rows}, schema)  # a stop action is queued from its project
    for n, (env_id, kind, env) in enumerate(zip(env_ids, kinds, rows)):
        if kind not in ("stop_action", "with_action"):
            continue
        # Each review app deployed by its own pipeline; a with_action app's pipeline has no stop job: left available.
        pipeline = 90_000 + env_id
        deployed = naive_utc(now - dt.timedelta(days=2))
        build = dict(partition_id=100 + n % 3, project_id=env["project_id"], commit_id=pipeline, type="Ci::Build",
                     lock_version=0, created_at=deployed, updated_at=deployed)
        deploy_id = conn.execute(
            insert(schema.ci_builds).values(name="deploy_review", status="success", **build)
            .returning(schema.ci_builds.c.id)
        ).scalar_one()
        if kind == "stop_action":
            conn.execute(insert(schema.ci_builds).values(name="stop_review", status="manual", **build))
        conn.execute(insert(schema.deployments).values(
            iid=env_id, project_id=env["project_id"], environment_id=env_id, ref=f"feature-{n}", tag=False,
            sha=f"{rng.getrandbits(160):040x}", status=2, deployable_type="CommitStatus", deployable_id=deploy_id,
            on_stop="stop_review" if kind == "stop_action" else None, created_at=deployed, updated_at=deployed,
            finished_at=now,
        ))


# -- the benchmark (see bench/jobs.py, bench/floor.py) ---------------------------------------------------------

# The limit the benchmark launches the job with (its run config), so job and floor stop at the same place.
# Environment#stop_actions' deployment group: the deployments of the latest finished jobs (success, failed, canceled)
# of the last finished deployment's pipeline (success 2, failed 3, canceled 4) from GitLab 17.0, of the latest
# successful ones of the last successful deployment's before; told apart as the job tells them apart (17.0's
# ci_running_builds.runner_owner_namespace_xid).
FINISHED_RULE = """EXISTS (SELECT FROM pg_attribute WHERE attrelid = to_regclass('ci_running_builds')
    AND attname = 'runner_owner_namespace_xid' AND NOT attisdropped)"""
STOP_DEPLOYMENT_STATUSES = f"ANY(CASE WHEN {FINISHED_RULE} THEN ARRAY[2, 3, 4] ELSE ARRAY[2] END)"
GROUP_JOB_STATUSES = (f"ANY(CASE WHEN {FINISHED_RULE} THEN ARRAY['success', 'failed', 'canceled'] "
                      "ELSE ARRAY['success'] END)")
# The stop actions of the deployment group of ``last`` (an environment ``e``'s last deployment's deployable_id).
GROUP_STOP_ACTIONS = f"""JOIN p_ci_builds last_deployable ON last_deployable.id = last.deployable_id
  JOIN p_ci_builds job ON job.commit_id = last_deployable.commit_id AND job.retried IS NOT TRUE
                      AND job.status = {GROUP_JOB_STATUSES}
  JOIN deployments member ON member.deployable_type = 'CommitStatus' AND member.deployable_id = job.id
                         AND member.environment_id = e.id
  JOIN p_ci_builds stop_action ON stop_action.commit_id = job.commit_id AND stop_action.name = member.on_stop
                              AND stop_action.type = 'Ci::Build'"""


ENVS_MAX_LOOPS = 10_000

# The rule's condition, as the batch's statements have it (environments_auto_stop/auto_stoppable.sql).
DUE = condition("ci_cleanup.environments_auto_stop", "auto_stoppable")
DUE_PY = condition("ci_cleanup.environments_auto_stop", "auto_stoppable", pyformat=True)


def envs_job(engine, client, on_batch, hooks=NO_HOOKS):
    result = auto_stop.auto_stop_environments(
        engine, engine, S, auto_stop.Limits(max_loops=UNLIMITED, max_runtime=dt.timedelta(days=1)),
        with_callback(hooks, on_batch),
    )
    return result.counts[auto_stop.STOPPED] + result.counts[auto_stop.STOPPING]


def envs_raw(engine, client, on_batch):
    """Page by id, look up stop actions (the last deployment's group) for the page, stop the rest in one UPDATE."""
    total, after, now = 0, 0, utc_now()
    while True:
        with engine.begin() as conn:
            page = text(f"SELECT id FROM environments WHERE {DUE} AND id > :after ORDER BY id LIMIT 100")
            ids = list(conn.scalars(page, {"now": now, "after": after}))
            if not ids:
                return total
            with_actions = set(conn.scalars(text(f"""
                SELECT DISTINCT e.id FROM environments e JOIN LATERAL (SELECT deployable_id FROM deployments d
                  WHERE d.environment_id = e.id AND d.status = {STOP_DEPLOYMENT_STATUSES}
                  ORDER BY d.finished_at DESC, d.id DESC LIMIT 1) last ON true
                {GROUP_STOP_ACTIONS}
                WHERE e.id = ANY(:ids)"""), {"ids": ids}))
            stop = text(f"""UPDATE environments SET state = 'stopped', auto_stop_at = NULL, updated_at = :naive
                            WHERE id = ANY(:ids) AND {DUE} AND auto_stop_setting = 0""")
            without = [i for i in ids if i not in with_actions]
            total += conn.execute(stop, {"ids": without, "now": now, "naive": naive_utc(now)}).rowcount
        after = ids[-1]
        on_batch()


def envs_per_row(engine, client, on_batch):
    now = utc_now()

    def stop(conn, env_id):  # Environment#stop_with_actions!: read it and its last deployment, then stop it
        read = text(f"SELECT id, auto_stop_setting FROM environments WHERE id = :id AND {DUE}")
        env = conn.execute(read, {"id": env_id, "now": now}).first()
        if env is None:
            return 0
        last = text(f"SELECT deployable_id, on_stop FROM deployments WHERE environment_id = :id "
                    f"AND status = {STOP_DEPLOYMENT_STATUSES} ORDER BY finished_at DESC, id DESC LIMIT 1")
        conn.execute(last, {"id": env_id}).first()
        stop = text(f"UPDATE environments SET state = 'stopped', auto_stop_at = NULL, updated_at = :naive "
                    f"WHERE id = :id AND {DUE}")
        return conn.execute(stop, {"id": env_id, "now": now, "naive": naive_utc(now)}).rowcount

    page = f"SELECT id FROM environments WHERE {DUE} AND id > :after ORDER BY id LIMIT 100"
    return per_row(engine, page, {"now": now}, stop)


# -- environments_auto_stop: page by (auto_stop_at, id), the batch locked as the job's pick locks it; stopping
# with stop actions (the manual ones played and queued with their partition_id), stopped when always, left
# otherwise; each UPDATE re-checks auto-stoppable.

ENVS = """WITH batch AS (
  SELECT id, auto_stop_setting, auto_stop_at, project_id FROM environments
  WHERE {due}
    AND auto_stop_at >= %(after_at)s AND (auto_stop_at > %(after_at)s OR id > %(after_id)s)
  ORDER BY auto_stop_at, id LIMIT %(limit)s FOR UPDATE),
project AS (
  SELECT p.id, p.namespace_id,
         coalesce(f.builds_access_level > 0, false) AND NOT coalesce(p.pending_delete, false) AS builds_on,
         p.shared_runners_enabled, coalesce(s.group_runners_enabled, false) AS group_runners, n.traversal_ids
  FROM projects p JOIN namespaces n ON n.id = p.namespace_id
  LEFT JOIN project_features f ON f.project_id = p.id LEFT JOIN project_ci_cd_settings s ON s.project_id = p.id
  WHERE p.id IN (SELECT project_id FROM batch)),
actions AS (
  SELECT e.id AS environment_id, stop_action.id, project.namespace_id,
         project.builds_on AND project.shared_runners_enabled AS instance_runners_enabled,
         CASE WHEN project.builds_on AND project.group_runners THEN project.traversal_ids
              ELSE CAST('{}' AS bigint[]) END AS namespace_traversal_ids
  FROM batch AS e
  LEFT JOIN project ON project.id = e.project_id
  JOIN LATERAL (SELECT deployable_id FROM deployments d
                WHERE d.environment_id = e.id AND d.status = {statuses}
                ORDER BY d.finished_at DESC, d.id DESC LIMIT 1) last ON true
  {group_stop_actions}),
stopping AS (
  UPDATE environments SET state = 'stopping', updated_at = %(now_naive)s
  WHERE id = ANY(ARRAY(SELECT environment_id FROM actions WHERE namespace_id IS NOT NULL))
    AND {due}
  RETURNING id),
stopped AS (
  UPDATE environments SET state = 'stopped', auto_stop_at = NULL, updated_at = %(now_naive)s
  WHERE id = ANY(ARRAY(SELECT id FROM batch WHERE auto_stop_setting = 0
                       AND id NOT IN (SELECT environment_id FROM actions)))
    AND {due} AND auto_stop_setting = 0
  RETURNING id),
played AS (
  UPDATE p_ci_builds SET status = 'pending', queued_at = %(now_naive)s, updated_at = %(now_naive)s,
         lock_version = coalesce(lock_version, 0) + 1
  WHERE id = ANY(ARRAY(SELECT id FROM actions WHERE environment_id IN (SELECT id FROM stopping))) AND status = 'manual'
  RETURNING id, project_id, partition_id, protected),
queued AS (
  INSERT INTO ci_pending_builds (build_id, project_id, partition_id, protected, namespace_id, tag_ids,
                                 instance_runners_enabled, namespace_traversal_ids)
  SELECT DISTINCT ON (played.id) played.id, played.project_id, played.partition_id,
         coalesce(played.protected, false), actions.namespace_id, {tags}, actions.instance_runners_enabled,
         actions.namespace_traversal_ids
  FROM played JOIN actions ON actions.id = played.id ORDER BY played.id, actions.environment_id
  ON CONFLICT (build_id) DO NOTHING)
SELECT (SELECT count(*) FROM stopping) + (SELECT count(*) FROM stopped),
       (SELECT auto_stop_at FROM batch ORDER BY auto_stop_at DESC, id DESC LIMIT 1),
       (SELECT id FROM batch ORDER BY auto_stop_at DESC, id DESC LIMIT 1)"""
# A build's tag ids: p_ci_build_tags from GitLab 17.3, taggings before.
BUILD_TAGS = ("ARRAY(SELECT tag_id FROM p_ci_build_tags t WHERE t.build_id = played.id "
              "AND t.partition_id = played.partition_id ORDER BY tag_id)")
TAGGINGS = ("ARRAY(SELECT tag_id FROM taggings t WHERE t.taggable_id = played.id AND t.taggable_type = 'CommitStatus' "
            "AND t.context = 'tags' ORDER BY tag_id)")


def envs_floor(conn, client: redis.Redis) -> tuple[int, int]:
    cur = conn.cursor()
    cur.execute("SELECT to_regclass('p_ci_build_tags') IS NOT NULL")
    statement = ENVS.replace("{tags}", BUILD_TAGS if cur.fetchone()[0] else TAGGINGS).replace(
        "{group_stop_actions}", GROUP_STOP_ACTIONS).replace("{statuses}", STOP_DEPLOYMENT_STATUSES).replace(
        "{due}", DUE_PY)
    after = (dt.datetime(1, 1, 1, tzinfo=dt.UTC), 0)
    total = batches = 0
    while batches < ENVS_MAX_LOOPS:
        now = utc_now()
        cur.execute(statement, {"now": now, "now_naive": naive_utc(now), "after_at": after[0], "after_id": after[1],
                           "limit": ENVS_BATCH})
        changed, last_at, last_id = cur.fetchone()
        if last_id is None:
            break
        total, batches, after = total + changed, batches + 1, (last_at, last_id)
    return total, batches


def _environment_cases(conn, client: redis.Redis, before: dict[str, int]) -> None:
    # Background environments that fall due during the rounds (auto_stop_at within the next hours, or left
    # due by an interrupted bench, '-infinity' included) would be stopped by the first run alone, their stop
    # actions (builds of a candidate's pipeline can be) played once: their auto-stop moved a week from now.
    conn.execute(text("""
        UPDATE environments SET auto_stop_at = greatest(auto_stop_at, now()) + interval '7 days'
        WHERE id <= :before AND state = 'available' AND auto_stop_at < now() + interval '6 hours'
    """), {"before": before["environments"]})
    # Stop actions an earlier bench on these tables added in the pipelines the candidates deploy from are
    # outside the snapshot: the first run alone would play them. Deleted (the rows only a bench adds).
    conn.execute(text("SET LOCAL session_replication_role = replica"))
    conn.execute(text("""
        DELETE FROM p_ci_builds stop_action
        USING environments e, deployments d, p_ci_builds deployable
        WHERE e.id > :before AND d.environment_id = e.id AND deployable.id = d.deployable_id
          AND stop_action.commit_id = deployable.commit_id AND stop_action.name = d.on_stop
    """), {"before": before["environments"]})
    conn.execute(text("SET LOCAL session_replication_role = DEFAULT"))
    # A tenth have a manual stop action in their last deployment's pipeline: stopping, the action played.
    before["p_ci_builds"] = max_id(conn, "p_ci_builds")
    conn.execute(text(f"""
        INSERT INTO p_ci_builds (partition_id, project_id, commit_id, name, type, status, lock_version,
                                 created_at, updated_at, "when", allow_failure)
        SELECT DISTINCT ON (deployable.commit_id) deployable.partition_id, deployable.project_id,
               deployable.commit_id, d.on_stop, 'Ci::Build', 'manual', 0, deployable.created_at,
               deployable.created_at, 'manual', true
        FROM environments e
        JOIN LATERAL (SELECT deployable_id, on_stop FROM deployments d WHERE d.environment_id = e.id
                        AND d.status = {STOP_DEPLOYMENT_STATUSES}
                      ORDER BY d.finished_at DESC, d.id DESC LIMIT 1) d ON true
        JOIN p_ci_builds deployable ON deployable.id = d.deployable_id
        WHERE e.id > :before AND e.id % 10 = 0
        ORDER BY deployable.commit_id
    """), {"before": before["environments"]})


# Its entries in the benchmark's per-job tables (ci_cleanup_dev.batches).
RUNNERS = (envs_job, envs_raw, envs_per_row)
FLOOR = on_a_connection(envs_floor)
# The tables whose candidate rows (id > the id before the candidates were added) the job may change, where the
# release has them.
SCOPED = ("environments", "p_ci_builds")
# What the job is launched with beyond its defaults (YAML, written as JSON).
RUN_CONFIG = json.dumps({"ops": {"find_auto_stoppable_environments": {"config": {"max_loops": ENVS_MAX_LOOPS}}}})
CASES = _environment_cases  # the cases its guards decide, beyond its plain candidates
