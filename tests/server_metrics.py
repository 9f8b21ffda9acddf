"""A rollout server's ``/metrics`` in tests: the value of one sample, read with
``prometheus_client``'s own parser."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families


def metric(text: str, name: str, **labels: str) -> float:
    """The sum of ``name``'s samples in the exposition ``text`` whose labels include
    ``labels`` (a gauge without labels: its value)."""
    found = [
        s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())
    ]
    if not found:
        raise KeyError(f"{name} {labels or ''} is not in the server's metrics")
    return sum(found)
