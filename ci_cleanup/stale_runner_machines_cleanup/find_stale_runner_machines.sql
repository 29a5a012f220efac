-- Stale runner machines in id order: the ids a dry run reports.
SELECT id FROM ci_runner_machines
WHERE {{ stale }}
ORDER BY id
LIMIT :limit
