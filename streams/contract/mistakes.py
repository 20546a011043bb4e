"""How a mistake in a file read into a pydantic model is said: one line per mistake,
where it is and what was there, an unknown field with the nearest known one (pipeline
files, the deployments file)."""

from __future__ import annotations

import difflib
import types
from typing import Any, Union, get_args, get_origin

from pydantic import BaseModel, ConfigDict, ValidationError

# How every file an operator writes is read into its model (pipeline files, the deployments
# file; the settings are read alike): a field it does not know is refused, the values are
# frozen, and a number is finite — `.inf` in YAML is no price, cap or weight anything here
# computes with (a price of inf made a result's cost null; a traffic weight of inf made the
# split's edges NaN, every task its last version's).
WRITTEN = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


def mistakes_of(exc: ValidationError, model: type[BaseModel]) -> list[str]:
    """One line per mistake in a file read into `model`: where (`versions.v1.params`),
    what is wrong, what was there; an unknown field with the nearest known one."""
    found = []
    for error in exc.errors(include_url=False):
        where = ".".join(str(part) for part in error["loc"]) or "the file"
        message = str(error["msg"]).removeprefix("Value error, ")
        if error["type"] == "extra_forbidden":
            known = _fields_at(model, error["loc"][:-1])
            near = difflib.get_close_matches(str(error["loc"][-1]), known, n=1, cutoff=0.6)
            hint = f"did you mean {near[0]}?" if near else f"known: {', '.join(known)}"
            message = f"unknown field ({hint})" if known else "unknown field"
        elif error["type"] not in ("value_error", "missing", "assertion_error"):
            shown = repr(error.get("input"))
            message += f" (got {shown[:60] + '…' if len(shown) > 60 else shown})"
        found += [f"{where}: {line}" for line in message.splitlines()]
    return found


def _fields_at(model: type[BaseModel], loc: tuple[int | str, ...]) -> list[str]:
    """The field names of the model found at `loc` below `model` (none when it is not one)."""
    kind: Any = model
    for part in loc:
        kind = _model_in(kind)
        if kind is None:
            return []
        field = kind.model_fields.get(str(part))
        # Not a field: a mapping's key or a list's index, below which the same model goes on.
        kind = field.annotation if field is not None else kind
    found = _model_in(kind)
    return sorted(found.model_fields) if found is not None else []


def _model_in(kind: Any) -> type[BaseModel] | None:
    """The model `kind` is, or holds (X | None, dict[str, X], list[X])."""
    if isinstance(kind, type) and issubclass(kind, BaseModel):
        return kind
    if get_origin(kind) in (Union, types.UnionType, dict, list):
        for arg in reversed(get_args(kind)):
            found = _model_in(arg)
            if found is not None:
                return found
    return None


__all__ = ["WRITTEN", "mistakes_of"]
