"""Feature flags from GitLab's Flipper tables: on when ``feature_gates`` has the boolean gate set to true.

Only instance-wide boolean gates are read; actor and percentage gates do not turn a cron batch on
in GitLab either (its cron workers call ``Feature.enabled?`` with no actor).
"""

from __future__ import annotations

from sqlalchemy import and_, exists, select
from sqlalchemy.engine import Connection

from .schema import GitLabSchema


def feature_enabled(conn: Connection, schema: GitLabSchema, name: str) -> bool:
    gates = schema.feature_gates
    return bool(
        conn.scalar(
            select(
                exists().where(and_(gates.c.feature_key == name, gates.c.key == "boolean", gates.c.value == "true"))
            )
        )
    )
