-- The rows of a batch whose stored file could not be removed (a store's error, a refused path), in the batch's
-- transaction: retried later, as Ci::DeleteObjectsService leaves a failed row with pick_up_at = now + RETRY_IN.
UPDATE ci_deleted_objects SET pick_up_at = :retry_at WHERE id = ANY(:ids)
