"""Task registry: label sets, verbalizers, metrics and prompts of the supported tasks.

The GLUE tasks use the label ids of the Hugging Face ``nyu-mll/glue`` dataset. Six of them
(MRPC, RTE, SST-2, CoLA, STS-B, WNLI) are on disk in ../shared/data; QQP, QNLI and MNLI
load from the hub by name (or from a GLUE directory that has them).
:func:`custom_task` describes plain JSONL/CSV/TSV data sets in the same terms, and
:func:`generation_task` a generative one (a prompt and a reference response per example).
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

CLASSIFICATION_METRICS = frozenset({"accuracy", "balanced_accuracy", "f1", "macro_f1", "matthews"})
REGRESSION_METRICS = frozenset({"pearson", "spearman"})
#: a generative task's metrics: the generated answers' (:mod:`fedloom.evaluation.
#: generation_metrics`) and the reference response's token NLL and perplexity under
#: teacher forcing (no generation)
GENERATION_METRICS = frozenset(
    {"rouge1", "rouge2", "rougeL", "bleu", "chrf", "exact_match", "token_f1", "nll", "perplexity"}
)
#: the generative metrics that need no generated text
TEACHER_FORCED = frozenset({"nll", "perplexity"})


@dataclass(frozen=True)
class TaskSpec:
    """Everything the library needs to know about a task besides its data.

    ``label_names`` and ``verbalizer`` are in label-id order and empty for regression and
    generation; ``verbalizer`` holds the answer words a causal LM is scored on.
    ``hub_config`` is the ``nyu-mll/glue`` configuration name, empty for custom tasks.
    ``generative``: each example's label is a reference response to its prompt.
    """

    name: str
    hub_config: str
    label_names: tuple[str, ...]
    verbalizer: tuple[str, ...]
    metrics: tuple[str, ...]
    main_metric: str
    question: str
    generative: bool = False

    def __post_init__(self) -> None:
        allowed = {
            "classification": CLASSIFICATION_METRICS,
            "regression": REGRESSION_METRICS,
            "generation": GENERATION_METRICS,
        }[self.kind]
        kind = self.kind
        if not self.metrics:
            raise ValueError(f"task {self.name!r}: at least one metric is required")
        unknown = [m for m in self.metrics if m not in allowed]
        if unknown:
            raise ValueError(
                f"task {self.name!r}: metrics {unknown} are not {kind} metrics "
                f"(choose from {sorted(allowed)})"
            )
        if "f1" in self.metrics and self.num_labels != 2:
            raise ValueError(f"task {self.name!r}: 'f1' needs exactly two labels")
        if self.main_metric not in self.metrics:
            raise ValueError(
                f"task {self.name!r}: main_metric {self.main_metric!r} is not one of {self.metrics}"
            )
        if len(self.verbalizer) != len(self.label_names):
            raise ValueError(
                f"task {self.name!r}: {len(self.verbalizer)} verbalizer words for "
                f"{len(self.label_names)} labels"
            )
        if self.generative and self.label_names:
            raise ValueError(f"task {self.name!r}: a generative task has no label names")
        if len(set(self.label_names)) != len(self.label_names):
            raise ValueError(f"task {self.name!r}: duplicate label names {self.label_names}")
        if len(self.label_names) == 1:
            raise ValueError(f"task {self.name!r}: classification needs at least two labels")

    @property
    def kind(self) -> str:
        """``"classification"``, ``"regression"`` or ``"generation"``."""
        if self.generative:
            return "generation"
        return "classification" if self.label_names else "regression"

    @property
    def is_regression(self) -> bool:
        """True when labels are real numbers rather than class ids."""
        return self.kind == "regression"

    @property
    def has_classes(self) -> bool:
        """True when labels are class ids (what label skew, label priors and the majority
        baseline need)."""
        return self.kind == "classification"

    @property
    def num_labels(self) -> int:
        """Number of classes, or 1 (a single output) for regression and generation."""
        return len(self.label_names) or 1

    def parse_label(self, value: Any) -> int | float | str:
        """Turn a raw label (class id, class name, score or response) into this task's
        label type.

        Raises ``ValueError`` describing the bad value.
        """
        if self.generative:
            if not isinstance(value, str):
                raise ValueError(f"response {value!r} is not text")
            if not value.strip():
                raise ValueError("the response is empty")
            return value
        if self.is_regression:
            try:
                score = float(value)
            except (TypeError, ValueError):
                raise ValueError(f"label {value!r} is not a number") from None
            if not math.isfinite(score):
                raise ValueError(f"label {value!r} is not a finite number")
            return score
        if isinstance(value, str) and value in self.label_names:
            return self.label_names.index(value)
        class_id = int_like(value)
        if class_id is None or not 0 <= class_id < self.num_labels:
            raise ValueError(
                f"label {value!r} is neither a class id 0..{self.num_labels - 1} "
                f"nor one of {list(self.label_names)}"
            )
        return class_id


def int_like(value: Any) -> int | None:
    """``value`` as an int if it is an integer or a string of decimal digits, else None."""
    if isinstance(value, bool):
        return None
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, str):
        text = value.strip()
        digits = text[1:] if text[:1] in "+-" else text
        if digits.isdecimal():
            return int(text)
    return None


TASKS: dict[str, TaskSpec] = {
    spec.name: spec
    for spec in (
        TaskSpec(
            name="MRPC",
            hub_config="mrpc",
            label_names=("not_equivalent", "equivalent"),
            verbalizer=("not equivalent", "equivalent"),
            metrics=("accuracy", "f1"),
            main_metric="accuracy",
            question="Do the two sentences mean the same thing?",
        ),
        TaskSpec(
            name="RTE",
            hub_config="rte",
            label_names=("entailment", "not_entailment"),
            verbalizer=("entailment", "not entailment"),
            metrics=("accuracy",),
            main_metric="accuracy",
            question="Does the first sentence entail the second sentence?",
        ),
        TaskSpec(
            name="SST-2",
            hub_config="sst2",
            label_names=("negative", "positive"),
            verbalizer=("negative", "positive"),
            metrics=("accuracy",),
            main_metric="accuracy",
            question="Is the sentiment of the sentence negative or positive?",
        ),
        TaskSpec(
            name="CoLA",
            hub_config="cola",
            label_names=("unacceptable", "acceptable"),
            verbalizer=("unacceptable", "acceptable"),
            metrics=("matthews",),
            main_metric="matthews",
            question="Is the sentence grammatically acceptable?",
        ),
        TaskSpec(
            name="STS-B",
            hub_config="stsb",
            label_names=(),
            verbalizer=(),
            metrics=("pearson", "spearman"),
            main_metric="pearson",
            question="How similar are the two sentences, on a scale from 0 to 5?",
        ),
        TaskSpec(
            name="QQP",
            hub_config="qqp",
            label_names=("not_duplicate", "duplicate"),
            verbalizer=("not duplicate", "duplicate"),
            metrics=("accuracy", "f1"),
            main_metric="accuracy",
            question="Do the two questions ask the same thing?",
        ),
        TaskSpec(
            name="QNLI",
            hub_config="qnli",
            label_names=("entailment", "not_entailment"),
            verbalizer=("entailment", "not entailment"),
            metrics=("accuracy",),
            main_metric="accuracy",
            question="Does the sentence answer the question?",
        ),
        TaskSpec(
            name="MNLI",
            hub_config="mnli",
            label_names=("entailment", "neutral", "contradiction"),
            verbalizer=("entailment", "neutral", "contradiction"),
            metrics=("accuracy",),
            main_metric="accuracy",
            question="Does the first sentence entail, contradict or say nothing about the second?",
        ),
        TaskSpec(
            name="WNLI",
            hub_config="wnli",
            label_names=("not_entailment", "entailment"),
            verbalizer=("not entailment", "entailment"),
            metrics=("accuracy",),
            main_metric="accuracy",
            question="Does the first sentence entail the second sentence?",
        ),
    )
}


def _normalize(name: str) -> str:
    return name.strip().lower().replace("-", "").replace("_", "")


_ALIASES: dict[str, TaskSpec] = {
    _normalize(alias): spec for spec in TASKS.values() for alias in (spec.name, spec.hub_config)
}


def get_task(name: str) -> TaskSpec:
    """Look a GLUE task up by name, ignoring case, dashes and underscores ("sst2", "STS-B")."""
    try:
        return _ALIASES[_normalize(name)]
    except KeyError:
        raise ValueError(f"unknown task {name!r}; known tasks: {', '.join(TASKS)}") from None


def custom_task(
    name: str,
    label_names: Sequence[str] | None = None,
    metrics: Sequence[str] | None = None,
    main_metric: str | None = None,
    verbalizer: Sequence[str] | None = None,
    question: str = "What is the answer?",
) -> TaskSpec:
    """Describe a task for plain JSONL/CSV/TSV data.

    With ``label_names`` it is a classification task (metrics default to accuracy and
    macro-F1, the verbalizer to the label names with underscores as spaces); without, a
    regression task (metrics default to Pearson and Spearman). ``main_metric`` defaults
    to the first metric.
    """
    labels = tuple(label_names or ())
    if metrics is None:
        metrics = ("accuracy", "macro_f1") if labels else ("pearson", "spearman")
    metrics = tuple(metrics)
    words = (
        tuple(verbalizer)
        if verbalizer is not None
        else tuple(label.replace("_", " ") for label in labels)
    )
    return TaskSpec(
        name=name,
        hub_config="",
        label_names=labels,
        verbalizer=words,
        metrics=metrics,
        main_metric=main_metric if main_metric is not None else (metrics[0] if metrics else ""),
        question=question,
    )


def generation_task(
    name: str,
    metrics: Sequence[str] = ("rougeL", "rouge1", "rouge2", "nll"),
    main_metric: str | None = None,
) -> TaskSpec:
    """Describe a generative task: each example a prompt and a reference response; scored
    by ``metrics`` (:data:`GENERATION_METRICS`), ``main_metric`` the first by default."""
    metrics = tuple(metrics)
    return TaskSpec(
        name=name,
        hub_config="",
        label_names=(),
        verbalizer=(),
        metrics=metrics,
        main_metric=main_metric if main_metric is not None else (metrics[0] if metrics else ""),
        question="",
        generative=True,
    )


LabelType = str  # "auto" | "class" | "number"


def infer_label_names(
    values: Sequence[Any], label_type: LabelType = "auto"
) -> tuple[str, ...] | None:
    """The label space of raw labels read from a file: class names, or None for numbers.

    The rule (``label_type = "auto"``): every label an integer (``3``, ``"3"``) -> class ids
    0..max, named ``"0"``..``"max"``; every label a number and some not an integer (``0.5``,
    ``"3.0"``) -> a numeric label (regression); every label a non-numeric string -> class
    names in sorted order. ``"class"`` accepts integers or names only, ``"number"`` numbers
    only. Raises ``ValueError`` saying what to set when the labels fit none of these.
    """
    if not values:
        raise ValueError("no labels to infer the label space from")
    bad = next(
        (
            v
            for v in values
            if isinstance(v, bool) or v is None or not isinstance(v, (str, numbers.Real))
        ),
        _MISSING,
    )
    if bad is not _MISSING:
        raise ValueError(f"label {bad!r} is neither a class name, a class id nor a number")
    maybe = [int_like(v) for v in values]
    ids = [i for i in maybe if i is not None]
    if len(ids) == len(maybe) and label_type != "number":
        negative = min(ids)
        if negative < 0:
            raise ValueError(
                f"class id {negative} is negative; set data.label_names, "
                'or data.label_type = "number" for a numeric label'
            )
        return tuple(str(i) for i in range(max(max(ids) + 1, 2)))
    numeric = [_number(v) for v in values]
    if all(x is not None for x in numeric):
        if label_type == "class":
            example = next(v for v, i in zip(values, maybe) if i is None)
            raise ValueError(
                f'label {example!r} is not a class id (data.label_type = "class"); '
                "set data.label_names to name the classes"
            )
        return None
    if label_type == "number":
        example = next(v for v, x in zip(values, numeric) if x is None)
        raise ValueError(f'label {example!r} is not a number (data.label_type = "number")')
    names = sorted({v for v in values if isinstance(v, str)})
    if any(x is not None for x in numeric):
        text = next(v for v, x in zip(values, numeric) if x is None)
        number = next(v for v, x in zip(values, numeric) if x is not None)
        raise ValueError(
            f"labels mix names ({text!r}) and numbers ({number!r}); set data.label_names "
            "(class ids then index into it)"
        )
    if len(names) < 2:
        raise ValueError(f"only one label ({names[0]!r}); classification needs two or more")
    return tuple(names)


_MISSING = object()


def _number(value: Any) -> float | None:
    if isinstance(value, bool):
        return None
    try:
        number = float(value)
    except (TypeError, ValueError):
        return None
    return number if math.isfinite(number) else None
