-- Environment.auto_stoppable, counted once a run for the first op: the environments whose auto-stop time has
-- passed (seed 003: available and auto_stop_at before now).
SELECT count(*)
FROM environments
WHERE {{ auto_stoppable }}
