"""Feature flags as GitLab's ``Feature.enabled?(name, :instance)`` decides them (``lib/feature.rb``).

A flag stored in ``features`` (``Feature.persisted_name?``), or one whose definition says ``default_enabled: false``,
is decided by its gates in ``feature_gates``: on with the boolean gate true or the instance as an actor
(``FlipperGitlabInstance:<host>``), unless the instance opted out. A flag not stored takes its definition's
``default_enabled``. The gates are read by each job's SQL (the defaults bound); this module finds the defaults:

1. the definition file GitLab ships, ``config/feature_flags/<type>/<name>.yml`` (or ``ee/config/…``) under GitLab's
   Rails folder, when it can be read (``CI_CLEANUP_GITLAB_RAILS_DIR``; Omnibus' folder where it exists); a flag
   without a file is off there, as GitLab's ``Feature::Definition`` has it in production;
2. else :data:`RELEASE_DEFAULTS`, the default GitLab's own files have at each vendored release.

An operator can turn a flag on for ci_cleanup alone (GitLab's own worker stays as GitLab decides):
``CI_CLEANUP_FEATURE_FLAGS_ON=<name>,…``, or the job's op config. A run's metadata says which decided:
``gate``, ``definition``, ``release_default`` or ``ci_cleanup``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import yaml

RAILS_DIR_ENV = "CI_CLEANUP_GITLAB_RAILS_DIR"
OMNIBUS_RAILS_DIR = Path("/opt/gitlab/embedded/service/gitlab-rails")
FLAGS_ON_ENV = "CI_CLEANUP_FEATURE_FLAGS_ON"
GATE, DEFINITION, RELEASE_DEFAULT, CI_CLEANUP = "gate", "definition", "release_default", "ci_cleanup"

# default_enabled in gitlabhq/gitlabhq's config/feature_flags at each vendored release (docs/gitlab-releases.md has
# the table and the files read). Both flags came in 18.8 (milestone '18.8', default_enabled: false); a release
# before had no such flag (off: an undefined flag's default in production). An unknown release: the newest's.
RELEASE_DEFAULTS = {
    "bulk_delete_job_artifacts": {"16.0": False, "17.x": False, "18.x": False, "18.y": False, "19.x": False},
    "bulk_delete_job_artifacts_high_concurrency": {
        "16.0": False, "17.x": False, "18.x": False, "18.y": False, "19.x": False},
}


class FlagDefinitionError(ValueError):
    """A definition file GitLab's Rails folder holds cannot be used; the message names the file."""


@dataclass(frozen=True)
class FlagDefault:
    """A flag's ``default_enabled`` and where it was found (:data:`DEFINITION` or :data:`RELEASE_DEFAULT`)."""

    enabled: bool
    source: str
    definition: str | None = None  # the file read, or None


def rails_dir() -> Path | None:
    """GitLab's Rails folder: ``CI_CLEANUP_GITLAB_RAILS_DIR`` (it must be a folder), else Omnibus' where it exists."""
    given = os.environ.get(RAILS_DIR_ENV, "").strip()
    if given:
        path = Path(given)
        if not path.is_dir():
            raise FlagDefinitionError(f"{RAILS_DIR_ENV}={given} is not a folder that can be read")
        return path
    return OMNIBUS_RAILS_DIR if OMNIBUS_RAILS_DIR.is_dir() else None


def definition_file(rails: Path, name: str) -> Path | None:
    """The flag's definition under ``rails`` (``Feature::Definition.paths``: CE's, then EE's), None if it has none."""
    for root in (rails / "config" / "feature_flags", rails / "ee" / "config" / "feature_flags"):
        found = sorted(root.glob(f"*/{name}.yml"))
        if found:
            return found[0]
    return None


def read_definition(path: Path) -> bool:
    """``default_enabled`` of one definition file; one line naming the file when it cannot be used."""
    try:
        definition = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as e:
        reason = e.strerror if isinstance(e, OSError) and e.strerror else type(e).__name__
        raise FlagDefinitionError(f"{path}: cannot be read ({reason})") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" (line {mark.line + 1})" if mark is not None else ""
        raise FlagDefinitionError(f"{path}: does not parse as YAML{where}") from None
    value = definition.get("default_enabled") if isinstance(definition, dict) else None
    if not isinstance(value, bool):
        raise FlagDefinitionError(f"{path}: default_enabled is not true or false")
    return value


def default_enabled(name: str, release_like: list[str], rails: Path | None) -> FlagDefault:
    """The flag's default: its definition under ``rails`` when given, else the release's (:data:`RELEASE_DEFAULTS`;
    ``release_like``: the vendored releases the database is like, ``Release.metadata``)."""
    if rails is not None:
        path = definition_file(rails, name)
        return FlagDefault(read_definition(path) if path else False, DEFINITION, str(path) if path else None)
    by_release = RELEASE_DEFAULTS[name]
    known = [release for release in release_like if release in by_release]
    return FlagDefault(by_release[known[-1] if known else list(by_release)[-1]], RELEASE_DEFAULT)


def on_for_ci_cleanup(name: str) -> bool:
    """Whether ``CI_CLEANUP_FEATURE_FLAGS_ON`` (names, comma-separated) turns the flag on for ci_cleanup alone."""
    return name in {n.strip() for n in os.environ.get(FLAGS_ON_ENV, "").split(",")}


def decided_by(forced: bool, default: FlagDefault, persisted: bool, gated: bool) -> str:
    """Which decided a flag, as ``Feature.enabled?`` reads it (``persisted``: a row in ``features``; ``gated``: a
    row in ``feature_gates``): a default true holds while the flag is not persisted; a default false leaves it to
    the gates, if it has any."""
    if forced:
        return CI_CLEANUP
    return GATE if persisted or (gated and not default.enabled) else default.source
