"""GitLab's own configuration files, read as GitLab reads them: ``database.yml`` and the Redis files.

``CI_CLEANUP_GITLAB_CONFIG_DIR`` names the folder that holds them: ``/var/opt/gitlab/gitlab-rails/etc`` on
Omnibus (the files ``gitlab-ctl reconfigure`` writes), ``config/`` of a source install. Only the
``production:`` section is read.

GitLab runs each file through ERB before parsing it; this module does not run Ruby, so a file with ERB
left in it (``<%= ENV['REDIS_PASSWORD'] %>``) is refused, as is a file that cannot be read or YAML that
does not parse. Every error is one line naming the file and the key (or line), never a value from the file:
a value may be a password.
"""

from __future__ import annotations

import re
from pathlib import Path
from urllib.parse import quote

import yaml

ENV_CONFIG_DIR = "CI_CLEANUP_GITLAB_CONFIG_DIR"
SECTION = "production"  # Rails.env of an installed GitLab

# A YAML line's key ("  password: …", "- host: …"): the only part of a line an error may show.
_KEY = re.compile(r"\s*(?:-\s+)?([A-Za-z_][A-Za-z0-9_.-]*)\s*:")
_TLS_PARAMETERS = ("sslmode", "sslrootcert", "sslcert", "sslkey")  # libpq's, as database.yml carries them


class ConfigFileError(ValueError):
    """One of GitLab's files cannot be used; the message names the file and the key, never a value."""


def _key_at(lines: list[str], index: int) -> str:
    """The key written on line ``index`` (0-based), for an error; "line N" when the line holds none."""
    if 0 <= index < len(lines):
        match = _KEY.match(lines[index])
        if match:
            return f"key {match.group(1)} (line {index + 1})"
    return f"line {index + 1}"


def read_yaml(path: Path) -> dict | None:
    """The file's mapping; None when it does not exist (GitLab: the store falls back).

    Refused, naming the file and the key: a file that cannot be read, ERB left in it, YAML that does not
    parse, a document that is not a mapping.
    """
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError) as e:
        reason = e.strerror if isinstance(e, OSError) and e.strerror else type(e).__name__
        raise ConfigFileError(f"{path}: cannot be read ({reason})") from None
    lines = text.splitlines()
    for index, line in enumerate(lines):
        if "<%" in line:
            raise ConfigFileError(
                f"{path}: ERB at {_key_at(lines, index)}; GitLab renders it, ci_cleanup does not: write the value "
                "in the file, or set it in the environment instead"
            )
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = _key_at(lines, mark.line) if mark is not None else "its YAML"
        raise ConfigFileError(f"{path}: YAML does not parse at {where}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigFileError(f"{path}: expected a mapping with a {SECTION}: section, found a {type(data).__name__}")
    return data


def production(path: Path) -> object | None:
    """The file's ``production:`` entry; None when the file or the entry is absent."""
    data = read_yaml(path)
    return None if data is None else data.get(SECTION)


# database.yml


def _text(entry: dict, key: str, path: Path, where: str) -> str | None:
    value = entry.get(key)
    if value is None or value == "":
        return None
    if isinstance(value, bool | dict | list):
        raise ConfigFileError(f"{path}: {where}.{key} is a {type(value).__name__}, expected a string")
    return str(value)


def _database_url(entry: object, path: Path, where: str) -> tuple[str, tuple]:
    """The SQLAlchemy URL of one ``database.yml`` entry, and what says which database it is."""
    if not isinstance(entry, dict):
        raise ConfigFileError(f"{path}: {where} is not a mapping")
    adapter = _text(entry, "adapter", path, where)
    if adapter not in (None, "postgresql", "postgres"):
        raise ConfigFileError(f"{path}: {where}.adapter is {adapter}, expected postgresql")
    database = _text(entry, "database", path, where)
    if database is None:
        raise ConfigFileError(f"{path}: {where}.database is missing")
    host = _text(entry, "host", path, where) or _text(entry, "socket", path, where)
    port = entry.get("port")
    if port not in (None, "") and not (str(port).isdigit() and 0 < int(port) < 65536):
        raise ConfigFileError(f"{path}: {where}.port is not a port number")
    port = int(port) if port not in (None, "") else None
    username = _text(entry, "username", path, where)
    password = _text(entry, "password", path, where)
    userinfo = ""
    if username is not None or password is not None:
        userinfo = quote(username or "", safe="")
        if password is not None:
            userinfo += ":" + quote(password, safe="")
        userinfo += "@"
    query = {}
    if host is not None and host.startswith("/"):  # a unix-socket folder, as libpq takes it
        query["host"], netloc = host, ""
    else:
        netloc = (host or "") + (f":{port}" if port is not None and host else "")
    if port is not None and not netloc:
        query["port"] = str(port)
    for name in _TLS_PARAMETERS:
        value = _text(entry, name, path, where)
        if value is not None:
            query[name] = value
    rendered = "&".join(f"{k}={quote(v, safe='/')}" for k, v in query.items())
    url = f"postgresql+psycopg2://{userinfo}{netloc}/{quote(database, safe='')}" + (f"?{rendered}" if rendered else "")
    return url, (host or "", port or 5432, database)


def database_urls(config_dir: str | Path) -> tuple[str, str | None]:
    """GitLab's ``main`` and ``ci`` databases from ``<config_dir>/database.yml``, as SQLAlchemy URLs
    (``postgresql+psycopg2://``, user and password percent-encoded, a socket folder as ``?host=``).

    ``ci`` is None when GitLab uses one database: ``production:`` without ``main:`` (the single-database form),
    ``main:`` alone, or a ``ci:`` entry that points at the main database (GitLab writes it with
    ``database_tasks: false``). A ``ci:`` with ``database_tasks: false`` that names another database is
    refused: GitLab would share main's, this would not.
    """
    path = Path(config_dir) / "database.yml"
    section = production(path)
    if section is None:
        missing = "does not exist" if not path.exists() else f"has no {SECTION}: section"
        raise ConfigFileError(f"{path}: {missing}")
    if not isinstance(section, dict):
        raise ConfigFileError(f"{path}: {SECTION} is not a mapping")
    if "main" not in section:
        return _database_url(section, path, SECTION)[0], None
    main, main_is = _database_url(section["main"], path, f"{SECTION}.main")
    if section.get("ci") is None:
        return main, None
    ci, ci_is = _database_url(section["ci"], path, f"{SECTION}.ci")
    if ci_is == main_is:
        return main, None
    if isinstance(section["ci"], dict) and section["ci"].get("database_tasks") is False:
        raise ConfigFileError(
            f"{path}: {SECTION}.ci has database_tasks: false but names another database than {SECTION}.main"
        )
    return main, ci
