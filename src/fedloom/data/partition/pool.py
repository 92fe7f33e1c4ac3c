"""What partitioners see of the pooled training data: labels, metadata columns, lengths.

Regression scores (float labels) are put into ``REGRESSION_BINS`` quantile bins wherever a
class is needed (label skew, shards, label statistics); the bin ids ``0..REGRESSION_BINS-1``
then play the role of class ids, and :func:`regression_bin_names` names them.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property

import numpy as np

from ..examples import Example

REGRESSION_BINS = 5


def class_ids(labels: np.ndarray) -> np.ndarray:
    """Class ids as given, or quantile-bin ids (``0..REGRESSION_BINS-1``) for float labels."""
    labels = np.asarray(labels)
    if labels.ndim != 1:
        raise ValueError(f"labels must be 1-D, got shape {labels.shape}")
    if not np.issubdtype(labels.dtype, np.floating):
        return labels
    return np.digitize(labels, _bin_edges(labels))


def _bin_edges(scores: np.ndarray) -> np.ndarray:
    return np.quantile(scores, np.linspace(0, 1, REGRESSION_BINS + 1)[1:-1])


def regression_bin_names(scores: np.ndarray) -> list[str]:
    """Names of the quantile bins of :func:`class_ids`, e.g. ``"[1.2, 2.4)"``."""
    edges = [float(np.min(scores)), *_bin_edges(np.asarray(scores)), float(np.max(scores))]
    names = [f"[{lo:.3g}, {hi:.3g})" for lo, hi in itertools.pairwise(edges)]
    names[-1] = names[-1][:-1] + "]"  # the top bin holds the maximum
    return names


@dataclass(frozen=True, eq=False)
class PartitionPool:
    """The pooled training examples as partitioners see them.

    ``labels``: int class ids, or float scores for regression; ``columns``: per-example
    metadata as str arrays (``Example.meta`` keys, and ``"task"`` for multi-task pools);
    ``lengths``: words per example (``text_a`` + ``text_b``), used by ``feature="length"``.
    """

    labels: np.ndarray
    columns: Mapping[str, np.ndarray]
    lengths: np.ndarray

    def __post_init__(self) -> None:
        n = len(self.labels)
        sizes = {"lengths": len(self.lengths)} | {k: len(v) for k, v in self.columns.items()}
        wrong = {k: size for k, size in sizes.items() if size != n}
        if wrong:
            raise ValueError(f"pool columns must have one entry per label ({n}): {wrong}")

    @classmethod
    def from_examples(cls, examples: Sequence[Example]) -> PartitionPool:
        """Labels (one class, 0, for a generative task's responses), the union of the
        examples' meta keys (missing values ``""``) and word counts."""
        keys = sorted({key for example in examples for key in example.meta})
        columns = {
            key: np.array([example.meta.get(key, "") for example in examples], dtype=str)
            for key in keys
        }
        lengths = np.array(
            [len(e.text_a.split()) + len((e.text_b or "").split()) for e in examples],
            dtype=np.int64,
        )
        # a generative task's labels are responses, not classes: its pool has one class
        labels = [0 if isinstance(e.label, str) else e.label for e in examples]
        return cls(labels=np.array(labels), columns=columns, lengths=lengths)

    def __len__(self) -> int:
        return len(self.labels)

    @property
    def is_regression(self) -> bool:
        return bool(np.issubdtype(np.asarray(self.labels).dtype, np.floating))

    @cached_property
    def classes(self) -> np.ndarray:
        """Class ids of the examples (quantile bins for regression scores)."""
        return class_ids(self.labels)

    def column(self, name: str) -> np.ndarray:
        """Metadata column ``name``; a ValueError lists the available ones."""
        if name not in self.columns:
            available = ", ".join(sorted(self.columns)) or "none"
            raise ValueError(
                f"no metadata column {name!r} in the pool; available: {available} "
                "(or 'length' for text-length bands)"
            )
        return self.columns[name]
