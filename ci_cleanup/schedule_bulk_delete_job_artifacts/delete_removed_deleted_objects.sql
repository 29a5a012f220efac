-- The rows of a batch whose stored file is gone (removed now, or already missing), in the batch's transaction.
DELETE FROM ci_deleted_objects WHERE id = ANY(:ids)
