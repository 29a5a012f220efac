-- A dry run's next batch: pick_batch.sql without its lock, since a dry run changes nothing, row locks included.
{{ picked }}
