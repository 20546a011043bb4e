"""The pipelines' Jinja environment renders what Jinja's own templates render, its
globals merged once instead of at every render."""

from __future__ import annotations

import pytest
from jinja2 import StrictUndefined, UndefinedError
from jinja2.sandbox import SandboxedEnvironment, SecurityError

from streams.pipelines.jinja import ENV

JINJA = SandboxedEnvironment(
    undefined=StrictUndefined, autoescape=False, keep_trailing_newline=False
)

VARIABLES = {"text": "great <b>value</b>", "stars": 4, "n": 3}
CASES = [
    ("{{ text }} ({{ stars }}/5)", VARIABLES),
    ("{% for i in range(n) %}{{ i }},{% endfor %}", VARIABLES),  # a global
    ("{{ range }}", {"range": "shadowed"}),  # a variable named like a global wins
    ("{% set ns = namespace(x=1) %}{{ ns.x + n }}", VARIABLES),
    ("{{ (text | length) > 3 }}", VARIABLES),
]


@pytest.mark.parametrize(("source", "variables"), CASES)
def test_renders_as_jinja_does(source: str, variables: dict[str, object]) -> None:
    template = ENV.from_string(source)
    expected = JINJA.from_string(source).render(**variables)
    assert template.render(**variables) == expected
    assert template.render(variables) == expected  # again: the merged globals are kept


def test_no_variable_is_kept_from_one_render_to_the_next() -> None:
    template = ENV.from_string("{{ text }}")
    assert template.render(text="a") == "a"
    with pytest.raises(UndefinedError):
        template.render()


def test_expressions_evaluate_as_jinjas() -> None:
    rule = "output.confidence < 0.5 and 'refund' in input.text"
    for output in ({"confidence": 0.2}, {"confidence": 0.9}):
        got = ENV.compile_expression(rule)(input={"text": "a refund"}, output=output)
        assert got == JINJA.compile_expression(rule)(input={"text": "a refund"}, output=output)


def test_strict_and_sandboxed_still() -> None:
    with pytest.raises(UndefinedError):
        ENV.from_string("{{ missing }}").render()
    with pytest.raises(SecurityError):
        ENV.from_string("{{ ''.__class__.__mro__ }}").render()
