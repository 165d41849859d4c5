"""Reading the Prometheus text format in tests."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families


def sample_values(text: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    """Every sample of an exposition, keyed by (sample name, its labels)."""
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def value(text: str, name: str, **labels: str) -> float:
    """One sample's value; a missing sample is an error, so a metric that disappears fails the test."""
    samples = sample_values(text)
    key = (name, frozenset(labels.items()))
    if key not in samples:
        raise KeyError(f"no sample {name}{labels} in the exposition")
    return samples[key]


def value_or_zero(text: str, name: str, **labels: str) -> float:
    """One sample's value, 0 when absent: for a labelled counter read before its first increment."""
    return sample_values(text).get((name, frozenset(labels.items())), 0.0)
