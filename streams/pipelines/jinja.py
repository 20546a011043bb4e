"""The one Jinja environment of pipeline files: sandboxed (no attribute escapes), strict
(an undefined name is an error, never an empty string).

Its templates merge the environment's globals once, not at every render: Jinja walks
a template's globals (a ChainMap) into a new dict and a set on each call, ~7 µs of a
prompt's ~10, and every task renders its prompt and evaluates its review rules.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from jinja2 import StrictUndefined, Template
from jinja2.runtime import Context, new_context
from jinja2.sandbox import SandboxedEnvironment


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

__all__ = ["ENV"]
