"""The generation data sets: the WordNet reader (wndb(5WN)), its define task, MRPC's
paraphrases and GLUE classification as generation, and their registry.

The WordNet tests read ``../shared/data/wordnet`` and are skipped without it, or fail where
FEDLOOM_REQUIRE_DATA=1 (as conftest does for GLUE with ``needs_glue``).
"""

from __future__ import annotations

import csv
import os
from collections import Counter
from pathlib import Path

import pytest
from conftest import GLUE_DIR, needs_glue

from fedloom.data import DataError
from fedloom.data.generative_tasks import (
    GENERATIVE_TASKS,
    glue_generate,
    load_generative,
    mrpc_paraphrase,
    wordnet_define,
    wordnet_define_stats,
)
from fedloom.data.wordnet import read_lexnames, read_wordnet, split_gloss

WORDNET_DIR = Path(__file__).resolve().parents[2] / "shared" / "data" / "wordnet"
DATA_FILES = ("data.noun", "data.verb", "data.adj", "data.adv")


@pytest.fixture
def wordnet_dir() -> Path:
    """WORDNET_DIR, once its data files are there; without them the test is skipped, or
    fails where FEDLOOM_REQUIRE_DATA=1."""
    missing = next((WORDNET_DIR / f for f in DATA_FILES if not (WORDNET_DIR / f).is_file()), None)
    if missing is not None:
        why = f"{missing} (WordNet data) not present"
        if os.environ.get("FEDLOOM_REQUIRE_DATA") == "1":
            pytest.fail(f"{why}; FEDLOOM_REQUIRE_DATA=1 requires it", pytrace=False)
        pytest.skip(why)
    return WORDNET_DIR


#: ``@needs_wordnet``: the test reads ../shared/data/wordnet (see the fixture above)
needs_wordnet = pytest.mark.usefixtures("wordnet_dir")


def raw_line(directory: Path, filename: str, offset: str) -> str:
    """The line of ``filename`` for the synset at ``offset``, read without the reader."""
    with (directory / filename).open(encoding="ascii") as handle:
        return next(line for line in handle if line.startswith(offset + " "))


# --- the WordNet reader ---------------------------------------------------------------


@needs_wordnet
def test_readme_counts() -> None:
    synsets = read_wordnet(WORDNET_DIR)
    assert len(synsets) == 117_659
    assert len(read_lexnames(WORDNET_DIR)) == 45
    assert {s.lexname for s in synsets} == {lex.name for lex in read_lexnames(WORDNET_DIR).values()}
    assert Counter(s.pos for s in synsets) == {
        "n": 82_115,
        "v": 13_767,
        "a": 7_463,
        "s": 10_693,
        "r": 3_621,
    }
    # file order: nouns, verbs, adjectives (heads and satellites mixed), adverbs
    ranks = [{"n": 0, "v": 1, "a": 2, "s": 2, "r": 3}[s.pos] for s in synsets]
    assert ranks == sorted(ranks)
    assert (synsets[0].offset, synsets[0].words) == (1740, ("entity",))
    # the README's 32,930 "have example sentences" are the glosses with a double quote
    quoted = set()
    for name in DATA_FILES:
        for line in (WORDNET_DIR / name).read_text(encoding="ascii").splitlines():
            if not line.startswith("  ") and '"' in line.partition(" | ")[2]:
                quoted.add((line[:8], line.split()[2].replace("s", "a")))
    assert len(quoted) == 32_930
    with_examples = {(f"{s.offset:08d}", s.pos.replace("s", "a")) for s in synsets if s.examples}
    assert with_examples < quoted
    # three of them have none: two quote inside parentheses, "(e.g., "he said ...")", and
    # one has a stray closing quote, "a local branch where postal services are available""
    assert quoted - with_examples == {("07138504", "n"), ("07138736", "n"), ("08145553", "n")}
    assert len(with_examples) == 32_927
    assert all(s.definition for s in synsets)
    assert wordnet_define_stats(WORDNET_DIR).empty_definition == 0


@needs_wordnet
def test_dog_by_hand() -> None:
    line = raw_line(WORDNET_DIR, "data.noun", "02084071")
    assert line.startswith("02084071 05 n 03 dog 0 domestic_dog 0 Canis_familiaris 0 023 @")
    lexfile = read_lexnames(WORDNET_DIR)[5]
    assert (lexfile.name, lexfile.category) == ("noun.animal", 1)
    (dog,) = [s for s in read_wordnet(WORDNET_DIR) if s.offset == 2084071 and s.pos == "n"]
    assert dog.lexname == "noun.animal"
    assert dog.words == ("dog", "domestic_dog", "Canis_familiaris")
    assert dog.definition == (
        "a member of the genus Canis (probably descended from the common wolf) that has been "
        "domesticated by man since prehistoric times; occurs in many breeds"
    )
    assert dog.examples == ("the dog barked all night",)
    assert line.partition(" | ")[2].strip() == f'{dog.definition}; "{dog.examples[0]}"'


@needs_wordnet
def test_verb_and_adverb_by_hand() -> None:
    synsets = {(s.pos, s.offset): s for s in read_wordnet(WORDNET_DIR)}
    # a verb line ends its fields with frames ("01 + 11 00"): the counts must add up
    assert raw_line(WORDNET_DIR, "data.verb", "02711114").split(" | ")[0].endswith(" 01 + 11 00")
    close_in = synsets["v", 2711114]
    assert close_in.lexname == "verb.stative"
    assert close_in.words == ("enclose", "hold_in", "confine")
    # the gloss misses an opening quote: close in; darkness enclosed him"
    assert (close_in.definition, close_in.examples) == ("close in", ("darkness enclosed him",))
    line = raw_line(WORDNET_DIR, "data.adv", "00059171")
    assert line.partition(" | ")[2].strip() == (
        'to a very great degree or extent; "I feel a lot better"; "we enjoyed ourselves very '
        'much"; "she was very much interested"; "this would help a great deal"'
    )
    adverb = synsets["r", 59171]
    assert adverb.lexname == "adv.all"
    assert adverb.words == ("a_lot", "lots", "a_good_deal", "a_great_deal", "much", "very_much")
    assert adverb.definition == "to a very great degree or extent"
    assert adverb.examples[0] == "I feel a lot better" and len(adverb.examples) == 4


@needs_wordnet
def test_adjective_markers_and_satellites() -> None:
    cases = {  # offset -> (marked words in the file, words read)
        "00014358": ("abounding 0 galore(ip) 0", ("abounding", "galore")),
        "00019731": ("handy 0 ready_to_hand(p) 0", ("handy", "ready_to_hand")),
        "00020103": ("outback(a) 0 remote 0", ("outback", "remote")),
    }
    synsets = {s.offset: s for s in read_wordnet(WORDNET_DIR) if s.pos in "as"}
    for offset, (marked, words) in cases.items():
        assert f" 00 s 02 {marked} " in raw_line(WORDNET_DIR, "data.adj", offset)
        synset = synsets[int(offset)]
        assert (synset.pos, synset.lexname, synset.words) == ("s", "adj.all", words)
    assert synsets[14358].definition == "existing in abundance"
    assert synsets[14358].examples == ("abounding confidence", "whiskey galore")
    # "inaccessible and sparsely populated;  ": the trailing semicolon goes
    assert (synsets[20103].definition, synsets[20103].examples) == (
        "inaccessible and sparsely populated",
        (),
    )
    assert not any("(" in w for s in read_wordnet(WORDNET_DIR) for w in s.words)


@pytest.mark.parametrize(
    ("gloss", "definition", "examples"),
    [
        ('a b; c; "one"; "two";  ', "a b; c", ("one", "two")),
        (
            'progress (especially in the phrase "make strides"); "they made strides"',
            'progress (especially in the phrase "make strides")',
            ("they made strides",),
        ),
        (
            'to swell, "her face puffed up"; "puffed out"',
            "to swell",
            ("her face puffed up", "puffed out"),
        ),
        ('act of putting: "he sent Smith"', "act of putting", ("he sent Smith",)),
        (
            '(of a ball) "a ball out of play is dead"',
            "(of a ball)",
            ("a ball out of play is dead",),
        ),
        ('woven of yarns "he wore a suit"', "woven of yarns", ("he wore a suit",)),
        ('a report (e.g., "he said no")', 'a report (e.g., "he said no")', ()),
        ('close in; darkness enclosed him"', "close in", ("darkness enclosed him",)),
        ('a local branch"', "a local branch", ()),
        ('x; "a notice of sale  ', "x", ("a notice of sale",)),
        ('x; "drop a hint"; drop names"', "x", ("drop a hint", "drop names")),
        ('x; "long-toed; "five-toed"', "x", ("long-toed", "five-toed")),
        ('x; "I"m siding"', "x", ('I"m siding',)),
        ('x; "the permutations"- Henry Miller; "b"', "x", ("the permutations", "b")),
        ('x; "a; b"--Thomas Paine', "x", ("a; b",)),
        ('x; "the head of a nail", "a pinhead"', "x", ("the head of a nail", "a pinhead")),
        ('"only an example"', "", ("only an example",)),
        ("", "", ()),
    ],
)
def test_split_gloss(gloss: str, definition: str, examples: tuple[str, ...]) -> None:
    assert split_gloss(gloss) == (definition, examples)


LEXNAMES = (
    "03\tnoun.Tops\t1\n05\tnoun.animal\t1\n29\tverb.body\t2\n00\tadj.all\t3\n02\tadv.all\t4\n"
)
HEADER = "  1 This software and database is being provided to you\n  2 under a license.  \n"
GOOD = {
    "data.noun": "00001740 03 n 02 entity 0 thing 1 001 ~ 00001930 n 0000 | that which is; "
    '"an entity"  \n'
    '00001930 05 n 01 beast 0 000 | "an example only"  \n',
    "data.verb": "00001740 29 v 01 breathe 0 001 @ 00002325 v 0000 02 + 02 00 + 08 01 | draw "
    'air; "breathe in"  \n',
    "data.adj": "00001740 00 a 01 able(p) 0 000 | having the means  \n"
    "00001930 00 s 02 big(a) 0 large(ip) 0 000 | of size;  \n",
    "data.adv": "00001740 02 r 01 very 0 000 | to a great degree  \n",
}


def write_wordnet(directory: Path, lexnames: str = LEXNAMES, **files: str) -> Path:
    """A small WordNet directory: :data:`GOOD` with ``files`` (``data_noun=...``) instead."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "lexnames").write_text(lexnames)
    for name, body in GOOD.items():
        (directory / name).write_text(HEADER + files.get(name.replace(".", "_"), body))
    return directory


def test_small_database(tmp_path: Path) -> None:
    synsets = read_wordnet(write_wordnet(tmp_path / "wn"))
    assert [(s.pos, s.lexname, s.words, s.definition, s.examples) for s in synsets] == [
        ("n", "noun.Tops", ("entity", "thing"), "that which is", ("an entity",)),
        ("n", "noun.animal", ("beast",), "", ("an example only",)),
        ("v", "verb.body", ("breathe",), "draw air", ("breathe in",)),
        ("a", "adj.all", ("able",), "having the means", ()),
        ("s", "adj.all", ("big", "large"), "of size", ()),
        ("r", "adv.all", ("very",), "to a great degree", ()),
    ]
    # the synset whose gloss is only an example is dropped, and counted
    stats = wordnet_define_stats(tmp_path / "wn")
    assert (stats.synsets, stats.kept, stats.empty_definition) == (6, 5, 1)
    train, dev = wordnet_define(tmp_path / "wn", seed=0, dev_fraction=0.4)
    assert (len(train), len(dev)) == (3, 2)
    prompts = {e.text_a for e in train + dev}
    assert 'Define the adjective "big".' in prompts and 'Define the verb "breathe".' in prompts
    assert not any("beast" in p for p in prompts)


@pytest.mark.parametrize(
    ("data_noun", "says"),
    [
        ("00001740 03 n 01 entity 0 000 that which is\n", "no ' | '"),
        ("00001740 03 n zz entity 0 000 | that\n", "not 2 hexadecimal digits"),
        ("00001740 03 n 02 entity 0 000 | that\n", "expected 2 words"),
        ("00001740 03 n 01 entity 0 000 extra | that\n", "call for"),
        ("00001740 03 n 01 entity 0 002 ~ 00001930 n 0000 | that\n", "call for"),
        ("00001740 03 n 01 entity x 000 | that\n", "hexadecimal lex_id"),
        ("00001740 03 n 01 entity 0 0x0 | that\n", "pointer count"),
        ("00001740 99 n 01 entity 0 000 | that\n", "not in lexnames"),
        ("00001740 03 v 01 entity 0 000 | that\n", "synset type 'v'"),
        ("00001740 29 n 01 entity 0 000 | that\n", "verb.body is not of synset type 'n'"),
        ("1740 03 n 01 entity 0 000 | that\n", "not 8 decimal digits"),
        ("00001740 03 n 05 entity 0 | that\n", "expected 5 words"),
    ],
)
def test_malformed_line(tmp_path: Path, data_noun: str, says: str) -> None:
    directory = write_wordnet(tmp_path / "wn", data_noun=GOOD["data.noun"] + data_noun)
    with pytest.raises(DataError, match=says) as caught:
        read_wordnet(directory)
    # two header lines, two good synsets, then the hostile line
    assert f"{directory / 'data.noun'}, line 5:" in str(caught.value)


def test_malformed_verb_frames_and_lexnames(tmp_path: Path) -> None:
    verb = "00001740 29 v 01 breathe 0 000 02 + 02 00 | draw air\n"
    directory = write_wordnet(tmp_path / "frames", data_verb=verb)
    with pytest.raises(DataError, match=r"data\.verb, line 3: the counts"):
        read_wordnet(directory)
    directory = write_wordnet(tmp_path / "lexnames", lexnames=LEXNAMES + "07\tnoun.attribute\n")
    with pytest.raises(DataError, match=r"lexnames, line 6: expected a number, a name"):
        read_wordnet(directory)
    directory = write_wordnet(tmp_path / "missing")
    (directory / "data.adv").unlink()
    with pytest.raises(DataError, match=r"file not found: .*data\.adv"):
        read_wordnet(directory)


# --- wordnet-define -------------------------------------------------------------------


@needs_wordnet
def test_wordnet_define_split() -> None:
    train, dev = wordnet_define(WORDNET_DIR, seed=0)
    assert (len(train), len(dev)) == (117_659 - 11_766, 11_766)  # round(0.1 * 117,659)
    order = {(s.pos, s.offset): i for i, s in enumerate(read_wordnet(WORDNET_DIR))}
    pos_letters = {"noun": "n", "verb": "v", "adverb": "r"}

    def keys(examples: list) -> list[tuple[str, str]]:
        return [(e.meta["pos"], e.meta["synset"]) for e in examples]

    assert not set(keys(train)) & set(keys(dev))
    assert len(set(keys(train)) | set(keys(dev))) == len(order)
    for part in (train, dev):
        # file order: adjectives "a" and "s" share data.adj, so rank by (file, offset)
        ranks = [
            ("nvar".index(pos_letters.get(e.meta["pos"], "a")), int(e.meta["synset"])) for e in part
        ]
        assert ranks == sorted(ranks)
    again_train, again_dev = wordnet_define(WORDNET_DIR, seed=0)
    assert keys(again_dev) == keys(dev) and keys(again_train) == keys(train)
    _, other_dev = wordnet_define(WORDNET_DIR, seed=1)
    assert keys(other_dev) != keys(dev) and len(other_dev) == len(dev)
    (dog,) = [e for e in train + dev if e.meta["synset"] == "02084071" and e.meta["pos"] == "noun"]
    assert dog.text_a == 'Define the noun "dog".' and dog.text_b is None
    assert dog.label.startswith("a member of the genus Canis")
    assert dict(dog.meta) == {
        "lexname": "noun.animal",
        "pos": "noun",
        "synset": "02084071",
        "word": "dog",
    }
    spaced = next(e for e in train + dev if e.meta["synset"] == "00001930")
    assert spaced.text_a == 'Define the noun "physical entity".'
    galore = next(e for e in train + dev if e.meta["synset"] == "00014358")
    assert galore.text_a == 'Define the adjective "abounding".'
    assert galore.meta["pos"] == "adjective" and galore.meta["lexname"] == "adj.all"


def test_wordnet_define_fraction(tmp_path: Path) -> None:
    directory = write_wordnet(tmp_path / "wn")
    assert wordnet_define(directory, seed=3, dev_fraction=0.0)[1] == []
    for bad in (-0.1, 1.0):
        with pytest.raises(ValueError, match="dev_fraction"):
            wordnet_define(directory, seed=3, dev_fraction=bad)


# --- GLUE as generation ---------------------------------------------------------------


def tsv_rows(path: Path) -> list[list[str]]:
    """A GLUE TSV file's rows after the header, read plainly."""
    with path.open(encoding="utf-8-sig", newline="") as handle:
        return list(csv.reader(handle, delimiter="\t", quoting=csv.QUOTE_NONE))[1:]


@needs_glue
def test_mrpc_paraphrase() -> None:
    train, dev = mrpc_paraphrase(GLUE_DIR)
    for examples, split in ((train, "train"), (dev, "dev")):
        rows = [row for row in tsv_rows(GLUE_DIR / "MRPC" / f"{split}.tsv") if row[0] == "1"]
        assert len(examples) == len(rows)
        for example, row in zip(examples[:20], rows[:20]):
            assert example.text_a == f"Paraphrase this sentence: {row[3]}"
            assert example.text_b is None and example.label == row[4]
            assert dict(example.meta) == {"pair": f"{row[1]}-{row[2]}"}
    assert (len(train), len(dev)) == (2_473, 279)


@needs_glue("SST-2", "RTE")
def test_glue_generate() -> None:
    train, dev = glue_generate("sst2", GLUE_DIR)
    assert (len(train), len(dev)) == (67_349, 872)
    rows = tsv_rows(GLUE_DIR / "SST-2" / "dev.tsv")
    for example, (sentence, label) in zip(dev[:10], rows[:10]):
        assert example.text_a == (
            f"Sentence: {sentence}\nQuestion: Is the sentiment of the sentence negative or "
            "positive?\nAnswer with one of: negative / positive."
        )
        assert example.label == ("negative", "positive")[int(label)]
        assert example.text_b is None and dict(example.meta) == {"task": "SST-2"}
    assert Counter(e.label for e in dev) == Counter(
        ("negative", "positive")[int(label)] for _, label in rows
    )
    _, rte = glue_generate("RTE", GLUE_DIR)
    index, first, second, label = tsv_rows(GLUE_DIR / "RTE" / "dev.tsv")[0]
    assert rte[0].text_a == (
        f"Sentence 1: {first}\nSentence 2: {second}\nQuestion: Does the first sentence entail "
        "the second sentence?\nAnswer with one of: entailment / not entailment."
    )
    assert rte[0].label == label.replace("_", " ")
    assert dict(rte[0].meta) == {"index": index, "task": "RTE"}


def test_glue_generate_errors(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="STS-B is a regression task"):
        glue_generate("STS-B", tmp_path)
    with pytest.raises(ValueError, match="unknown task"):
        glue_generate("nope", tmp_path)


# --- the registry ---------------------------------------------------------------------


def test_registry() -> None:
    assert set(GENERATIVE_TASKS) == {
        "wordnet-define",
        "mrpc-paraphrase",
        "mrpc-generate",
        "rte-generate",
        "sst2-generate",
        "cola-generate",
        "wnli-generate",
    }
    for name, task in GENERATIVE_TASKS.items():
        assert task.name == name and task.main_metric in task.metrics
        if name.endswith("-generate"):
            assert (task.data_subdir, task.metrics) == ("glue", ("exact_match", "nll"))
            assert task.main_metric == "exact_match"
        else:
            assert task.metrics == ("rougeL", "rouge1", "rouge2", "nll")
            assert task.main_metric == "rougeL"
    assert GENERATIVE_TASKS["wordnet-define"].data_subdir == "wordnet"
    assert GENERATIVE_TASKS["mrpc-paraphrase"].data_subdir == "glue"
    with pytest.raises(ValueError, match="unknown generative task 'stsb-generate'.*wordnet-define"):
        load_generative("stsb-generate", Path("/nonexistent"), 0)


@needs_glue("WNLI")
def test_load_generative(tmp_path: Path) -> None:
    (tmp_path / "glue").symlink_to(GLUE_DIR)
    train, dev = load_generative("WNLI-generate", tmp_path, seed=7)
    assert (train, dev) == glue_generate("WNLI", GLUE_DIR)
    assert (len(train), len(dev)) == (635, 71)


@needs_wordnet
def test_load_wordnet_define() -> None:
    train, dev = load_generative("wordnet-define", WORDNET_DIR.parent, seed=5)
    expected = wordnet_define(WORDNET_DIR, seed=5)
    assert [e.meta["synset"] for e in dev] == [e.meta["synset"] for e in expected[1]]
    assert len(train) == len(expected[0])
