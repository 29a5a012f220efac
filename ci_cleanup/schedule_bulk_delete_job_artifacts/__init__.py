"""``Ci::ScheduleBulkDeleteJobArtifactCronWorker``: bulk deletion of expired job artifacts in Redis buckets, and the
removal of their stored files (``Ci::DeleteObjectsWorker``)."""
