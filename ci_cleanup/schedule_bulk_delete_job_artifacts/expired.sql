-- The rule's condition (seed 004), written once: Ci::JobArtifact.expired.non_trace.artifact_unlocked, expired,
-- not a trace (file_type 3) and unlocked (locked 0). Every statement of the batch names it as {{ expired }}.
expire_at < :now AND file_type <> 3 AND locked = 0
