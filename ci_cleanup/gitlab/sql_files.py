"""A batch's statements as ``.sql`` files in its package, so that its rule reads as SQL.

A file names GitLab's tables as GitLab does today (``p_ci_builds``, ``ci_pending_builds``, …) and takes its values
as ``:name`` parameters, never as text. Before it is sent, each table name is replaced by the table this database
has (the flat ``ci_builds`` of an older GitLab, a configured name), quoted as PostgreSQL needs it. Lines that are
only a comment stay in the file for the reader and are not sent.

A column only some GitLab releases have is used on lines that end ``-- if <table>.<column>`` (sent only where the
database has it) or ``-- unless <table>.<column>`` (sent only where it lacks it), e.g. what that release's GitLab
does instead: one file reads right on every release (``docs/gitlab-releases.md``).

A rule's condition is written once, in a file of its own beside the statements (e.g. ``outdated.sql``), and every
statement that needs it names it as ``{{ outdated }}``: the condition's text, without its comment lines, stands
there when the statement is sent (as dbt's ``{{ ref() }}`` reads).
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from importlib import resources

from sqlalchemy import Table, TextClause, text
from sqlalchemy.engine import Dialect

from .schema import GitLabSchema, declared_tables, regclass


@dataclass(frozen=True)
class SqlFile:
    """``<package>/<name>``: one statement of a batch."""

    package: str
    name: str

    @property
    def source(self) -> str:
        """The file as written."""
        return _read(self.package, self.name)

    @property
    def expanded(self) -> str:
        """The file with each ``{{ fragment }}`` replaced by that fragment file's text, its comment lines dropped."""
        return _FRAGMENT.sub(lambda found: _fragment(self.package, found.group(1)), self.source)

    def on(self, schema: GitLabSchema, dialect: Dialect) -> TextClause:
        """The statement for this database's tables, ready for ``conn.execute(statement, parameters)``."""
        return _statement(self, schema, dialect)

    def sent(self, schema: GitLabSchema, dialect: Dialect) -> str:
        """The SQL the driver is handed (parameters in its own style): what a test compares with what was sent."""
        return str(self.on(schema, dialect).compile(dialect=dialect))


@functools.cache
def _read(package: str, name: str) -> str:
    return resources.files(package).joinpath(name).read_text()


_FRAGMENT = re.compile(r"\{\{\s*(\w+)\s*\}\}")


def _fragment(package: str, name: str) -> str:
    """``name.sql`` without its comment lines, its own fragments in place (a condition inside a shared part)."""
    lines = [line for line in _read(package, f"{name}.sql").splitlines() if not line.lstrip().startswith("--")]
    return _FRAGMENT.sub(lambda found: _fragment(package, found.group(1)), "\n".join(lines).strip())


def condition(package: str, name: str, *, pyformat: bool = False) -> str:
    """A rule's condition (``<package>/<name>.sql``) as statements elsewhere use it: the benchmark's hand-written
    floors. ``pyformat``: its ``:parameters`` as psycopg2's ``%(parameter)s``."""
    text = _fragment(package, name)
    return re.sub(r"(?<!:):(\w+)", r"%(\1)s", text) if pyformat else text


@functools.lru_cache(maxsize=64)
def _statement(sql_file: SqlFile, schema: GitLabSchema, dialect: Dialect) -> TextClause:
    return text(render(sql_file.expanded, declared_tables(schema), schema.absent))


_RELEASE_LINE = re.compile(r"--\s*(if|unless)\s+(\w+\.\w+)\s*$")


def _sent(line: str, absent: frozenset[str]) -> bool:
    if line.lstrip().startswith("--"):
        return False
    marked = _RELEASE_LINE.search(line)
    return marked is None or (marked.group(1) == "if") == (marked.group(2) not in absent)


def render(sql: str, tables: dict[str, Table], absent: frozenset[str] = frozenset()) -> str:
    """``sql`` without its comment lines and the lines for the columns ``absent`` (``table.column``) or not, each
    table named as ``tables`` has it (one pass: no name is replaced twice). A name is written as it is, a ``%`` in it
    too: ``text()`` escapes it for the driver, as it does the statement's own."""
    body = "\n".join(line for line in sql.splitlines() if _sent(line, absent)).strip()
    names = {declared: regclass(table) for declared, table in tables.items()}
    pattern = re.compile(r"\b(" + "|".join(map(re.escape, sorted(names, key=len, reverse=True))) + r")\b")
    return pattern.sub(lambda found: names[found.group(1)], body)
