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
    """One sample's value; 0 when the exposition has no such sample."""
    return sample_values(text).get((name, frozenset(labels.items())), 0.0)
