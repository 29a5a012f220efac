-- The rows ready for destruction (pick_up_at < now), by file_store (1 local, 2 object storage).
SELECT file_store, count(*) AS count
FROM ci_deleted_objects
WHERE {{ ready_for_destruction }}
GROUP BY file_store
