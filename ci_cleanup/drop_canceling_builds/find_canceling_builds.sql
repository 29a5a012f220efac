-- The next candidates of Ci::StuckBuilds::DropCancelingService, in its order, as drop_canceling_builds.sql picks
-- them: what a dry run reports, and the builds of a failed batch, taken one by one.
SELECT id
FROM p_ci_builds
WHERE {{ outdated_canceling }}
  AND id <> ALL(CAST(:passed_over AS bigint[]))
ORDER BY created_at, project_id, id
LIMIT :batch_size
