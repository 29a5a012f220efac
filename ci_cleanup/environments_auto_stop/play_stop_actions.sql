-- The ci database's part of a batch: the stop actions of the environments given (their ids, each one's last
-- finished deployment's deployable and on_stop, in step), and the manual ones played.
-- Environment#stop_actions: the Ci::Build rows of the deployable's pipeline whose name is the deployment's on_stop.
-- Ci::Build#play (seed 003 via Environments::StopService): manual -> pending, queued_at = now, and the build joins
-- the runners' queue (Ci::UpdateBuildQueueService#push, GitLab's unique index on ci_pending_builds (build_id)) as
-- Ci::PendingBuild.upsert_from_build! writes it; played, queued as stop_batch.sql does, in the same text.
-- A stop action already pending is not played again: a batch done twice plays nothing more.
-- Each environment comes with its project's part of the queue row, read in main (pick_batch.sql): its namespace
-- (NULL: no project row, so its stop actions are not played), instance runners, traversal ids (as text: arrays of
-- arrays cannot be unnested).
WITH wanted AS (
  SELECT *
  FROM unnest(CAST(:environment_ids AS bigint[]), CAST(:deployable_ids AS bigint[]), CAST(:on_stops AS text[]),
              CAST(:namespace_ids AS bigint[]), CAST(:instance_runners_enabled AS boolean[]),
              CAST(:namespace_traversal_ids AS text[]))
    AS wanted (environment_id, deployable_id, on_stop, namespace_id, instance_runners_enabled, namespace_traversal_ids)
),
actions AS (
  SELECT wanted.environment_id, stop_action.id, wanted.namespace_id, wanted.instance_runners_enabled,
         CAST(wanted.namespace_traversal_ids AS bigint[]) AS namespace_traversal_ids
  FROM wanted
  JOIN p_ci_builds AS deployable ON deployable.id = wanted.deployable_id
  JOIN p_ci_builds AS stop_action
    ON stop_action.commit_id = deployable.commit_id
   AND stop_action.name = wanted.on_stop
   AND stop_action.type = 'Ci::Build'
),
played AS (
  UPDATE p_ci_builds
  SET status = 'pending', queued_at = :naive_now, updated_at = :naive_now,
      lock_version = coalesce(lock_version, 0) + 1
  WHERE id = ANY(ARRAY(SELECT id FROM actions WHERE namespace_id IS NOT NULL)) AND status = 'manual'
  RETURNING id, project_id, partition_id, protected
),
-- Ci::PendingBuild.upsert_from_build! (args_from_build): protected, namespace, tag ids, instance runners and
-- traversal ids, as runners choose jobs by them (Ci::Queue::PendingBuildsStrategy).
queued AS (
  INSERT INTO ci_pending_builds (build_id, project_id, partition_id, protected, namespace_id, tag_ids,
                                 instance_runners_enabled, namespace_traversal_ids)
  SELECT DISTINCT ON (played.id) played.id, played.project_id, played.partition_id, coalesce(played.protected, false),
         actions.namespace_id,
         -- Ci::Build#tags_ids: p_ci_build_tags from GitLab 17.3, acts-as-taggable's taggings before.
         ARRAY(SELECT tags.tag_id FROM p_ci_build_tags AS tags  -- if p_ci_build_tags.tag_id
               WHERE tags.build_id = played.id AND tags.partition_id = played.partition_id  -- if p_ci_build_tags.tag_id
               ORDER BY tags.tag_id),  -- if p_ci_build_tags.tag_id
         ARRAY(SELECT tags.tag_id FROM taggings AS tags  -- unless p_ci_build_tags.tag_id
               WHERE tags.taggable_id = played.id  -- unless p_ci_build_tags.tag_id
                 AND tags.taggable_type = 'CommitStatus' AND tags.context = 'tags'  -- unless p_ci_build_tags.tag_id
               ORDER BY tags.tag_id),  -- unless p_ci_build_tags.tag_id
         actions.instance_runners_enabled, actions.namespace_traversal_ids
  FROM played JOIN actions ON actions.id = played.id
  -- A stop action shared by environments: their project is its own in GitLab; the first environment's, to be sure.
  ORDER BY played.id, actions.environment_id
  ON CONFLICT (build_id) DO NOTHING
)
-- A row per environment that has stop actions: those played (NULL: none).
SELECT actions.environment_id,
       array_agg(played.id ORDER BY played.id) FILTER (WHERE played.id IS NOT NULL) AS played
FROM actions
LEFT JOIN played ON played.id = actions.id
GROUP BY actions.environment_id
