"""The one Jinja environment of pipeline files: sandboxed (no attribute escapes), strict
(an undefined name is an error, never an empty string)."""

from __future__ import annotations

from jinja2 import StrictUndefined
from jinja2.sandbox import SandboxedEnvironment

ENV = SandboxedEnvironment(undefined=StrictUndefined, autoescape=False, keep_trailing_newline=False)

__all__ = ["ENV"]
