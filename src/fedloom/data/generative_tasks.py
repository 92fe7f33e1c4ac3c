"""Built-in generation data sets: a prompt (``text_a``) and a reference response (``label``).

Each generative example is an :class:`Example` with ``text_a`` the whole user prompt,
``text_b`` None, ``label`` the reference response (a string) and ``meta`` string columns
for feature partitions. Each loader returns ``(train, dev)``:

- :func:`wordnet_define`: a word -> its WordNet definition, one example per synset of
  Princeton WordNet 3.0 (read by :mod:`fedloom.data.wordnet`, format ``wndb(5WN)``), with
  a seeded held-out dev split by synset;
- :func:`mrpc_paraphrase`: a sentence -> its paraphrase, the MRPC pairs that GLUE labels
  equivalent (Quality 1), split as GLUE splits them;
- :func:`glue_generate`: a GLUE classification task with the answer word of its label as
  the response.

:data:`GENERATIVE_TASKS` names them, with the folder of ``shared/data`` each reads and its
default metrics; :func:`load_generative` loads one by name.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path

from .examples import Example
from .glue import load_glue
from .holdout import set_aside
from .tasks import get_task
from .wordnet import POS_WORDS, Synset, read_wordnet

#: keys the wordnet-define dev split's permutation with the seed (``[seed, salt]``)
WORDNET_SPLIT_SALT = 0x3D3F


@dataclass(frozen=True)
class WordNetDefineStats:
    """What :func:`wordnet_define` made of a WordNet directory: ``synsets`` read, ``kept``
    (one example each) and ``empty_definition``, the synsets dropped because their gloss
    has no definition before its examples (none in WordNet 3.0)."""

    synsets: int
    kept: int
    empty_definition: int


def _definable(directory: Path) -> tuple[list[Synset], int]:
    synsets = read_wordnet(directory)
    kept = [s for s in synsets if s.definition]
    return kept, len(synsets) - len(kept)


def wordnet_define_stats(directory: Path) -> WordNetDefineStats:
    """The counts behind :func:`wordnet_define` for the WordNet files in ``directory``."""
    kept, dropped = _definable(directory)
    return WordNetDefineStats(len(kept) + dropped, len(kept), dropped)


def wordnet_define(
    directory: Path, seed: int, dev_fraction: float = 0.1
) -> tuple[list[Example], list[Example]]:
    """(train, dev): one example per synset of the WordNet database in ``directory``.

    The prompt is ``Define the {pos} "{word}".``, with ``word`` the synset's first word
    (underscores as spaces) and ``pos`` noun, verb, adjective (satellites included) or
    adverb; the response is the synset's definition (its gloss less the examples, see
    :func:`fedloom.data.wordnet.split_gloss`). ``meta``: ``lexname`` (``noun.animal``),
    ``pos`` (the same word as in the prompt), ``synset`` (the 8-digit offset, unique only
    with ``pos``) and ``word``.

    Synsets with an empty definition are dropped (:func:`wordnet_define_stats` counts
    them). Dev holds ``round(dev_fraction * n)`` of the ``n`` synsets left, drawn by a
    permutation seeded with ``[seed, WORDNET_SPLIT_SALT]``; both lists keep file order.
    """
    if not 0 <= dev_fraction < 1:
        raise ValueError(f"dev_fraction must be in [0, 1), got {dev_fraction}")
    kept, _ = _definable(directory)
    examples = [_define_example(s) for s in kept]
    return set_aside(examples, round(dev_fraction * len(examples)), [seed, WORDNET_SPLIT_SALT])


def _define_example(synset: Synset) -> Example:
    word = synset.words[0].replace("_", " ")
    pos = POS_WORDS[synset.pos]
    return Example(
        text_a=f'Define the {pos} "{word}".',
        text_b=None,
        label=synset.definition,
        meta={
            "lexname": synset.lexname,
            "pos": pos,
            "synset": f"{synset.offset:08d}",
            "word": word,
        },
    )


def mrpc_paraphrase(glue_dir: Path) -> tuple[list[Example], list[Example]]:
    """(train, dev): MRPC's paraphrase pairs (GLUE's ``Quality`` 1, "equivalent") from
    ``glue_dir/MRPC/{train,dev}.tsv``, read by :func:`fedloom.data.load_glue`. The prompt is
    ``Paraphrase this sentence: {#1 String}``, the response ``#2 String``; ``meta`` has
    ``pair``, ``{#1 ID}-{#2 ID}``."""
    spec = get_task("MRPC")
    equivalent = spec.label_names.index("equivalent")

    def pairs(split: str) -> list[Example]:
        return [
            Example(
                text_a=f"Paraphrase this sentence: {e.text_a}",
                text_b=None,
                label=str(e.text_b),
                meta={"pair": f"{e.meta['id1']}-{e.meta['id2']}"},
            )
            for e in load_glue(spec, split, glue_dir)
            if e.label == equivalent
        ]

    return pairs("train"), pairs("dev")


def glue_generate(task_name: str, glue_dir: Path) -> tuple[list[Example], list[Example]]:
    """(train, dev): a GLUE classification task from its TSV files in ``glue_dir``
    (:func:`fedloom.data.load_glue`), as generation.

    The prompt is ``Sentence: {text}`` (``Sentence 1: {a}\\nSentence 2: {b}`` for pairs),
    then ``\\nQuestion: {question}`` and ``\\nAnswer with one of: {w1} / {w2}.`` with the
    task's question and verbalizer words (:data:`fedloom.data.TASKS`); the response is the
    verbalizer word of the label. ``meta`` is the example's plus ``task`` (the GLUE name).
    A regression task (STS-B) raises ``ValueError``.
    """
    spec = get_task(task_name)
    if spec.is_regression:
        raise ValueError(f"{spec.name} is a regression task: it has no answer words to generate")
    options = " / ".join(spec.verbalizer)
    tail = f"\nQuestion: {spec.question}\nAnswer with one of: {options}."

    def convert(e: Example) -> Example:
        if e.text_b is None:
            body = f"Sentence: {e.text_a}"
        else:
            body = f"Sentence 1: {e.text_a}\nSentence 2: {e.text_b}"
        return Example(
            text_a=body + tail,
            text_b=None,
            label=spec.verbalizer[int(e.label)],
            meta={**e.meta, "task": spec.name},
        )

    return (
        [convert(e) for e in load_glue(spec, "train", glue_dir)],
        [convert(e) for e in load_glue(spec, "dev", glue_dir)],
    )


#: the metrics of free-text responses, and of one-word answers
TEXT_METRICS = ("rougeL", "rouge1", "rouge2", "nll")
ANSWER_METRICS = ("exact_match", "nll")


@dataclass(frozen=True)
class GenerativeTask:
    """A built-in generation data set: its ``name``, the folder of ``shared/data`` it reads
    (``data_subdir``: ``"wordnet"`` or ``"glue"``), its default ``metrics`` and
    ``main_metric``, and ``loader(directory, seed) -> (train, dev)``, ``directory`` being
    that folder (the seed matters only where the loader draws a split)."""

    name: str
    data_subdir: str
    metrics: tuple[str, ...]
    main_metric: str
    loader: Callable[[Path, int], tuple[list[Example], list[Example]]]

    def load(self, data_root: Path, seed: int) -> tuple[list[Example], list[Example]]:
        """(train, dev) from ``data_root/data_subdir``, ``data_root`` being ``shared/data``."""
        return self.loader(Path(data_root) / self.data_subdir, seed)


def _unseeded(
    load: Callable[[Path], tuple[list[Example], list[Example]]],
) -> Callable[[Path, int], tuple[list[Example], list[Example]]]:
    return lambda directory, seed: load(directory)


#: the GLUE classification tasks in ``shared/data/glue``
_ON_DISK_GLUE = ("MRPC", "RTE", "SST-2", "CoLA", "WNLI")

GENERATIVE_TASKS: dict[str, GenerativeTask] = {
    task.name: task
    for task in (
        GenerativeTask(
            "wordnet-define",
            "wordnet",
            TEXT_METRICS,
            "rougeL",
            lambda directory, seed: wordnet_define(directory, seed),
        ),
        GenerativeTask(
            "mrpc-paraphrase", "glue", TEXT_METRICS, "rougeL", _unseeded(mrpc_paraphrase)
        ),
        *(
            GenerativeTask(
                f"{glue.lower().replace('-', '')}-generate",
                "glue",
                ANSWER_METRICS,
                "exact_match",
                _unseeded(partial(glue_generate, glue)),
            )
            for glue in _ON_DISK_GLUE
        ),
    )
}


def get_generative_task(name: str) -> GenerativeTask:
    """The entry of :data:`GENERATIVE_TASKS` called ``name`` (case and surrounding spaces
    ignored); ``ValueError`` listing the known names otherwise."""
    try:
        return GENERATIVE_TASKS[name.strip().lower()]
    except KeyError:
        raise ValueError(
            f"unknown generative task {name!r}; known: {', '.join(GENERATIVE_TASKS)}"
        ) from None


def load_generative(name: str, data_root: Path, seed: int) -> tuple[list[Example], list[Example]]:
    """(train, dev) of the generative task ``name`` (:data:`GENERATIVE_TASKS`), reading
    ``data_root`` (``shared/data``: WordNet in ``wordnet/``, GLUE in ``glue/``)."""
    return get_generative_task(name).load(data_root, seed)
