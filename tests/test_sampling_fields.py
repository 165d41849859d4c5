"""core/sampling_fields.py is the one declaration of the sampling parameters: the REST schema, the OpenAI schemas
and the engine all agree with it, at every bound."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import pytest

from api.openai_schemas import ChatCompletionRequest, CompletionRequest
from api.schemas import SamplingParamsIn
from core.sampling_fields import SAMPLING_FIELDS, Bounds, SamplingField
from engine.sampling_params import SamplingParams

SCALARS = [spec for spec in SAMPLING_FIELDS.values() if spec.max_items is None]
LISTS = [spec for spec in SAMPLING_FIELDS.values() if spec.max_items is not None]


def _beyond(value: int | float, direction: float) -> int | float:
    """The nearest value past a bound: the next integer for ints, the next float for floats."""
    if isinstance(value, int):
        return value + (1 if direction > 0 else -1)
    return math.nextafter(value, direction)


def _edges(bounds: Bounds) -> tuple[list[int | float], list[int | float]]:
    """(values just inside the range, values just outside it) at each of its finite bounds."""
    inside, outside = [], []
    if bounds.low is not None:
        (outside if bounds.low_exclusive else inside).append(bounds.low)
        outside.append(_beyond(bounds.low, -math.inf))
        if bounds.low_exclusive:
            inside.append(_beyond(bounds.low, math.inf))
    if bounds.high is not None:
        inside.append(bounds.high)
        outside.append(_beyond(bounds.high, math.inf))
    return inside, outside


def _with(spec: SamplingField, value: Any) -> dict[str, Any]:
    if spec.max_items is not None:  # a list's bounds are its items'
        return {spec.name: [value]}
    # min_tokens may not exceed max_tokens: give it room
    return {spec.name: value} | ({"max_tokens": max(value, 1)} if spec.name == "min_tokens" else {})


def _items(spec: SamplingField, count: int) -> list[Any] | dict[str, float]:
    """`count` valid items of a list field (of a mapping: token ids as JSON's text keys)."""
    if spec.name == "logit_bias":
        return {str(token_id): 1.0 for token_id in range(count)}
    return ["x" if spec.name in ("stop", "bad_words") else 0] * count


def _accepts(schema: Callable[..., object], params: dict[str, Any]) -> bool:
    try:
        schema(**params)
    except ValueError:  # pydantic's ValidationError is one too
        return False
    return True


def test_every_sampling_parameter_of_the_engine_and_the_service_is_declared() -> None:
    engine_fields = set(SamplingParams.__dataclass_fields__)
    assert set(SAMPLING_FIELDS) == engine_fields == set(SamplingParamsIn.model_fields)


@pytest.mark.parametrize("spec", SAMPLING_FIELDS.values(), ids=lambda spec: spec.name)
def test_the_declared_default_is_the_engines_and_the_services(spec: SamplingField) -> None:
    assert SamplingParamsIn.model_fields[spec.name].default == spec.default
    assert SamplingParams(**{spec.name: spec.default}) == SamplingParams()  # None lists become [] in the engine


@pytest.mark.parametrize("schema", [CompletionRequest, ChatCompletionRequest])
def test_the_openai_schemas_default_to_the_declared_values(schema: type) -> None:
    shared = set(schema.model_fields) & set(SAMPLING_FIELDS) - {"max_tokens", "logprobs"}  # OpenAI's own meaning
    assert shared, "the OpenAI schemas carry sampling fields"
    for name in shared:
        assert schema.model_fields[name].default == SAMPLING_FIELDS[name].default, name


@pytest.mark.parametrize(("side", "schema"), [("service", SamplingParamsIn), ("engine", SamplingParams)])
@pytest.mark.parametrize("spec", SCALARS, ids=lambda spec: spec.name)
def test_each_side_accepts_its_declared_range_and_nothing_past_it(
    spec: SamplingField, side: str, schema: Callable[..., object]
) -> None:
    inside, outside = _edges(getattr(spec, side))
    assert all(_accepts(schema, _with(spec, value)) for value in inside), inside
    assert not any(_accepts(schema, _with(spec, value)) for value in outside), outside


@pytest.mark.parametrize("spec", SAMPLING_FIELDS.values(), ids=lambda spec: spec.name)
def test_what_the_service_accepts_the_engine_runs(spec: SamplingField) -> None:
    assert spec.engine.contains(spec.service)
    inside, _ = _edges(spec.service)
    assert all(_accepts(SamplingParams, _with(spec, value)) for value in inside), inside


@pytest.mark.parametrize("spec", LISTS, ids=lambda spec: spec.name)
def test_the_service_takes_up_to_the_declared_number_of_list_items(spec: SamplingField) -> None:
    assert _accepts(SamplingParamsIn, {spec.name: _items(spec, spec.max_items)})
    assert not _accepts(SamplingParamsIn, {spec.name: _items(spec, spec.max_items + 1)})
