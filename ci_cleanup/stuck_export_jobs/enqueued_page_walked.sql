-- enqueued_page.sql for a dense backlog (most ids from the first enqueued job's to the last's are enqueued):
-- (status + 0) keeps GitLab's status index out, so the page walks the primary key from the cursor until it has
-- its chunk. Through the status index PostgreSQL reads and sorts every enqueued job after the cursor, for each page,
-- once the table's rows have moved by their updates: a run's pages then cost the square of its backlog.
SELECT id, jid
FROM project_export_jobs
WHERE (status + 0) IN (0, 1) AND id > :after_id
ORDER BY id
LIMIT :limit
