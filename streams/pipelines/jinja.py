"""The one Jinja environment of pipeline files: sandboxed (no attribute escapes), strict
(an undefined name is an error, never an empty string).

`over_record` is the one rule for an expression evaluated over a record's data (a
source's filter, task id and slots, a prompt's templates, a stage's `when`/`input`): a
record's values lead Jinja and Python to any error (`'>=' between str and int`, a
division by zero, an overflow, a recursion), and each is that record's `InvalidInput`
with the reason, never a crash of the agent that evaluates it.

Its templates merge the environment's globals once, not at every render: Jinja walks
a template's globals (a ChainMap) into a new dict and a set on each call, ~7 µs of a
prompt's ~10, and every task renders its prompt and evaluates its review rules.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

from jinja2 import StrictUndefined, Template, TemplateError
from jinja2.runtime import Context, new_context
from jinja2.sandbox import SandboxedEnvironment

from streams.errors import InvalidInput, StreamsError


class _Template(Template):
    def new_context(
        self,
        vars: dict[str, Any] | None = None,  # Jinja's parameter name
        shared: bool = False,
        locals: Mapping[str, Any] | None = None,
    ) -> Context:
        merged: dict[str, Any] | None = self.__dict__.get("_merged_globals")
        if merged is None:
            merged = self._merged_globals = dict(self.globals)
        # As Jinja's: shared, the variables as they are; else the globals under them.
        parent = (vars or {}) if shared else {**merged, **(vars or {})}
        return new_context(self.environment, self.name, self.blocks, parent, True, merged, locals)


ENV = SandboxedEnvironment(undefined=StrictUndefined, autoescape=False, keep_trailing_newline=False)
ENV.template_class = _Template


@contextmanager
def over_record(what: str, code: str, error: type[StreamsError] = InvalidInput) -> Iterator[None]:
    """Evaluate a pipeline file's expression over a record's data: whatever it raises is
    the record's `error` (`what: the error`), never the caller's crash."""
    try:
        yield
    except StreamsError:
        raise
    except Exception as exc:  # the data decides what Python raises: every error is the record's
        raise error(f"{what}: {describe(exc)}", code=code) from exc


def describe(exc: BaseException) -> str:
    """An error as a reader wants it: Jinja's own messages as they are, Python's with the
    exception's name (`TypeError: '>=' not supported ...`)."""
    if isinstance(exc, TemplateError):
        return str(exc)
    return f"{type(exc).__name__}: {exc}"


__all__ = ["ENV", "describe", "over_record"]
