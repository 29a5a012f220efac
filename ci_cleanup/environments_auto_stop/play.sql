-- Ci::Build#play (seed 003 via Environments::StopService) of the manual stop actions in ``actions``: manual ->
-- pending, queued_at = now, and the build joins the runners' queue (Ci::UpdateBuildQueueService#push, GitLab's unique
-- index on ci_pending_builds (build_id)) as Ci::PendingBuild.upsert_from_build! writes it. A stop action already
-- pending is not played again. The CTEs played and queued, named {{ play }} by play_stop_actions.sql and
-- stop_batch.sql.
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
