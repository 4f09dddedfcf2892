"""A vLLM server's ``/metrics`` text, read with its labels (one parser for every caller).

``parse_metrics(text)`` turns Prometheus text exposition into :class:`Metrics`: every
sample line by its *sample* name, with its labels. Parsing is
``prometheus_client.parser.text_string_to_metric_families`` (the library that writes the
text), so names follow what the exporter prints, not the family names:

- a counter ``vllm:nexus_faults`` is read as ``vllm:nexus_faults_total`` (and, where the
  exporter prints it, a separate ``vllm:nexus_faults_created`` series of start times);
- a histogram ``vllm:nexus_request_peak_live_blocks`` as ``..._bucket`` (one sample per
  ``le`` bound, cumulative), ``..._count`` and ``..._sum``;
- a gauge under its own name.

As a ``Mapping[str, float]``, ``metrics[name]`` is the sum over every label set of the
series (all ``kind`` values of a labelled counter, all engines), so a series split by a
label is never read as its first sample only. :meth:`Metrics.total` sums the samples that
match some labels and :meth:`Metrics.by_label` splits a series by one label.

    metrics = parse_metrics(text)
    metrics["vllm:nexus_faults_total"]                 # every kind, every engine
    metrics.total("vllm:nexus_faults_total", kind="plan_lost")
    metrics.by_label("vllm:nexus_faults_total", "kind")  # {"plan_lost": 3.0, ...}
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass

__all__ = ["Metrics", "Sample", "parse_metrics"]


@dataclass(frozen=True)
class Sample:
    """One sample line: its labels (name -> value, as printed) and its value."""

    labels: Mapping[str, str]
    value: float

    def matches(self, label_filter: Mapping[str, object]) -> bool:
        """Whether every label in ``label_filter`` has that value (compared as text)."""
        return all(self.labels.get(k) == str(v) for k, v in label_filter.items())


@dataclass(frozen=True, eq=False)
class Metrics(Mapping[str, float]):
    """Samples of a ``/metrics`` text by sample name; as a mapping, the sum per name.

    Parameters
    ----------
    series : Mapping[str, tuple[Sample, ...]]
        Sample name -> its samples, one per label set, in the text's order (never empty).
    """

    series: Mapping[str, tuple[Sample, ...]]

    def __post_init__(self) -> None:
        empty = sorted(name for name, samples in self.series.items() if not samples)
        if empty:
            raise ValueError(f"series without samples: {empty}")

    # -- Mapping[str, float]: the sum over label sets --------------------------------
    def __getitem__(self, name: str) -> float:
        return sum(s.value for s in self.series[name])

    def __iter__(self) -> Iterator[str]:
        return iter(self.series)

    def __len__(self) -> int:
        return len(self.series)

    def __repr__(self) -> str:
        return f"Metrics({len(self.series)} series)"

    # -- labels -----------------------------------------------------------------------
    def samples(self, name: str, **label_filter: object) -> list[Sample]:
        """The samples of ``name`` whose labels match ``label_filter`` ([] when absent)."""
        return [s for s in self.series.get(name, ()) if s.matches(label_filter)]

    def total(self, name: str, **label_filter: object) -> float:
        """Sum of the samples of ``name`` matching ``label_filter``; 0.0 when none does
        (a labelled counter appears only at its first increment). ``name in metrics``
        tells an absent series from a zero one."""
        return sum(s.value for s in self.samples(name, **label_filter))

    def by_label(self, name: str, label: str, **label_filter: object) -> dict[str, float]:
        """``name`` split by ``label``: label value -> sum of the matching samples with it
        (summed over the other labels; samples without ``label`` are left out)."""
        out: dict[str, float] = {}
        for s in self.samples(name, **label_filter):
            if label in s.labels:
                out[s.labels[label]] = out.get(s.labels[label], 0.0) + s.value
        return out


def parse_metrics(text: str) -> Metrics:
    """Parse Prometheus text exposition (a ``/metrics`` body) into :class:`Metrics`.

    Raises
    ------
    ValueError
        When ``text`` is not valid exposition (prometheus_client's parser says where).
    """
    from prometheus_client.parser import text_string_to_metric_families

    series: dict[str, list[Sample]] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            series.setdefault(s.name, []).append(Sample(dict(s.labels), float(s.value)))
    return Metrics({name: tuple(samples) for name, samples in series.items()})
