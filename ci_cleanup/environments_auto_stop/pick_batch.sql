-- The next batch (picked.sql), locked until the batch is written: an environment restarted meanwhile (a new
-- deployment pushes auto_stop_at) is re-checked by PostgreSQL and not picked, and none is restarted between its stop
-- actions and its state.
{{ picked }}
FOR UPDATE OF environments
