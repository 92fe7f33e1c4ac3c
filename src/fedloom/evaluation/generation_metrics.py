"""Metrics of the generation task kind: a generated text scored against one reference text.

Per-example metrics score every (prediction, reference) pair on its own and average the
scores over the examples, weighted by the optional example ``weights``:

- ``rouge1``, ``rouge2``, ``rougeL``: the F-measure of ROUGE-1, ROUGE-2 and ROUGE-L (Lin,
  2004, "ROUGE: A package for automatic evaluation of summaries"), as Google's
  ``rouge-score`` computes it with ``RougeScorer([...], use_stemmer=True)``: the text is
  lowercased, every run of characters other than ``a-z0-9`` splits tokens (so punctuation,
  accented letters and non-Latin scripts are dropped: these metrics are for English), and
  the Porter stemmer is applied to tokens longer than 3 characters. ROUGE-N counts the
  clipped n-gram overlap, ROUGE-L the longest common subsequence (``rougeL``, not the
  summary-level ``rougeLsum``); F = 2PR / (P + R). A pair with no tokens on either side
  scores 0.0, the library's convention.
- ``exact_match``: 1.0 when the prediction and the reference are equal after SQuAD v1.1's
  :func:`normalize_answer`, else 0.0 (Rajpurkar et al., 2016, "SQuAD: 100,000+ questions
  for machine comprehension of text", its official evaluation script).
- ``token_f1``: SQuAD's token-overlap F1: the normalized texts split on whitespace,
  precision and recall of their multiset intersection, F = 2PR / (P + R). Where SQuAD v1.1
  scores two empty answers 0.0, fedloom follows the SQuAD v2.0 script: both empty 1.0, one
  empty 0.0. SQuAD takes the maximum over several gold answers; fedloom has one reference.

Corpus-level metrics pool the statistics of every pair before forming the score, as their
definitions require, so they are not means over examples:

- ``bleu``: sacreBLEU's ``corpus_bleu`` (Papineni et al., 2002, "BLEU: a method for
  automatic evaluation of machine translation"; Post, 2018, "A call for clarity in
  reporting BLEU scores"): the geometric mean of the clipped 1- to 4-gram precisions
  summed over the corpus, times the brevity penalty exp(1 - r/c) when the hypotheses'
  length c is below the references' r; ``13a`` tokenization, case-sensitive, ``exp``
  smoothing of zero n-gram counts.
- ``chrf``: sacreBLEU's ``corpus_chrf`` (Popović, 2015, "chrF: character n-gram F-score
  for automatic MT evaluation"): precision and recall of character 1- to 6-grams
  (whitespace removed), averaged over the orders both sides have, combined as F-beta with
  beta = 2.

Every score is on the 0..1 scale: sacreBLEU's 0..100 scores are divided by 100 and
clipped to 0..1 (its floating point can put a perfect BLEU a rounding error above 100).
Corpus-level metrics cannot be weighted by example: with weights that are not all equal
they raise ``ValueError``. No examples leaves every metric undefined: ``None``.

rouge-score (with nltk) and sacreBLEU are imported at the first score, not with fedloom:
rouge-score alone takes about two seconds to import, also in runs that never generate.
"""

from __future__ import annotations

import re
import string
from collections import Counter
from collections.abc import Callable, Sequence
from functools import cache, lru_cache
from typing import Any

import numpy as np

ROUGE_METRICS: tuple[str, ...] = ("rouge1", "rouge2", "rougeL")
"""The ROUGE metrics, in ``rouge-score``'s names."""

CORPUS_METRICS: frozenset[str] = frozenset({"bleu", "chrf"})
"""The corpus-level metrics: no per-example score, no example weights."""

GENERATION_METRICS: frozenset[str] = frozenset(
    {"rouge1", "rouge2", "rougeL", "bleu", "chrf", "exact_match", "token_f1"}
)
"""Every metric :func:`generation_scores` computes."""

_ARTICLES = re.compile(r"\b(a|an|the)\b", re.UNICODE)
_PUNCTUATION = frozenset(string.punctuation)


# SQuAD's normalization and token F1 are written here by hand, following the official
# evaluation scripts line by line: no well-kept library offers them as functions (Hugging
# Face ``evaluate`` loads its copy of the script from the hub).
def normalize_answer(text: str) -> str:
    """SQuAD v1.1's answer normalization: lowercase, remove ASCII punctuation
    (``string.punctuation``), replace the words "a", "an" and "the" with spaces, and join
    the remaining words with single spaces.

    Punctuation goes before articles, as in the official script: "state-of-the-art"
    becomes "stateoftheart". Non-ASCII punctuation (curly quotes, dashes) is kept.
    """
    text = "".join(ch for ch in text.lower() if ch not in _PUNCTUATION)
    return " ".join(_ARTICLES.sub(" ", text).split())


def _exact_match(prediction: str, reference: str) -> float:
    return float(normalize_answer(prediction) == normalize_answer(reference))


def _token_f1(prediction: str, reference: str) -> float:
    """SQuAD's F1 of the normalized tokens; 1.0 when both have none, 0.0 when one has none."""
    predicted = normalize_answer(prediction).split()
    expected = normalize_answer(reference).split()
    if not predicted or not expected:
        return float(predicted == expected)
    same = sum((Counter(predicted) & Counter(expected)).values())
    if same == 0:
        return 0.0
    precision = same / len(predicted)
    recall = same / len(expected)
    return 2 * precision * recall / (precision + recall)


_PAIRWISE: dict[str, Callable[[str, str], float]] = {
    "exact_match": _exact_match,
    "token_f1": _token_f1,
}


class _StemmingTokenizer:
    """rouge-score's default tokenizer with ``use_stemmer=True`` (its ``tokenize`` with
    nltk's ``PorterStemmer()``), with the stems cached: stemming is most of the cost of
    scoring, and a corpus repeats few distinct words."""

    def __init__(self) -> None:
        from nltk.stem.porter import PorterStemmer
        from rouge_score import tokenize

        self._tokenize = tokenize.tokenize
        self.stem = lru_cache(maxsize=1 << 17)(PorterStemmer().stem)

    def tokenize(self, text: str) -> list[str]:
        return list(self._tokenize(text, self))


@cache
def _tokenizer() -> _StemmingTokenizer:
    return _StemmingTokenizer()


@cache
def _rouge_scorer(rouge_types: tuple[str, ...]) -> Any:
    """One ``RougeScorer`` per set of ROUGE metrics, all sharing one stem cache."""
    from rouge_score import rouge_scorer

    return rouge_scorer.RougeScorer(list(rouge_types), tokenizer=_tokenizer())


def _rouge(
    rouge_types: tuple[str, ...], predictions: Sequence[str], references: Sequence[str]
) -> dict[str, np.ndarray]:
    """The per-example F-measure of each of ``rouge_types``, every pair tokenized once."""
    scorer = _rouge_scorer(rouge_types)
    scores = [
        scorer.score(reference, prediction)
        for prediction, reference in zip(predictions, references)
    ]
    return {
        name: np.array([score[name].fmeasure for score in scores], dtype=np.float64)
        for name in rouge_types
    }


def _check_metric(name: str) -> None:
    if name not in GENERATION_METRICS:
        known = ", ".join(sorted(GENERATION_METRICS))
        raise ValueError(f"unknown generation metric {name!r} (known: {known})")


def _check_texts(predictions: Sequence[str], references: Sequence[str]) -> None:
    for what, texts in (("predictions", predictions), ("references", references)):
        if isinstance(texts, str):
            raise TypeError(f"{what} must be a sequence of texts, not one text")
        if not all(isinstance(text, str) for text in texts):
            raise TypeError(f"{what} must all be str")
    if len(predictions) != len(references):
        raise ValueError(
            f"{len(predictions)} predictions and {len(references)} references: "
            "need one reference per prediction"
        )


def per_example(metric: str, predictions: Sequence[str], references: Sequence[str]) -> np.ndarray:
    """The score of each (prediction, reference) pair under a per-example metric (ROUGE,
    ``exact_match``, ``token_f1``), a float64 array as long as ``predictions``.

    ``bleu`` and ``chrf`` raise ``ValueError``: they are defined on a corpus, and sentence
    BLEU or chrF averaged over examples is a different, smoothing-dependent quantity.
    """
    _check_metric(metric)
    if metric in CORPUS_METRICS:
        raise ValueError(f"{metric} is a corpus-level metric: it has no per-example score")
    _check_texts(predictions, references)
    if metric in ROUGE_METRICS:
        return _rouge((metric,), predictions, references)[metric]
    pairwise = _PAIRWISE[metric]
    return np.array([pairwise(p, r) for p, r in zip(predictions, references)], dtype=np.float64)


def _corpus_score(metric: str, predictions: Sequence[str], references: Sequence[str]) -> float:
    import sacrebleu

    hypotheses, streams = list(predictions), [list(references)]
    if metric == "bleu":
        score = sacrebleu.corpus_bleu(hypotheses, streams).score
    else:
        score = sacrebleu.corpus_chrf(hypotheses, streams).score
    # a perfect BLEU comes out as 100.00000000000004 (a sum of logarithms)
    return min(max(float(score) / 100, 0.0), 1.0)


def _check_weights(weights: np.ndarray | None, n: int) -> np.ndarray | None:
    if weights is None:
        return None
    weights = np.asarray(weights, dtype=np.float64)
    if weights.shape != (n,) or np.any(weights < 0) or (n > 0 and weights.sum() <= 0):
        raise ValueError("weights must be non-negative, one per example, not all zero")
    return weights


def generation_scores(
    metrics: Sequence[str],
    predictions: Sequence[str],
    references: Sequence[str],
    weights: np.ndarray | None = None,
) -> dict[str, float | None]:
    """Score generated texts against their references with each of ``metrics`` (names in
    :data:`GENERATION_METRICS`), in the order given, each on the 0..1 scale.

    Per-example metrics are means over the examples, weighted by the non-negative
    ``weights`` (one per example) when given. ``bleu`` and ``chrf`` are corpus-level and
    raise ``ValueError`` with weights that are not all equal. With no examples every
    metric is ``None``. An unknown name raises ``ValueError`` before anything is scored.
    """
    for name in metrics:
        _check_metric(name)
    _check_texts(predictions, references)
    weights = _check_weights(weights, len(predictions))
    if len(predictions) == 0:
        return {name: None for name in metrics}
    if weights is not None and not np.all(weights == weights[0]):
        for name in metrics:
            if name in CORPUS_METRICS:
                raise ValueError(
                    f"{name} is a corpus-level metric and cannot be weighted by example "
                    "(the example weights differ)"
                )
    rouge_types = tuple(name for name in ROUGE_METRICS if name in metrics)
    per_pair = _rouge(rouge_types, predictions, references) if rouge_types else {}
    scores: dict[str, float | None] = {}
    for name in metrics:
        if name in CORPUS_METRICS:
            scores[name] = _corpus_score(name, predictions, references)
            continue
        if name not in per_pair:
            per_pair[name] = per_example(name, predictions, references)
        scores[name] = float(np.average(per_pair[name], weights=weights))
    return scores
