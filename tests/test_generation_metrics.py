"""Generation metrics against hand-computed values, SQuAD's evaluation rules and the values
published in sacreBLEU's own tests."""

from __future__ import annotations

import math
import subprocess
import sys

import numpy as np
import pytest

from fedloom.evaluation.generation_metrics import (
    GENERATION_METRICS,
    generation_scores,
    normalize_answer,
    per_example,
)

ROUGE = ["rouge1", "rouge2", "rougeL"]


def test_the_metric_names() -> None:
    assert GENERATION_METRICS == {
        "rouge1", "rouge2", "rougeL", "bleu", "chrf", "exact_match", "token_f1"
    }  # fmt: skip


def test_rouge_by_hand() -> None:
    # pred: the cat sat on the mat / ref: the cat is on the mat (no token over 3 letters:
    # nothing is stemmed). Unigrams: the x2, cat, on, mat overlap: P = R = 5/6. Bigrams:
    # "the cat", "on the", "the mat" of 5 each: 3/5. LCS "the cat on the mat": 5/6.
    scores = generation_scores(ROUGE, ["the cat sat on the mat"], ["the cat is on the mat"])
    assert scores == pytest.approx({"rouge1": 5 / 6, "rouge2": 3 / 5, "rougeL": 5 / 6})

    # The same words in another order: ROUGE-1 is 1, 4 of the 5 bigrams survive ("mat the"
    # is lost), and the longest common subsequence is "the cat sat" (or "on the mat"): 3/6.
    scores = generation_scores(ROUGE, ["on the mat the cat sat"], ["the cat sat on the mat"])
    assert scores == pytest.approx({"rouge1": 1.0, "rouge2": 4 / 5, "rougeL": 1 / 2})


def test_rouge_lowercases_drops_punctuation_and_stems() -> None:
    # Tokens: [the, cat, are, run] vs [cat, run] (Porter: cats -> cat, running/runs -> run;
    # "are" has 3 letters and is not stemmed). Overlap 2: P = 2/4, R = 2/2, F = 2PR/(P+R)
    # = 2/3; no shared bigram ("cat are" vs "cat run"); LCS "cat run": F = 2/3 again.
    scores = generation_scores(ROUGE, ["The cats are running!"], ["cat runs"])
    assert scores == pytest.approx({"rouge1": 2 / 3, "rouge2": 0.0, "rougeL": 2 / 3})
    # rouge-score's tokenizer keeps only a-z0-9: two texts without such a character score 0.
    assert per_example("rouge1", ["¿¡!", ""], ["…", ""]).tolist() == [0.0, 0.0]


def test_rouge_stem_cache_matches_the_stock_scorer() -> None:
    """fedloom caches the stems; the scores must stay those of ``use_stemmer=True``."""
    from rouge_score.rouge_scorer import RougeScorer

    predictions = ["Generously running clients adapted their adapters.", "The cats", "x"]
    references = ["A client runs generous adaptations", "cat's cattle", "y y"]
    stock = RougeScorer(ROUGE, use_stemmer=True)
    for metric in ROUGE:
        expected = [stock.score(r, p)[metric].fmeasure for p, r in zip(predictions, references)]
        assert per_example(metric, predictions, references).tolist() == expected


def test_normalize_answer_follows_squad() -> None:
    # SQuAD v1.1's evaluate-v1.1.py: lowercase, drop string.punctuation, drop a/an/the as
    # whole words, single spaces; punctuation goes first, so articles inside hyphenated
    # words stay.
    assert normalize_answer("  The  Big, RED car! ") == "big red car"
    assert normalize_answer("An apple a day; the end.") == "apple day end"
    assert normalize_answer("anthem theatre") == "anthem theatre"
    assert normalize_answer("state-of-the-art") == "stateoftheart"
    assert normalize_answer("Don't") == "dont"
    assert normalize_answer("“Café” — a") == "“café” —"  # non-ASCII punctuation stays


def test_exact_match() -> None:
    scores = per_example(
        "exact_match",
        ["The Eiffel Tower.", "Eiffel Towers", "", "the"],
        ["eiffel tower", "Eiffel Tower", "", ""],
    )
    assert scores.tolist() == [1.0, 0.0, 1.0, 1.0]
    # "a b" is "b" once the article goes; "c d" is not "c".
    assert generation_scores(["exact_match"], ["a b", "c d"], ["b", "c"]) == {"exact_match": 0.5}


def test_token_f1_by_hand() -> None:
    # "big red car" vs "red car": 2 shared, P = 2/3, R = 1, F = 0.8.
    assert per_example("token_f1", ["the big red car"], ["a red car"]).tolist() == [
        pytest.approx(0.8)
    ]
    # Multiset overlap: [red, red, car] & [red, car, car, car] = {red, car}: P = 2/3,
    # R = 2/4, F = 2 * (1/3) / (7/6) = 4/7.
    assert per_example("token_f1", ["red red car"], ["red car car car"])[0] == pytest.approx(4 / 7)
    # Empty answers (the SQuAD v2.0 rule): both empty 1, one empty 0; no overlap 0.
    scores = per_example("token_f1", ["", "The.", "car", "", "car"], ["", "a", "", "car", "bus"])
    assert scores.tolist() == [1.0, 1.0, 0.0, 0.0, 0.0]


def test_bleu_by_hand() -> None:
    # 13a tokens, corpus-level clipped n-gram counts (Papineni et al., 2002):
    #   the cat sat on the mat         | the cat is on the mat
    #   there is a dog in the garden   | there is a big dog in the garden
    # 1-grams 5/6 + 7/7, 2-grams 3/5 + 5/6, 3-grams 1/4 + 3/5, 4-grams 0/3 + 1/4
    # ("dog in the garden"); hypothesis length c = 13, reference length r = 14.
    precisions = [12 / 13, 8 / 11, 4 / 9, 1 / 7]
    expected = math.exp(1 - 14 / 13) * math.exp(sum(map(math.log, precisions)) / 4)
    scores = generation_scores(
        ["bleu"],
        ["the cat sat on the mat", "there is a dog in the garden"],
        ["the cat is on the mat", "there is a big dog in the garden"],
    )
    assert scores["bleu"] == pytest.approx(expected, rel=1e-9)  # 0.4207...
    # sacreBLEU's 100.00000000000004 for a perfect match is clipped to the scale's 1.0.
    assert generation_scores(["bleu"], ["this is a test"], ["this is a test"]) == {"bleu": 1.0}
    assert generation_scores(["bleu"], ["one two three four"], ["five six"]) == {"bleu": 0.0}


def test_chrf_by_hand_and_sacrebleu_published_values() -> None:
    # Character n-grams without whitespace, pooled over the corpus: hypotheses "ab", "x",
    # references "abc", "x". 1-grams: 3 of 3 hypothesis, 3 of 4 reference; 2-grams: "ab"
    # 1 of 1, 1 of 2 ("ab", "bc"); no hypothesis 3-gram, so 2 orders count.
    # P = 1, R = (3/4 + 1/2) / 2 = 5/8, F2 = 5PR / (4P + R) = 25/37 (the mean of the two
    # sentence scores, 7/11 and 1, would be 0.82).
    scores = generation_scores(["chrf"], ["ab", "x"], ["abc", "x"])
    assert scores["chrf"] == pytest.approx(25 / 37, rel=1e-9)
    # sacreBLEU's test/test_chrf.py, test_cases_effective_order (beta = 3 there; these
    # cases have P = R at every order, so any beta gives the same score).
    assert generation_scores(["chrf"], ["a", "b"], ["a", "c"])["chrf"] == pytest.approx(0.5)
    assert generation_scores(["chrf"], ["aa"], ["ab"])["chrf"] == pytest.approx(0.25)
    assert generation_scores(["chrf"], ["a b c"], ["abc"])["chrf"] == pytest.approx(1.0)
    assert generation_scores(["chrf"], ["abcdefg"], ["hijklmnop"]) == {"chrf": 0.0}


def test_scores_are_floats_in_the_order_asked() -> None:
    metrics = ["token_f1", "bleu", "rougeL", "chrf", "exact_match", "rouge1"]
    scores = generation_scores(metrics, ["a cat sat", "dogs"], ["the cat sat", "dogs"])
    assert list(scores) == metrics
    assert all(type(v) is float and 0.0 <= v <= 1.0 for v in scores.values())
    assert scores["exact_match"] == 1.0 and scores["token_f1"] == 1.0


def test_weights() -> None:
    predictions = ["the cat sat on the mat", "a dog", "the cat", "nothing here"]
    references = ["the cat is on the mat", "a dog barked", "the cat", "something"]
    weights = np.array([0.5, 2.0, 1.0, 0.0])
    scores = generation_scores([*ROUGE, "token_f1"], predictions, references, weights)
    for metric in [*ROUGE, "token_f1"]:
        expected = np.average(per_example(metric, predictions, references), weights=weights)
        assert scores[metric] == pytest.approx(expected)
    # exact match of (0, 0, 1, 0) weighted (0.5, 2, 1, 0): 1 / 3.5.
    assert generation_scores(["exact_match"], predictions, references, weights) == {
        "exact_match": pytest.approx(1 / 3.5)
    }


def test_corpus_metrics_refuse_unequal_weights() -> None:
    predictions, references = ["a b c d", "e f"], ["a b c d", "e g"]
    for metric in ["bleu", "chrf"]:
        with pytest.raises(ValueError, match=metric):
            generation_scores(["rouge1", metric], predictions, references, np.array([1.0, 2.0]))
        equal = generation_scores([metric], predictions, references, np.array([3.0, 3.0]))
        assert equal == generation_scores([metric], predictions, references)
        with pytest.raises(ValueError, match="corpus-level"):
            per_example(metric, predictions, references)


def test_bad_weights() -> None:
    for weights in ([1.0], [1.0, -1.0], [0.0, 0.0]):
        with pytest.raises(ValueError, match="weights"):
            generation_scores(["rouge1"], ["a", "b"], ["a", "b"], np.array(weights))


def test_no_examples_leave_every_metric_none() -> None:
    metrics = sorted(GENERATION_METRICS)
    assert generation_scores(metrics, [], []) == dict.fromkeys(metrics)
    assert generation_scores(metrics, [], [], np.array([])) == dict.fromkeys(metrics)
    assert per_example("rouge1", [], []).shape == (0,)


def test_bad_names_and_inputs() -> None:
    with pytest.raises(ValueError, match=r"unknown generation metric 'meteor' \(known: bleu, "):
        generation_scores(["rouge1", "meteor"], [], [])
    with pytest.raises(ValueError, match="unknown generation metric 'rougeLsum'"):
        per_example("rougeLsum", ["a"], ["a"])
    with pytest.raises(ValueError, match="one reference per prediction"):
        generation_scores(["rouge1"], ["a", "b"], ["a"])
    with pytest.raises(TypeError, match="not one text"):
        generation_scores(["rouge1"], "abc", ["a", "b", "c"])
    with pytest.raises(TypeError, match="str"):
        per_example("token_f1", [None], ["a"])  # type: ignore[list-item]


def test_importing_the_module_imports_no_scorer_library() -> None:
    code = (
        "import sys, fedloom.evaluation.generation_metrics; "
        "print(sorted(m for m in ('rouge_score', 'sacrebleu', 'nltk') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
