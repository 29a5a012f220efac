-- A dry run of delete_expired_artifact_files: the first rows next_due_deleted_objects.sql would take
-- (pick_up_at < now, oldest first), read without locking them.
SELECT id, file_store, store_dir, file, pick_up_at::text AS pick_up_at
FROM ci_deleted_objects
WHERE pick_up_at < :now
ORDER BY pick_up_at, id
LIMIT :limit
