-- The files job's condition, written once: Ci::DeletedObject.ready_for_destruction, pick_up_at < now. Named
-- {{ ready_for_destruction }} by the statements that read due rows.
pick_up_at < :now
