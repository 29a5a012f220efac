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
from .gitlab.sidekiq_cron import DISABLED, ENABLED, Entry, Found, Layout, UnrecognisedEntry

DOCS = "docs/moving-from-gitlab-crons.md"


@dataclass(frozen=True)
class Handover:
    """A GitLab cron (``Settings.cron_jobs``, config/initializers/1_settings.rb) and the job that does its work."""

    cron: str  # the cron's name: its sidekiq-cron entry is cron_job:<cron> (1.x) or cron_job:<namespace>:<cron>
    klass: str
    schedule: str  # GitLab's default; gitlab.yml's cron_jobs may override it
    job: str
    partly: str | None = None  # what the cron does that the job does not: it must stay enabled
    caution: str | None = None  # what to check before switching it off
    where_present: bool = False  # a cron only some releases have: shown only where its entry exists

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
    Handover("ci_schedule_delete_objects_worker", "Ci::ScheduleDeleteObjectsCronWorker", "*/16 * * * *",
             "delete_expired_artifact_files",
             caution="delete_expired_artifact_files must run with this installation's storage settings (object "
                     "storage too: its dry run leaves no due file behind)"),
    Handover("expire_build_artifacts_worker", "ExpireBuildArtifactsWorker", "*/7 * * * *",
             "schedule_bulk_delete_job_artifacts", where_present=True,
             caution="GitLab expires artifacts with it where its bulk worker does not run (before 18.8, or "
                     "bulk_delete_job_artifacts off); schedule_bulk_delete_job_artifacts replaces it only while that "
                     "flag is on for it: its dry run must show would_… counts"),
)
BY_CRON = {handover.cron: handover for handover in HANDOVERS}


@dataclass(frozen=True)
class Related:
    """A GitLab cron beside the hand-over: not replaced, shown where its entry exists."""

    cron: str
    klass: str
    note: str


RELATED = (
    Related("drop_timed_out_worker", "Ci::TimedOutBuilds::DropTimedOutWorker",
            "not replaced: it drops builds past their timeout; with the flag enforce_job_timeouts_on_canceling_jobs "
            "on it also drops canceling builds past it (Ci::TimedOutBuilds::DropCancelingService), beside "
            "drop_canceling_builds"),
)


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
        found = sidekiq_cron.layout(client)
    except UnrecognisedEntry as error:
        raise Refused(f"{error} (in {where})", f"Nothing was read further; see {DOCS}") from None
    if found.empty and not any(client.exists(sidekiq_cron.job_key(h.cron)) for h in HANDOVERS):
        sets = f"{sidekiq_cron.JOBS_KEY} or {sidekiq_cron.jobs_key('<namespace>')}"
        return [f"No sidekiq-cron data in {where}: no {sets} set and none of GitLab's cron entries",
                "  Is it GitLab's Sidekiq Redis (its queues store)? GitLab writes its crons there when Sidekiq boots"]
    lines = [f"GitLab's crons that ci_cleanup replaces, in {where}", f"sidekiq-cron's layout: {_layout_line(found)}",
             f"Dagster schedules: {schedules.where}", ""]
    for handover in HANDOVERS:
        entry_lines = _entry_lines(client, found, handover.cron, handover.klass, handover.schedule)
        if handover.where_present and entry_lines is None:
            continue
        lines += [f"{handover.cron} ({handover.klass})", *(entry_lines or [f"  {NO_ENTRY}"]),
                  f"  ci_cleanup job {handover.job}: its schedule {handover.dagster_schedule} is "
                  f"{schedules.of(handover)}"]
        if handover.partly:
            lines.append(f"  only partly replaced: {handover.partly}; keep this cron enabled ({SHARED_LEASE})")
        if handover.caution:
            lines.append(f"  before switching it off: {handover.caution}")
    for related in RELATED:
        entry_lines = _entry_lines(client, found, related.cron, related.klass, None)
        lines += [f"{related.cron} ({related.klass})", *entry_lines, f"  {related.note}"] if entry_lines else []
    lines += ["", f"Switch one off: ci-cleanup sidekiq-cron disable NAME --dry-run, then turn on its job's schedule "
                  f"({DOCS})"]
    return lines


NO_ENTRY = "no entry: GitLab writes it, enabled, when Sidekiq boots (on releases that have this cron)"


def _layout_line(found: Layout) -> str:
    if not found.namespaces:
        return f"1.x ({sidekiq_cron.JOBS_KEY})"
    spaces = ", ".join(f"{name} ({sidekiq_cron.jobs_key(name)})" for name in found.namespaces)
    pending = (f"; {sidekiq_cron.JOBS_KEY} still lists {len(found.legacy)}, which its poller copies over when it starts"
               if found.legacy else "")
    return f"2.x, namespace {spaces}{pending}"


def _entry_lines(client: redis.Redis, found: Layout, cron: str, klass: str, default: str | None) -> list[str] | None:
    """The entry's lines; None where it has no entry and nothing is amiss."""
    try:
        entries = sidekiq_cron.find(client, found, cron, klass)
    except UnrecognisedEntry as error:
        return [f"  not recognised, left as it is: {error}"]
    orphan = ([f"  {entries.orphan}: left by sidekiq-cron 2.x's migration from 1.x, read by nothing: ignored"]
              if entries.orphan else [])
    entry = entries.entry
    if entry is None:
        return None if not orphan else [f"  {NO_ENTRY}", *orphan]
    shown = entry.cron if default in (None, entry.cron) else f"{entry.cron} (GitLab's default: {default})"
    lines = [f"  cron {shown}; {_status(entry)}; last enqueued {entry.last_enqueue_time or 'never'}"]
    if found.namespaces:
        pending = "" if entry.namespace else f", still in {sidekiq_cron.JOBS_KEY} (not migrated yet)"
        lines.append(f"  entry {entry.key}{pending}")
    lines += [f"  also {old.key}, still in {sidekiq_cron.JOBS_KEY} (not migrated yet): the same status; a change "
              "makes both" for old in entries.entries[1:]]
    return lines + orphan


def _status(entry: Entry) -> str:
    if entry.status_field is None:
        return "enabled (no status field: sidekiq-cron counts it as enabled)"
    if entry.status_field in (ENABLED, DISABLED):
        return entry.status_field
    return f"status {entry.status_field!r} (not enabled: sidekiq-cron enqueues only 'enabled')"


# disable / enable


def change(client: redis.Redis, name: str, action: str, *, where: str, dry_run: bool = False) -> list[str]:
    """``disable`` / ``enable`` the cron ``name`` as sidekiq-cron's ``disable!`` / ``enable!`` (its status field
    only); with ``dry_run``, only what it would change. Anything unexpected is :class:`Refused`, nothing changed."""
    target = DISABLED if action == "disable" else ENABLED
    try:
        found = sidekiq_cron.layout(client)
        handover = _replaced(client, found, name, where)
        if action == "disable" and handover.partly:
            raise Refused(f"{name} stays enabled: {handover.partly}; {SHARED_LEASE}",
                          f"Keep it: drop_canceling_builds and GitLab's cron can both run ({DOCS})")
        entries = sidekiq_cron.find(client, found, name, handover.klass)
        if entries.entry is None:
            raise Refused(f"No entry {_expected_key(found, name)} in {where}: nothing to {action}",
                          "GitLab writes it (enabled) when Sidekiq boots, on releases that have this cron; run "
                          "ci-cleanup sidekiq-cron status then")
        keys = " and ".join(entry.key for entry in entries.entries)
        if all(entry.status_field == target for entry in entries.entries):
            return [f"{keys} is already {target} (in {where}): nothing changed"]
        before = entries.entry.status_field or "no status field (enabled)"
        if dry_run:
            return [f"Dry run: would set {keys} status from {before} to {target} (in {where}); nothing changed"]
        sidekiq_cron.set_status(client, entries.entries, target)
    except UnrecognisedEntry as error:
        raise Refused(f"{error} (in {where}): nothing changed",
                      "Check the entry in GitLab's admin area (Monitoring > Background jobs > Cron)") from None
    return _changed(handover, entries, f"Set {keys} status from {before} to {target} (in {where})", target)


def _changed(handover: Handover, entries: Found, done: str, target: str) -> list[str]:
    if target != DISABLED:
        return [done, f"  GitLab enqueues {handover.klass} again at {entries.entry.cron}"]
    caution = [f"  Before relying on it: {handover.caution}"] if handover.caution else []
    return [done, f"  GitLab no longer enqueues {handover.klass}; ci_cleanup's {handover.job} does its work "
                  f"once its schedule {handover.dagster_schedule} is on", *caution,
            "  Check later that it stays off (ci-cleanup sidekiq-cron status): GitLab EE can enable it again "
            f"({DOCS})"]


def _expected_key(found: Layout, name: str) -> str:
    """Where GitLab's boot writes the entry: 1.x's key, or the one namespace's."""
    return sidekiq_cron.job_key(name, next(iter(found.namespaces)) if len(found.namespaces) == 1 else None)


def _replaced(client: redis.Redis, found: Layout, name: str, where: str) -> Handover:
    """The handover of ``name``; refused for any cron ci_cleanup does not replace, and for an unknown name."""
    if name in BY_CRON:
        return BY_CRON[name]
    replaced = ", ".join(h.cron for h in HANDOVERS)
    namespaces = [None, *found.namespaces]
    if any(client.exists(sidekiq_cron.job_key(name, namespace)) for namespace in namespaces):
        raise Refused(f"{name} is not a cron ci_cleanup replaces: it is left as it is",
                      f"ci_cleanup replaces {replaced}")
    raise Refused(f"No cron named {name} in {where}", f"GitLab's crons that ci_cleanup replaces: {replaced}")
