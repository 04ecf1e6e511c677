"""What the model is told and what the tools accept agree.

Every tool's schema (TOOL_SPECS, generated from its argument Struct) is read
back as the model would: values that satisfy it -- generated from the schema
alone by hypothesis -- must decode with the tool's decoder, and values that
break exactly one of its rules must not.
"""

from __future__ import annotations

import json
from typing import Any

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from harnessd.models import ToolSpec
from harnessd.toolbox import parameters_schema
from harnessd.tools import TOOL_SPECS, TOOLS

SPECS = {spec.name: spec for spec in TOOL_SPECS}
LONGEST = 40
"""Longest string generated for a valid value (bounds above it are checked by the invalid cases)."""


def value_of(schema: dict[str, Any]) -> st.SearchStrategy[Any]:
    """Values valid under ``schema`` (the subset of JSON schema the tools use)."""
    if "enum" in schema:
        return st.sampled_from(schema["enum"])
    kind = schema["type"]
    if kind == "string":
        low = schema.get("minLength", 0)
        high = min(schema.get("maxLength", LONGEST), LONGEST)
        if "pattern" in schema:
            return st.from_regex(schema["pattern"], fullmatch=True).filter(
                lambda text: low <= len(text) <= schema.get("maxLength", len(text))
            )
        return st.text(min_size=low, max_size=max(low, high))
    if kind == "integer":
        return st.integers(schema.get("minimum"), schema.get("maximum"))
    if kind == "number":
        return st.floats(
            schema.get("minimum"), schema.get("maximum"), allow_nan=False, allow_infinity=False
        )
    if kind == "boolean":
        return st.booleans()
    if kind == "object":
        return object_of(schema)
    if kind == "array":
        high = min(schema.get("maxItems", 8), 8)
        return st.lists(
            value_of(schema["items"]), min_size=schema.get("minItems", 0), max_size=high
        )
    raise AssertionError(f"the test does not know schema type {kind!r}")


def object_of(schema: dict[str, Any]) -> st.SearchStrategy[dict[str, Any]]:
    properties = schema.get("properties", {})
    required = set(schema.get("required", ()))
    fixed = {name: value_of(properties[name]) for name in required}
    optional = {name: value_of(sub) for name, sub in properties.items() if name not in required}
    return st.fixed_dictionaries(fixed, optional=optional)


def decodes(tool: str, value: Any) -> bool:
    try:
        TOOLS[tool].decoder.decode(json.dumps(value))
    except msgspec.ValidationError:
        return False
    return True


def minimal(schema: dict[str, Any]) -> dict[str, Any]:
    """A valid object with only the required properties, each at its smallest valid value."""
    out: dict[str, Any] = {}
    for name in schema.get("required", ()):
        sub = schema["properties"][name]
        out[name] = smallest(sub)
    return out


def smallest(schema: dict[str, Any]) -> Any:
    if "enum" in schema:
        return schema["enum"][0]
    kind = schema["type"]
    if kind == "string":
        return "a" * max(1, schema.get("minLength", 0))
    if kind in ("integer", "number"):
        return schema.get("minimum", 0)
    if kind == "boolean":
        return False
    if kind == "array":
        return []
    return minimal(schema)


def breakages(schema: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """(what was broken, an object breaking exactly that) for every rule of ``schema``."""
    base = minimal(schema)
    cases: list[tuple[str, dict[str, Any]]] = [("unknown property", {**base, "zz_unknown": 1})]
    for name in schema.get("required", ()):
        cases.append((f"{name} missing", {k: v for k, v in base.items() if k != name}))
    for name, sub in schema.get("properties", {}).items():
        for why, bad in bad_values(sub):
            cases.append((f"{name}: {why}", {**base, name: bad}))
        if sub.get("type") == "object":
            for why, inner in breakages(sub):
                cases.append((f"{name}.{why}", {**base, name: inner}))
    return cases


def bad_values(schema: dict[str, Any]) -> list[tuple[str, Any]]:
    kind = schema["type"]
    wrong_type = {
        "string": 5,
        "integer": "5",
        "number": "5",
        "boolean": 1,
        "object": ["not", "an", "object"],
        "array": "not an array",
    }
    out: list[tuple[str, Any]] = [("wrong type", wrong_type[kind])]
    if kind == "array":
        out += [(f"item {why}", [bad]) for why, bad in bad_values(schema["items"])]
        if "maxItems" in schema:
            out.append(("too many items", [smallest(schema["items"])] * (schema["maxItems"] + 1)))
    if "enum" in schema:
        out.append(("not in the enum", "zz-not-an-option"))
    if kind == "integer":
        out.append(("not whole", 1.5))
    if "minLength" in schema and schema["minLength"] > 0:
        out.append(("too short", ""))
    if "maxLength" in schema and schema["maxLength"] <= 1 << 20:
        out.append(("too long", "a" * (schema["maxLength"] + 1)))
    if "pattern" in schema:
        out.append(("pattern", "has space!"))
    if "minimum" in schema:
        out.append(("below the minimum", schema["minimum"] - 1))
    if "maximum" in schema:
        out.append(("above the maximum", schema["maximum"] + 1))
    return out


@pytest.mark.parametrize("name", list(SPECS))
def test_values_the_schema_allows_decode(name: str) -> None:
    strategy = object_of(SPECS[name].parameters)

    @settings(max_examples=150, deadline=None)
    @given(strategy)
    def check(value: dict[str, Any]) -> None:
        assert decodes(name, value), value

    check()


@pytest.mark.parametrize("name", list(SPECS))
def test_values_the_schema_forbids_are_refused(name: str) -> None:
    schema = SPECS[name].parameters
    assert decodes(name, minimal(schema))
    cases = breakages(schema)
    assert len(cases) >= 3
    accepted = [why for why, value in cases if decodes(name, value)]
    assert accepted == [], f"{name} accepts values its schema forbids: {accepted}"


@pytest.mark.parametrize("name", list(SPECS))
def test_schemas_are_plain_and_described(name: str) -> None:
    spec: ToolSpec = SPECS[name]
    text = json.dumps(spec.parameters)
    assert "$ref" not in text and "$defs" not in text and "anyOf" not in text
    assert '"title"' not in text
    assert spec.parameters["type"] == "object"
    assert spec.parameters["additionalProperties"] is False
    assert spec.description and spec.description[0].isupper()
    for prop, sub in spec.parameters["properties"].items():
        assert sub.get("description"), f"{name}.{prop} has no description"
        assert "type" in sub, f"{name}.{prop} has no type"


def test_every_tool_is_declared_once_and_offered() -> None:
    assert [spec.name for spec in TOOL_SPECS] == list(TOOLS)
    assert len(TOOLS) == 13
    for name, entry in TOOLS.items():
        assert entry.spec.parameters == parameters_schema(entry.args)
        assert entry.spec.name == name


def test_the_schema_keeps_a_property_named_like_a_keyword() -> None:
    class Odd(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
        """Odd."""

        title: str
        default: int | None = None

    schema = parameters_schema(Odd)
    assert set(schema["properties"]) == {"title", "default"}
    assert schema["properties"]["default"] == {"type": "integer"}
    assert schema["required"] == ["title"]
