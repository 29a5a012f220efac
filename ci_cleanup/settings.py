"""A setting out of its bounds, refused in one line naming the setting and the bound.

Dagster's config schema has types and no bounds: pydantic's ``Field(ge=…, le=…)`` on a ``Config`` is left out of it,
so the Launchpad and ``dagster job execute`` accept ``batch_size: 0`` and the bound is checked when the op's config
is built, as the op starts and before it reads or writes anything. There pydantic's error is several lines naming
its own types: :class:`BoundedConfig` fails the run with one ``ValueError: …`` line instead, its failure message,
printed without stack traces as a resource's bad setting is (``resources.errors.one_line_error``).
"""

from __future__ import annotations

from dagster import Config
from pydantic import ValidationError

from .resources.errors import one_line_error

# pydantic's error types for Field(ge=, gt=, le=, lt=), and how the bound reads
BOUNDS = {
    "greater_than_equal": ("ge", "at least"),
    "greater_than": ("gt", "more than"),
    "less_than_equal": ("le", "at most"),
    "less_than": ("lt", "less than"),
}


def one_line(error: ValidationError) -> str:
    """``batch_size must be at least 1, not 0``; several settings wrong: each, joined by ``; ``."""
    lines = []
    for detail in error.errors():
        name = ".".join(str(part) for part in detail["loc"]) or error.title
        if detail["type"] in BOUNDS:
            key, words = BOUNDS[detail["type"]]
            lines.append(f"{name} must be {words} {detail['ctx'][key]}, not {detail['input']!r}")
        else:
            lines.append(f"{name}: {detail['msg']}, not {detail['input']!r}")
    return "; ".join(lines)


class BoundedConfig(Config):
    """An op's ``Config`` whose out-of-bounds values fail the run in one line (see the module's docstring), and whose
    fields' descriptions end with their bounds, as the Launchpad shows them (``[at least 1, at most 1000]``)."""

    @classmethod
    def __pydantic_init_subclass__(cls, **kwargs) -> None:
        super().__pydantic_init_subclass__(**kwargs)
        for field in cls.model_fields.values():
            bounds = [f"{words} {getattr(constraint, key)}" for constraint in field.metadata
                      for key, words in BOUNDS.values() if getattr(constraint, key, None) is not None]
            said = f"[{', '.join(bounds)}]"
            if bounds and not (field.description or "").endswith(said):  # a subclass's fields are its base's too
                field.description = f"{field.description or ''} {said}".strip()

    def __init__(self, **data):
        try:
            super().__init__(**data)
        except ValidationError as error:
            raise one_line_error(f"ValueError: {one_line(error)}", "ValueError") from None
