"""Seed 001: ``Ci::Runners::StaleMachinesCleanupCronWorker``, delete runner machines that stopped contacting."""
