-- The rule's condition (seed 001), written once: Ci::RunnerManager.stale, created and last contacted (or never
-- contacted) at or before the deadline. Every statement of the batch names it as {{ stale }}.
created_at <= :deadline AND (contacted_at IS NULL OR contacted_at <= :deadline)
