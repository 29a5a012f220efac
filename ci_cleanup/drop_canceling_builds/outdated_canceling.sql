-- The rule's condition (seed 000), written once: Ci::Build.canceling.created_at_before(1.hour.ago)
-- .updated_at_before(1.hour.ago), both strict. Every statement of the batch names it as {{ outdated_canceling }}.
type = 'Ci::Build' AND status = 'canceling' AND created_at < :cutoff AND updated_at < :cutoff
