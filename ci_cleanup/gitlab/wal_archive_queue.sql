-- GitLab's WriteAheadLog indicator (PENDING_WAL_COUNT_SQL): WAL segments waiting for the archiver, the current WAL
-- file's log and segment numbers less the last archived one's (16 MB segments, 256 a log). No queue with
-- archive_mode off; NULL while nothing was archived yet (pacing then leaves the signal out).
WITH numbers AS (
  SELECT ('x' || substring(current_wal, 9, 8))::bit(32)::int AS log,
         ('x' || substring(current_wal, 17, 8))::bit(32)::int AS seg,
         ('x' || substring(last_archived_wal, 9, 8))::bit(32)::int AS archived_log,
         ('x' || substring(last_archived_wal, 17, 8))::bit(32)::int AS archived_seg
  FROM pg_stat_archiver, pg_walfile_name(pg_current_wal_insert_lsn()) AS current_wal
)
SELECT CASE WHEN current_setting('archive_mode') = 'off' THEN 0
            ELSE (log - archived_log) * 256 + seg - archived_seg END
FROM numbers
