-- Ci::DeleteObjectsService: the next batch of ci_deleted_objects rows ready for destruction
-- (Ci::DeletedObject.ready_for_destruction: pick_up_at < now), oldest pick_up_at first, locked for this run
-- (FOR UPDATE SKIP LOCKED) until its transaction ends.
-- Paged by (pick_up_at, id) after the last row taken ('-infinity', 0 at first), so that a row left (object
-- storage, no root, refused) is not taken again in the same run; pick_up_at >= the page's is the same bound,
-- written so the pick_up_at index reads from there.
-- pick_up_at comes back as PostgreSQL's text: a row GitLab wrote with a year-1 or BC pick_up_at has no Python
-- datetime, and must not stop every run.
SELECT id, file_store, store_dir, file, pick_up_at::text AS pick_up_at
FROM ci_deleted_objects
WHERE {{ ready_for_destruction }}
  AND pick_up_at >= CAST(:after_pick_up_at AS timestamptz)
  AND (pick_up_at, id) > (CAST(:after_pick_up_at AS timestamptz), :after_id)
-- The column, not the text column of the same name the list makes (ORDER BY takes that one first: it
-- would put year 1 before 44 BC, in an order each session time zone changes).
ORDER BY ci_deleted_objects.pick_up_at, id
LIMIT :limit
FOR UPDATE SKIP LOCKED
