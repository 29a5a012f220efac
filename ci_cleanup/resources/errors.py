"""Why a run cannot use GitLab's servers, each in one line that names the server and never a password.

A resource's start (:func:`starting`) turns these into the run's one-line failure.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from contextlib import contextmanager

import redis
from dagster import ConfigurableResource, InitResourceContext

# Dagster has no public error that carries a message alone: this one, which Dagster raises for an error from
# another process, is printed as its message without the stack traces that would say nothing more here.
from dagster._core.errors import DagsterUserCodeProcessError
from dagster_shared.error import SerializableErrorInfo


class ServiceUnavailable(RuntimeError):
    """PostgreSQL or Redis could not be reached or used; the message names which."""


class AuthenticationFailed(ServiceUnavailable):
    """The server is up and refused the URL's user or password: the credentials, not the server, are to fix."""


class NotConfigured(ServiceUnavailable):
    """Nothing says where a server is: no variable, no resource field, no GitLab config folder."""


class UnusableSetting(ServiceUnavailable):
    """A variable or one of GitLab's config files says where a server is and cannot be used: the setting, not the
    server, is to fix (the message names the variable, or the file and key)."""


# PostgreSQL's "password authentication failed" (also "SCRAM authentication failed") and 'role "x" does not
# exist' (where no password is asked), libpq's "no password supplied", Redis' WRONGPASS ("invalid
# username-password pair") and NOAUTH ("Authentication required").
_AUTHENTICATION = re.compile(
    r'authentication failed|role "[^"]*" does not exist|no password supplied|invalid username-password'
    r"|authentication required", re.I
)


def unreachable(what: str, reason: str) -> ServiceUnavailable:
    """``Cannot reach <what>: <reason>``; or, when the server refused the credentials, that authentication failed
    (the server answered: telling the operator to check that it is up would send them the wrong way)."""
    reason = " ".join(reason.split())
    if _AUTHENTICATION.search(reason):
        return AuthenticationFailed(f"Authentication failed for {what}: {reason}")
    return ServiceUnavailable(f"Cannot reach {what}: {reason}")


@contextmanager
def starting(context: InitResourceContext, resource: ConfigurableResource | None = None) -> Iterator[bool]:
    """A resource's start: whether to connect, and a start that fails for a reason the operator can fix (no URL
    set, a server down, a bad setting: :class:`ServiceUnavailable`) fails the run in that error's one line.

    Dagster would print the error under its stack traces on the console (``dagster job execute``, ``dg launch``, a
    run worker's output), where they say nothing more: the error goes to Dagster as its message alone, the way
    Dagster passes on an error from another process. A run that has finished is not connected again: ``dagster
    job execute`` and ``dg launch`` open its resources once more to read its outputs.
    """
    if context.run is not None and context.run.is_finished:
        yield False
        return
    try:
        yield True
    except ServiceUnavailable as error:
        if isinstance(error, NotConfigured) and resource is not None:
            error = NotConfigured("; ".join([str(error), *_also_not_configured(context, resource)]))
        # Named as the package exports it (ci_cleanup.resources.NotConfigured), not by the module defining it.
        raise one_line_error(f"{__package__}.{type(error).__name__}: {error}", type(error).__name__) from None


def one_line_error(line: str, kind: str) -> DagsterUserCodeProcessError:
    """An error Dagster records and prints as ``line`` alone (the run's failure message, the console, the UI): the way
    it passes on an error from another process, without stack traces that would say nothing more."""
    info = SerializableErrorInfo(f"{line}\n", [], kind)
    return DagsterUserCodeProcessError(line, user_code_process_error_infos=[info])


def _also_not_configured(context: InitResourceContext, resource: ConfigurableResource) -> list[str]:
    """What the run's other GitLab resources lack too: Dagster starts them one at a time and stops at the first that
    fails, so without this an operator would learn one missing variable per launch."""
    missing = []
    for key, definition in (context.all_resource_defs or {}).items():
        kind = getattr(definition, "configurable_resource_cls", None)
        if not hasattr(kind, "check_configured") or isinstance(resource, kind):  # GitLabDatabase, GitLabRedis
            continue
        try:
            kind(**_fields_of_run(context, key, definition)).check_configured()
        except NotConfigured as e:
            missing.append(str(e))
        except (ServiceUnavailable, ValueError):
            pass  # set, though not usable: that resource says so itself when it starts
    return missing


def _fields_of_run(context: InitResourceContext, key: str, definition) -> dict:
    """A resource's fields as the run sets them: bound in code, then the run's config, an EnvVar read."""
    field = definition.config_field
    bound = field.default_value if field is not None and field.default_provided else {}
    run_config = context.dagster_run.run_config if context.dagster_run is not None else {}
    fields = {**bound, **(run_config.get("resources", {}).get(key, {}).get("config") or {})}
    return {k: os.environ.get(v["env"]) if isinstance(v, dict) and "env" in v else v for k, v in fields.items()}


class DatabaseUnavailable(ServiceUnavailable):
    """The GitLab database went away mid-run (server stopped, connection terminated): the run fails."""


class RedisUnavailable(ServiceUnavailable, redis.ConnectionError):
    """A Redis server went away mid-run; still a ``redis.ConnectionError`` for code that handles those."""



class StatementTimeout(RuntimeError):
    """A statement ran over ``statement_timeout_seconds``; PostgreSQL cancelled it (its transaction rolled back)."""


class RedisRefused(ServiceUnavailable, redis.ResponseError):
    """A Redis server answered but would not write (read-only replica, out of memory): says which, and what to do."""
