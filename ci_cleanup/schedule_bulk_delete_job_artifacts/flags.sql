-- The flags as Feature.enabled?(name, :instance) decides each (lib/feature.rb), as the CTEs gates, stored and flags:
-- a flag with default_enabled true (bound, from its definition: ci_cleanup/gitlab/feature_flags.py) is on while it is
-- not in features; otherwise its gates decide: on with the boolean gate true or the instance as an actor, unless the
-- instance opted out. :on_for_ci_cleanup: the operator turned bulk_delete_job_artifacts on for ci_cleanup alone.
-- max_buckets: 10 with bulk_delete_job_artifacts_high_concurrency, else 5. Named {{ flags }} by read_flags.sql and
-- delete_expired_batch.sql.
gates AS (
  SELECT feature_key,
         bool_or((key = 'boolean' AND value = 'true')
                 OR (key = 'actors' AND value LIKE 'FlipperGitlabInstance:%' AND value NOT LIKE '%opt\_out'))
           -- the instance's opt-out, <instance>:opt_out (a host name has no _)
           AND NOT bool_or(key = 'actors' AND value LIKE 'FlipperGitlabInstance:%opt\_out') AS on_by_gates
  FROM feature_gates
  WHERE feature_key IN ('bulk_delete_job_artifacts', 'bulk_delete_job_artifacts_high_concurrency')
  GROUP BY feature_key
),
stored AS (
  SELECT name, EXISTS (SELECT FROM features WHERE features.key = name) AS persisted,
         EXISTS (SELECT FROM gates WHERE gates.feature_key = name) AS gated,
         coalesce((SELECT on_by_gates FROM gates WHERE gates.feature_key = name), false) AS on_by_gates
  FROM (VALUES ('bulk_delete_job_artifacts'), ('bulk_delete_job_artifacts_high_concurrency')) AS flag (name)
),
flags AS (
  SELECT bool_or(name = 'bulk_delete_job_artifacts'
                 AND (CAST(:on_for_ci_cleanup AS boolean) OR on_by_gates
                      OR (CAST(:enabled_by_default AS boolean) AND NOT persisted))) AS enabled,
         CASE WHEN bool_or(name = 'bulk_delete_job_artifacts_high_concurrency'
                           AND (on_by_gates OR (CAST(:high_concurrency_by_default AS boolean) AND NOT persisted)))
              THEN 10 ELSE 5 END AS max_buckets,
         bool_or(name = 'bulk_delete_job_artifacts' AND persisted) AS persisted,
         bool_or(name = 'bulk_delete_job_artifacts' AND gated) AS gated
  FROM stored
)
