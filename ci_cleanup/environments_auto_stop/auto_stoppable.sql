-- The rule's condition (seed 003), written once: Environment.auto_stoppable, available and past auto_stop_at.
-- Every statement of the batch names it as {{ auto_stoppable }}.
environments.state = 'available' AND environments.auto_stop_at < :now
