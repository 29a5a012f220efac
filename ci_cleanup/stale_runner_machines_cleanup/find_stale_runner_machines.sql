-- Stale runner machines in id order: the ids a dry run reports.
SELECT id FROM ci_runner_machines
WHERE created_at <= :deadline AND (contacted_at IS NULL OR contacted_at <= :deadline)
ORDER BY id
LIMIT :limit
