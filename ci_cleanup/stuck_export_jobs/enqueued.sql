-- The rule's condition (seed 002), written once: ProjectExportJob's queued (0) or started (1) jobs, whose Sidekiq
-- job may be gone. Every statement of the batch names it as {{ enqueued }}.
status IN (0, 1)
