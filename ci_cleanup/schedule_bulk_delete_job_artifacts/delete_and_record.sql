-- The part of a batch after its flags (the CTE flags: enabled, max_buckets), named {{ delete_and_record }} by
-- delete_expired_batch.sql and delete_expired_batch_flags_from_main.sql: the bucket's artifacts deleted and their
-- files recorded in ci_deleted_objects, in the one statement.
-- The bucket's next 100: expired (expired.sql) and MOD(project_id + job_id, max_buckets) = bucket, oldest first from the worker's cursor (the last expire_at
-- it deleted), so a batch does not read again past what earlier batches and the other buckets left.
-- FOR UPDATE SKIP LOCKED keeps two workers (or a worker and a live GitLab) off the same rows.
-- ORDER BY expire_at reads GitLab's partial index (expire_at) WHERE locked = 0 AND file_type <> 3 in order.
-- The MOD is a CASE: PostgreSQL has no statistics on the MOD and would guess so few rows match that it sorts
-- the whole backlog instead of reading that index in order. In numeric, so that a bad row's project_id + job_id
-- past the bigint range cannot make every batch fail.
deleted AS (
  DELETE FROM p_ci_job_artifacts
  WHERE id = ANY(ARRAY(
    SELECT id FROM p_ci_job_artifacts
    WHERE {{ expired }}
      AND CASE WHEN MOD(project_id::numeric + job_id, (SELECT max_buckets FROM flags)) = :bucket
               THEN true ELSE false END
      AND expire_at >= CAST(:after AS timestamptz)
      AND (SELECT enabled FROM flags) AND :bucket < (SELECT max_buckets FROM flags)
    ORDER BY expire_at
    LIMIT :limit
    FOR UPDATE SKIP LOCKED))
  RETURNING id, project_id, job_id, file, file_store, file_final_path, expire_at, created_at, size
),
-- Ci::DeletedObject.bulk_import of Ci::JobArtifact#to_deleted_object_attrs: one ci_deleted_objects row per
-- artifact that names a stored file. With file_final_path: store_dir its dirname, file its basename. Else
-- GitLab's hashed path (JobArtifactUploader#hashed_path): h = sha256(project_id) in hex,
-- store_dir h[0:2]/h[2:4]/h/<created_at's UTC day YYYY_MM_DD>/<job_id>/<id>, file the artifact's file.
-- pick_up_at = expire_at clamped to [now - 1 day, now + 1 hour], the bounds bound as earliest and latest
-- (computed in UTC: an interval of a day would follow the session time zone's daylight saving).
-- An empty file_final_path or file is none (Rails' present?).
paths AS (
  SELECT deleted.*, nullif(file_final_path, '') AS final_path,
         regexp_replace(nullif(file_final_path, ''), '[^/]*$', '') AS final_head,
         encode(sha256(convert_to(project_id::text, 'UTF8')), 'hex') AS h
  FROM deleted
),
recorded AS (
  -- GitLab before 17.4 records no project_id (Ci::DeletedObject.bulk_import): those lines are left out there.
  INSERT INTO ci_deleted_objects (
    project_id,  -- if ci_deleted_objects.project_id
    file_store, store_dir, file, pick_up_at)
  SELECT
         project_id,  -- if ci_deleted_objects.project_id
         coalesce(file_store, 1),
         -- dirname as Python's posixpath: trailing slashes stripped, unless it is all slashes
         CASE WHEN final_path IS NOT NULL
              THEN CASE WHEN final_head ~ '^/*$' THEN final_head ELSE rtrim(final_head, '/') END
              ELSE concat_ws('/', substr(h, 1, 2), substr(h, 3, 2), h,
                             to_char(timezone('UTC', created_at), 'YYYY_MM_DD'), job_id, id)
         END,
         CASE WHEN final_path IS NOT NULL THEN regexp_replace(final_path, '^.*/', '') ELSE file END,
         least(greatest(expire_at, :earliest), :latest)
  FROM paths
  WHERE final_path IS NOT NULL OR (nullif(file, '') IS NOT NULL AND created_at IS NOT NULL)
  RETURNING id
)
-- last: the worker's cursor for its next batch, as PostgreSQL's text of the timestamp (a year-1 or BC expire_at
-- has no Python datetime).
SELECT (SELECT max(expire_at)::text FROM deleted) AS last,
       (SELECT count(*) FROM deleted) AS count,
       (SELECT array_agg(id ORDER BY id) FROM deleted) AS ids,
       (SELECT coalesce(sum(size), 0)::bigint FROM deleted) AS size,
       (SELECT count(*) FROM recorded) AS deleted_objects,
       (SELECT enabled FROM flags) AS enabled,
       (SELECT max_buckets FROM flags) AS max_buckets
