-- The stale runner machines, or as many up to the limit (none given: all): what a dry run would delete, or what a
-- run its cap stopped leaves for the next one.
SELECT count(*) FROM (
  SELECT FROM ci_runner_machines
  WHERE {{ stale }}
  LIMIT :limit
) AS stale
