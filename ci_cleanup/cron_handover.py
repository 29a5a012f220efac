"""Handing GitLab's Sidekiq crons over to ci_cleanup's jobs (``ci-cleanup sidekiq-cron``): which cron each job
replaces, what GitLab's Redis says of each, and switching one off or on again as sidekiq-cron's own
``disable!`` / ``enable!`` would. See docs/moving-from-gitlab-crons.md.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import redis
from dagster import DagsterInstance

from .batches import BY_NAME
from .gitlab import sidekiq_cron
from .gitlab.sidekiq_cron import DISABLED, ENABLED, Entry, UnrecognisedEntry

DOCS = "docs/moving-from-gitlab-crons.md"


@dataclass(frozen=True)
class Handover:
    """A GitLab cron (``Settings.cron_jobs``, config/initializers/1_settings.rb) and the job that does its work."""

    cron: str  # the cron's name: its sidekiq-cron entry is cron_job:<cron>
    klass: str
    schedule: str  # GitLab's default; gitlab.yml's cron_jobs may override it
    job: str
    partly: str | None = None  # what the cron does that the job does not: it must stay enabled

    @property
    def dagster_schedule(self) -> str:
        return BY_NAME[self.job].schedule.name


STUCK_CI_REST = ("StuckCiJobsWorker also drops pending, running and scheduled builds (DropPendingService, "
                 "DropRunningWorker, DropScheduledWorker), which ci_cleanup does not")
SHARED_LEASE = ("its DropCancelingWorker and drop_canceling_builds take the same lease "
                "(ci/stuck_builds/drop_canceling_worker), so running both is safe")

HANDOVERS = (
    Handover("stuck_ci_jobs_worker", "StuckCiJobsWorker", "0 * * * *", "drop_canceling_builds", partly=STUCK_CI_REST),
    Handover("ci_runners_stale_machines_cleanup_worker", "Ci::Runners::StaleMachinesCleanupCronWorker", "36 * * * *",
             "stale_runner_machines_cleanup"),
    Handover("stuck_export_jobs_worker", "StuckExportJobsWorker", "30 * * * *", "stuck_export_jobs"),
    Handover("environments_auto_stop_cron_worker", "Environments::AutoStopCronWorker", "24 * * * *",
             "environments_auto_stop"),
    Handover("ci_schedule_bulk_delete_job_artifact_cron_worker", "Ci::ScheduleBulkDeleteJobArtifactCronWorker",
             "*/30 * * * *", "schedule_bulk_delete_job_artifacts"),
)
BY_CRON = {handover.cron: handover for handover in HANDOVERS}


class Refused(Exception):
    """A change not made, in one line, and what to do."""

    def __init__(self, message: str, hint: str = ""):
        super().__init__(message)
        self.hint = hint


# Dagster's schedules


@dataclass(frozen=True)
class Schedules:
    """The schedules turned on in this instance; ``running`` None when the instance could not be read (``where``
    says why)."""

    running: frozenset[str] | None
    where: str

    def of(self, handover: Handover) -> str:
        if self.running is None:
            return "unknown"
        return "on" if handover.dagster_schedule in self.running else "off"


def dagster_schedules() -> Schedules:
    """The instance DAGSTER_HOME names, read only; unknown without it. Never GitLab's database."""
    home = os.environ.get("DAGSTER_HOME")
    if not home:
        return Schedules(None, "unknown (DAGSTER_HOME is not set)")
    try:
        with DagsterInstance.get() as instance:
            states = instance.all_instigator_state()
    except Exception as error:  # noqa: BLE001  the crons' status does not depend on it; its text may hold a URL
        return Schedules(None, f"unknown (the instance in DAGSTER_HOME={home} cannot be read: {type(error).__name__})")
    running = frozenset(s.instigator_name for s in states if s.instigator_type.value == "SCHEDULE" and s.is_running)
    return Schedules(running, f"as the instance in DAGSTER_HOME={home} has them")


# status


def status_report(client: redis.Redis, where: str, schedules: Schedules) -> list[str]:
    """What ``ci-cleanup sidekiq-cron status`` prints: each replaced cron as Redis holds it, and its job."""
    try:
        sidekiq_cron.refuse_namespaced(client)
        names = sidekiq_cron.registered(client)
    except (UnrecognisedEntry, sidekiq_cron.NamespacedLayout) as error:
        raise Refused(f"{error} (in {where})", f"Nothing was read further; see {DOCS}") from None
    if names is None and not any(client.exists(sidekiq_cron.job_key(h.cron)) for h in HANDOVERS):
        return [f"No sidekiq-cron data in {where}: no {sidekiq_cron.JOBS_KEY} set and none of GitLab's cron entries",
                "  Is it GitLab's Sidekiq Redis (its queues store)? GitLab writes its crons there when Sidekiq boots"]
    lines = [f"GitLab's crons that ci_cleanup replaces, in {where}", f"Dagster schedules: {schedules.where}", ""]
    for handover in HANDOVERS:
        lines += [f"{handover.cron} ({handover.klass})", f"  {_entry_line(client, handover, names)}",
                  f"  ci_cleanup job {handover.job}: its schedule {handover.dagster_schedule} is "
                  f"{schedules.of(handover)}"]
        if handover.partly:
            lines.append(f"  only partly replaced: {handover.partly}; keep this cron enabled ({SHARED_LEASE})")
    lines += ["", f"Switch one off: ci-cleanup sidekiq-cron disable NAME --dry-run, then turn on its job's schedule "
                  f"({DOCS})"]
    return lines


def _entry_line(client: redis.Redis, handover: Handover, names: set[str] | None) -> str:
    try:
        entry = _read(client, handover, names)
    except UnrecognisedEntry as error:
        return f"not recognised, left as it is: {error}"
    if entry is None:
        return "no entry: GitLab writes it again, enabled, when Sidekiq boots"
    cron = entry.cron if entry.cron == handover.schedule else f"{entry.cron} (GitLab's default: {handover.schedule})"
    return f"cron {cron}; {_status(entry)}; last enqueued {entry.last_enqueue_time or 'never'}"


def _status(entry: Entry) -> str:
    if entry.status_field is None:
        return "enabled (no status field: sidekiq-cron counts it as enabled)"
    if entry.status_field in (ENABLED, DISABLED):
        return entry.status_field
    return f"status {entry.status_field!r} (not enabled: sidekiq-cron enqueues only 'enabled')"


def _read(client: redis.Redis, handover: Handover, names: set[str] | None) -> Entry | None:
    entry = sidekiq_cron.read(client, handover.cron, handover.klass)
    if entry is not None and handover.cron not in (names or ()):
        raise UnrecognisedEntry(f"{entry.key} is not in {sidekiq_cron.JOBS_KEY}: sidekiq-cron's poller never runs it")
    return entry


# disable / enable


def change(client: redis.Redis, name: str, action: str, *, where: str, dry_run: bool = False) -> list[str]:
    """``disable`` / ``enable`` the cron ``name`` as sidekiq-cron's ``disable!`` / ``enable!`` (its status field
    only); with ``dry_run``, only what it would change. Anything unexpected is :class:`Refused`, nothing changed."""
    target = DISABLED if action == "disable" else ENABLED
    handover = _replaced(client, name, where)
    if action == "disable" and handover.partly:
        raise Refused(f"{name} stays enabled: {handover.partly}; {SHARED_LEASE}",
                      f"Keep it: drop_canceling_builds and GitLab's cron can both run ({DOCS})")
    try:
        sidekiq_cron.refuse_namespaced(client)
        entry = _read(client, handover, sidekiq_cron.registered(client))
        if entry is None:
            raise Refused(f"No entry {sidekiq_cron.job_key(name)} in {where}: nothing to {action}",
                          "GitLab writes it (enabled) when Sidekiq boots; run ci-cleanup sidekiq-cron status then")
        if entry.status_field == target:
            return [f"{entry.key} is already {target} (in {where}): nothing changed"]
        before = entry.status_field or "no status field (enabled)"
        if dry_run:
            return [f"Dry run: would set {entry.key} status from {before} to {target} (in {where}); nothing changed"]
        sidekiq_cron.set_status(client, entry, target)
    except (UnrecognisedEntry, sidekiq_cron.NamespacedLayout) as error:
        raise Refused(f"{error} (in {where}): nothing changed",
                      "Check the entry in GitLab's admin area (Monitoring > Background jobs > Cron)") from None
    done = f"Set {entry.key} status from {before} to {target} (in {where})"
    if target == DISABLED:
        return [done, f"  GitLab no longer enqueues {handover.klass}; ci_cleanup's {handover.job} does its work "
                      f"once its schedule {handover.dagster_schedule} is on",
                "  Check later that it stays off (ci-cleanup sidekiq-cron status): GitLab EE can enable it again "
                f"({DOCS})"]
    return [done, f"  GitLab enqueues {handover.klass} again at {entry.cron}"]


def _replaced(client: redis.Redis, name: str, where: str) -> Handover:
    """The handover of ``name``; refused for any cron ci_cleanup does not replace, and for an unknown name."""
    if name in BY_CRON:
        return BY_CRON[name]
    replaced = ", ".join(h.cron for h in HANDOVERS)
    if client.exists(sidekiq_cron.job_key(name)):
        raise Refused(f"{name} is not a cron ci_cleanup replaces: it is left as it is",
                      f"ci_cleanup replaces {replaced}")
    raise Refused(f"No cron named {name} in {where}", f"GitLab's crons that ci_cleanup replaces: {replaced}")
