-- A dry run of delete_expired_artifact_files: the first rows next_due_deleted_objects.sql would take
-- (pick_up_at < now, oldest first), read without locking them.
SELECT id, file_store, store_dir, file, pick_up_at::text AS pick_up_at
FROM ci_deleted_objects
WHERE {{ ready_for_destruction }}
-- The column, not the text column of the same name the list makes (ORDER BY takes that one first: it
-- would put year 1 before 44 BC, in an order each session time zone changes).
ORDER BY ci_deleted_objects.pick_up_at, id
LIMIT :limit
