from __future__ import annotations

import copy
import json
import shutil
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import yaml

from streams.errors import ConfigError, InvalidInput
from streams.pipelines.registry import PipelineRegistry
from streams.settings import load_settings

ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture
def registry() -> PipelineRegistry:
    return PipelineRegistry.load(ROOT / "pipelines", ROOT / "schemas")


def test_renders_comment_analysis(registry: PipelineRegistry) -> None:
    version = registry.get("comment-analysis").version(None)
    prompt = version.render({"text": "Great blender", "product": "blender", "rating": 5}, "m")
    assert version.version == "v1"
    assert prompt.model == "m"
    assert prompt.messages[0]["role"] == "system" and "sentiment" in prompt.messages[0]["content"]
    user = prompt.messages[1]["content"]
    assert (
        "<comment>Great blender</comment>" in user and "Product: blender" in user and "5/5" in user
    )
    assert prompt.response_format["type"] == "json_schema"
    assert prompt.response_format["json_schema"]["schema"]["required"]
    assert prompt.params == {"temperature": 0, "max_tokens": 400}


def test_optional_slots_take_defaults(registry: PipelineRegistry) -> None:
    prompt = registry.get("comment-analysis").version("v1").render({"text": "ok"}, "m")
    assert "Product" not in prompt.messages[1]["content"]
    assert prompt.variables == {"text": "ok", "product": "", "rating": None}


@pytest.mark.parametrize(
    ("task_input", "code"),
    [
        ({"body": "x"}, "missing_slot"),
        ({"text": 3}, "slot_type"),
        ({"text": "   "}, "empty_slot"),
        ({"text": "x" * 8001}, "slot_too_long"),
        ({"text": "ok", "rating": True}, "slot_type"),
        ({"text": "ok", "rating": "5"}, "slot_type"),
    ],
)
def test_slot_errors_are_invalid_input(
    registry: PipelineRegistry, task_input: dict, code: str
) -> None:
    with pytest.raises(InvalidInput) as info:
        registry.get("comment-analysis").version(None).render(task_input, "m")
    assert info.value.code == code


def test_unknown_pipeline_and_version(registry: PipelineRegistry) -> None:
    with pytest.raises(InvalidInput) as info:
        registry.get("nope")
    assert info.value.code == "unknown_pipeline" and "comment-analysis" in info.value.message
    with pytest.raises(InvalidInput) as info:
        registry.get("comment-analysis").version("v9")
    assert info.value.code == "unknown_version"


def test_template_sandbox_blocks_attribute_escapes(tmp_path: Path) -> None:
    (tmp_path / "p.yaml").write_text(
        "name: p\ndefault_version: v1\noutput_schema: comment-analysis.output.schema.json\n"
        "versions:\n  v1:\n    system: s\n    template: '{{ text.__class__.__mro__ }}'\n"
        "    slots: {text: {type: string}}\n"
    )
    reg = PipelineRegistry.load(tmp_path, ROOT / "schemas")
    with pytest.raises(InvalidInput) as info:
        reg.get("p").version(None).render({"text": "x"}, "m")
    assert info.value.code == "render_error"


def test_a_template_that_python_refuses_on_the_task_is_a_render_error(tmp_path: Path) -> None:
    (tmp_path / "p.yaml").write_text(
        "name: p\ndefault_version: v1\noutput_schema: comment-analysis.output.schema.json\n"
        "versions:\n  v1:\n    system: s\n    template: '{{ 100 // (text | length - 2) }}'\n"
        "    slots: {text: {type: string}}\n"
    )
    version = PipelineRegistry.load(tmp_path, ROOT / "schemas").get("p").version(None)
    assert version.render({"text": "abcd"}, "m").messages[1]["content"] == "50"
    with pytest.raises(InvalidInput) as info:
        version.render({"text": "ab"}, "m")
    assert info.value.code == "render_error"
    assert "ZeroDivisionError" in info.value.message


@pytest.mark.parametrize(
    ("body", "words"),
    [
        (
            "name: p\ndefault_version: v2\noutput_schema: comment-analysis.output.schema.json\n"
            "versions:\n  v1: {system: s, template: t, slots: {text: {}}}\n",
            "default_version",
        ),
        (
            "name: p\ndefault_version: v1\noutput_schema: missing.json\n"
            "versions:\n  v1: {system: s, template: t, slots: {text: {}}}\n",
            "missing.json",
        ),
        (
            "name: p\ndefault_version: v1\noutput_schema: comment-analysis.output.schema.json\n"
            "versions:\n  v1: {system: s, template: '{{ text', slots: {text: {}}}\n",
            "template",
        ),
        (
            "name: p\ndefault_version: v1\noutput_schema: comment-analysis.output.schema.json\n"
            "versions:\n  v1: {system: s, template: t, slots: {text: {}}, example_input: {}}\n",
            "example_input",
        ),
        (
            "name: p\ndefault_version: v1\noutput_schema: comment-analysis.output.schema.json\n"
            "versions:\n  v1: {system: s, template: t, slots: {n: {type: integer}},\n"
            "       on_context_overflow: {strategy: truncate, slot: n}}\n",
            "on_context_overflow.slot",
        ),
        (": not yaml : [", "p.yaml"),
    ],
)
def test_bad_pipeline_files_stop_the_start(tmp_path: Path, body: str, words: str) -> None:
    (tmp_path / "p.yaml").write_text(body)
    with pytest.raises(ConfigError) as info:
        PipelineRegistry.load(tmp_path, ROOT / "schemas")
    assert words in str(info.value)


def test_settings_find_the_checkout_pipelines() -> None:
    s = load_settings()
    assert (s.pipelines_dir / "comment-analysis.yaml").exists()


def test_a_staged_versions_digest_moves_with_its_stages_definitions(tmp_path: Path) -> None:
    """comment-triage's answer is comment-analysis's prompt plus a reply stage run by
    reply-draft: its digest was comment-analysis's own, and an edit to reply-draft (or to
    the stage's condition) left the results it makes said to be of the same definition."""
    shipped = PipelineRegistry.load(ROOT / "pipelines", ROOT / "schemas")
    triage = shipped.get("comment-triage").version("v1")
    assert triage.digest != shipped.get("comment-analysis").version("v1").digest
    assert triage.own_digest == shipped.get("comment-analysis").version("v1").digest

    def digest(name: str, edit: Any) -> str:
        folder = tmp_path / name
        shutil.copytree(ROOT / "pipelines", folder)
        path = folder / edit[0]
        spec = yaml.safe_load(path.read_text())
        edit[1](spec)
        path.write_text(yaml.safe_dump(spec))
        registry = PipelineRegistry.load(folder, ROOT / "schemas")
        return registry.get("comment-triage").version("v1").digest

    def reword(spec: dict[str, Any]) -> None:
        spec["description"] = "Reworded."

    def template(spec: dict[str, Any]) -> None:
        spec["versions"]["v1"]["template"] += "Sign as the shop.\n"

    def when(spec: dict[str, Any]) -> None:
        spec["stages"][0]["when"] = "output.sentiment == 'negative'"

    assert digest("a", ("reply-draft.yaml", reword)) == triage.digest
    assert digest("b", ("reply-draft.yaml", template)) != triage.digest
    assert digest("c", ("comment-triage.yaml", when)) != triage.digest


def _spec_with(tmp_path: Path, **changes: Any) -> Path:
    spec = yaml.safe_load((ROOT / "pipelines" / "comment-analysis.yaml").read_text())
    v2 = copy.deepcopy(spec["versions"]["v1"])
    v2["system"] += "Be brief.\n"
    spec["versions"]["v2"] = v2
    for key, value in changes.items():
        if key.startswith("v1_"):
            spec["versions"]["v1"][key[3:]] = value
        else:
            spec[key] = value
    folder = tmp_path / "pipelines"
    folder.mkdir(exist_ok=True)
    (folder / "comment-analysis.yaml").write_text(yaml.safe_dump(spec))
    return folder


def test_traffic_split_buckets_each_task_the_same_way_in_proportion(tmp_path: Path) -> None:
    folder = _spec_with(tmp_path, traffic={"v1": 90, "v2": 10})
    pipeline = PipelineRegistry.load(folder, ROOT / "schemas").get("comment-analysis")
    ids = [f"task-{i}" for i in range(100_000)]
    first = [pipeline.version(None, task_id).version for task_id in ids]
    chosen = Counter(first)
    # Within 1 percentage point of the weights over 100,000 ids ...
    assert abs(chosen["v1"] / 100_000 - 0.90) <= 0.01 and chosen["v2"] + chosen["v1"] == 100_000
    assert abs(chosen["v2"] / 100_000 - 0.10) <= 0.01
    # ... and stable per id, also for a freshly loaded registry (another worker).
    again = PipelineRegistry.load(folder, ROOT / "schemas").get("comment-analysis")
    assert [again.version(None, task_id).version for task_id in ids] == first
    # A pinned version wins; without a task id, the default.
    assert pipeline.version("v2", "task-1").version == "v2"
    assert pipeline.version(None).version == "v1"


def test_a_split_naming_unknown_versions_or_with_no_weight_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="not in versions"):
        PipelineRegistry.load(_spec_with(tmp_path, traffic={"v3": 1}), ROOT / "schemas")
    with pytest.raises(ConfigError, match="positive sum"):
        PipelineRegistry.load(_spec_with(tmp_path, traffic={"v1": 0}), ROOT / "schemas")
    with pytest.raises(ConfigError, match=r"traffic\.v1: Input should be a finite number"):
        inf = {"v1": float("inf"), "v2": 1}
        PipelineRegistry.load(_spec_with(tmp_path, traffic=inf), ROOT / "schemas")


@pytest.mark.parametrize(
    ("params", "message"),
    [
        ({"temperature": 0.9, "max_tokens": 40}, "contradict"),
        ({"temperature": 2.5}, "outside 0..2"),
        ({"top_p": 0}, "outside \\(0, 1\\]"),
        ({"max_tokens": 0}, "positive integer"),
        # Another kind of value than the field's (a number quoted in YAML): said with the
        # field, not a TypeError out of the comparison.
        ({"temperature": "0.2"}, "params.temperature '0.2' must be a number"),
        ({"top_p": True}, "params.top_p True must be a number"),
        ({"temperature": float("nan")}, "outside 0..2"),
        ({"max_tokens": True}, "positive integer"),
        ({"max_completion_tokens": 300, "max_tokens": "lots"}, "params.max_tokens 'lots'"),
    ],
)
def test_contradictory_or_out_of_range_parameters_are_refused(
    tmp_path: Path, params: dict[str, Any], message: str
) -> None:
    with pytest.raises(ConfigError, match=message):
        PipelineRegistry.load(_spec_with(tmp_path, v1_params=params), ROOT / "schemas")


def test_doubtful_parameters_load_with_a_warning(tmp_path: Path) -> None:
    folder = _spec_with(tmp_path, v1_params={"temperature": 1.3, "top_p": 0.9, "max_tokens": 400})
    pipeline = PipelineRegistry.load(folder, ROOT / "schemas").get("comment-analysis")
    warnings = pipeline.spec.versions["v1"].warnings()
    assert any("top_p" in w for w in warnings) and any("1.3" in w for w in warnings)


def test_review_flags_low_confidence_and_rule_hits(registry: PipelineRegistry) -> None:
    pipeline = registry.get("comment-analysis")
    happy = {"sentiment": "positive", "confidence": 0.9}
    assert pipeline.review_reasons({"rating": 5, "text": "t"}, happy) == []
    assert pipeline.review_reasons({"rating": 1, "text": "t"}, happy) == ["rating_contradicts"]
    unsure = {"sentiment": "negative", "confidence": 0.2}
    assert pipeline.review_reasons({"rating": 5, "text": "t"}, unsure) == [
        "low_confidence", "rating_contradicts"]  # fmt: skip
    assert pipeline.review_reasons({"rating": None, "text": "t"}, happy) == []


def test_a_review_rule_that_does_not_compile_is_refused(tmp_path: Path) -> None:
    folder = _spec_with(tmp_path, review={"rules": {"broken": "output.sentiment =="}})
    with pytest.raises(ConfigError, match="review rule"):
        PipelineRegistry.load(folder, ROOT / "schemas")


def test_a_pipeline_files_mistakes_are_one_human_line_each(tmp_path: Path) -> None:
    """Not pydantic's dump (input_value=..., a URL): where, what, what was there, and the
    nearest known name for a misspelt field."""
    text = (ROOT / "pipelines" / "comment-analysis.yaml").read_text()
    broken = (text.replace("confidence_below: 0.5", "confidence_below: lots\n  confidense_field: x")
                  .replace("response_format: json_schema", "response_format: jsn_schema"))  # fmt: skip
    (tmp_path / "comment-analysis.yaml").write_text(broken)
    with pytest.raises(ConfigError) as info:
        PipelineRegistry.load(tmp_path, ROOT / "schemas")
    lines = str(info.value).splitlines()
    assert lines[0].endswith("comment-analysis.yaml: 3 mistakes:")
    assert lines[1:] == [
        "  review.confidence_below: Input should be a valid number, unable to parse string "
        "as a number (got 'lots')",
        "  review.confidense_field: unknown field (did you mean confidence_field?)",
        "  versions.v1.response_format: Input should be 'json_schema', 'json_object', "
        "'schema_in_prompt' or 'tool_call' (got 'jsn_schema')",
    ]
    assert "pydantic" not in str(info.value) and "input_value" not in str(info.value)
    params = text.replace("      temperature: 0\n", "      temprature: 0\n      top_k: 3\n")
    (tmp_path / "comment-analysis.yaml").write_text(params)
    with pytest.raises(ConfigError) as info:
        PipelineRegistry.load(tmp_path, ROOT / "schemas")
    lines = str(info.value).splitlines()
    assert lines[1].startswith("  versions.v1: params.temprature is no Chat Completions")
    assert lines[2].startswith("  versions.v1: params.top_k is a server's own")


@pytest.mark.parametrize(
    ("ref", "words"),
    [
        ("#/$defs/Nope", "/$defs/Nope"),  # a definition misnamed
        ("https://example.com/a.json", "https://example.com/a.json"),  # fetched at each start
    ],
)
def test_an_output_schema_whose_ref_does_not_resolve_within_it_is_refused(
    tmp_path: Path, ref: str, words: str
) -> None:
    """Once the Rust validator's own error out of the load (a traceback at the start and
    in every command reading the pipelines); a schema elsewhere was fetched over the
    network at each start, where the validator that writes the errors fetches nothing."""
    schemas = tmp_path / "schemas"
    shutil.copytree(ROOT / "schemas", schemas)
    (schemas / "x.json").write_text(json.dumps({
        "type": "object", "properties": {"a": {"$ref": ref}}, "required": ["a"],
    }))  # fmt: skip
    (tmp_path / "p.yaml").write_text(
        "name: p\ndefault_version: v1\noutput_schema: x.json\n"
        "versions:\n  v1: {system: s, template: t, slots: {text: {}}}\n"
    )
    with pytest.raises(ConfigError) as info:
        PipelineRegistry.load(tmp_path, schemas)
    assert "x.json" in str(info.value) and words in str(info.value)
    assert "$ref" in str(info.value)


def test_a_versions_digest_moves_with_what_makes_its_answers_and_nothing_else(
    tmp_path: Path, registry: PipelineRegistry
) -> None:
    """The file as shipped, rewritten by a YAML dump (keys in another order, comments
    gone) and with another description: the same digest. Its template, a parameter or
    its output schema edited in place: another."""
    shipped = registry.get("comment-analysis").version("v1").digest

    def digest(folder: Path, schemas: Path = ROOT / "schemas") -> str:
        return PipelineRegistry.load(folder, schemas).get("comment-analysis").version("v1").digest

    for name in "abcd":
        (tmp_path / name).mkdir()
    assert digest(_spec_with(tmp_path / "a", description="Reworded.")) == shipped
    assert len(shipped) == 16 and int(shipped, 16) >= 0
    template = yaml.safe_load((ROOT / "pipelines" / "comment-analysis.yaml").read_text())
    template = template["versions"]["v1"]["template"] + "Answer in English.\n"
    assert digest(_spec_with(tmp_path / "b", v1_template=template)) != shipped
    assert digest(_spec_with(tmp_path / "c", v1_params={"temperature": 0.2})) != shipped
    schemas = tmp_path / "schemas"
    shutil.copytree(ROOT / "schemas", schemas)
    path = schemas / "comment-analysis.output.schema.json"
    schema = json.loads(path.read_text())
    schema["properties"]["summary"]["maxLength"] = 100
    path.write_text(json.dumps(schema))
    assert digest(_spec_with(tmp_path / "d"), schemas) != shipped
