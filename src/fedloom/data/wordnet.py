"""A reader of Princeton WordNet 3.0's database files (the ``wndb(5WN)`` format).

A WordNet directory holds one data file per part of speech, ``data.noun``, ``data.verb``,
``data.adj`` and ``data.adv``, and ``lexnames``, the list of the 45 lexicographer files
(``lexnames(5WN)``: a number, a name such as ``noun.animal``, a syntactic category 1-4 for
noun, verb, adjective, adverb; tab-separated). A data file starts with the license, lines
that begin with two spaces; every other line is one synset::

    synset_offset lex_filenum ss_type w_cnt word lex_id [word lex_id...] p_cnt [ptr...]
        [frames...] | gloss

``synset_offset`` is 8 decimal digits, ``lex_filenum`` 2 (a number in ``lexnames``),
``ss_type`` one of ``n v a s r`` (``s``: an adjective satellite), ``w_cnt`` 2 hexadecimal
digits, each ``lex_id`` 1 hexadecimal digit, ``p_cnt`` 3 decimal digits, each pointer 4
fields (``symbol offset pos source/target``); verb synsets add ``f_cnt`` and ``f_cnt``
frames of 3 fields (``+ f_num w_num``). Words have underscores for spaces; in ``data.adj``
a word may end in a syntactic marker, ``(a)``, ``(p)`` or ``(ip)``, which this reader
strips. The gloss is a definition, then example sentences in double quotes.

WordNet 3.0 Copyright 2006 by Princeton University; its license must travel with every
copy of the files (see ``LICENSE`` beside them).
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from pathlib import Path

from .errors import DataError

#: the data files in the order :func:`read_wordnet` reads them, with the ``ss_type`` values
#: each may hold
DATA_FILES: tuple[tuple[str, frozenset[str]], ...] = (
    ("data.noun", frozenset("n")),
    ("data.verb", frozenset("v")),
    ("data.adj", frozenset("as")),
    ("data.adv", frozenset("r")),
)
#: ``ss_type`` -> the syntactic category number of ``lexnames(5WN)``
_CATEGORY = {"n": 1, "v": 2, "a": 3, "s": 3, "r": 4}
#: ``ss_type`` -> the part of speech in words (adjective satellites are adjectives)
POS_WORDS = {"n": "noun", "v": "verb", "a": "adjective", "s": "adjective", "r": "adverb"}

_MARKER = re.compile(r"\((?:a|p|ip)\)$")
# an example is introduced by this punctuation (nearly always "; ") or starts the gloss
_INTRODUCED = re.compile(r"(?:^|[;:,])\s*$")
# the separators between examples: a semicolon next to a quote
_BETWEEN_EXAMPLES = re.compile(r'\s*;\s*(?=")|(?<=")\s*;\s*')
_QUOTED = re.compile(r'"([^"]*)"')
_HEX = frozenset("0123456789abcdefABCDEF")


@dataclass(frozen=True)
class Synset:
    """One WordNet synset.

    ``offset`` is its byte offset in its data file (unique within a part of speech, not
    across them); ``pos`` its ``ss_type`` (``n``, ``v``, ``a``, ``s`` for an adjective
    satellite, ``r``); ``lexname`` its lexicographer file (``noun.animal``); ``words`` its
    lemmas as the file spells them (underscores for spaces, adjective markers stripped);
    ``definition`` and ``examples`` its gloss split by :func:`split_gloss`.
    """

    offset: int
    pos: str
    lexname: str
    words: tuple[str, ...]
    definition: str
    examples: tuple[str, ...]


@dataclass(frozen=True)
class Lexname:
    """One line of ``lexnames``: a lexicographer file's number, name and syntactic category
    (1 noun, 2 verb, 3 adjective, 4 adverb)."""

    number: int
    name: str
    category: int


def read_wordnet(directory: Path) -> list[Synset]:
    """Every synset of the WordNet database in ``directory``, in file order: ``data.noun``,
    ``data.verb``, ``data.adj``, ``data.adv`` (WordNet 3.0: 117,659 synsets).

    A missing file or a malformed line raises :class:`DataError` naming the file and the
    1-based line (blank lines and the license header, lines that start with two spaces,
    are skipped). The parse is cached per directory for the life of the process (the files
    are read once); each call returns a new list.
    """
    return list(_read_wordnet(Path(directory).resolve()))


@functools.lru_cache(maxsize=4)
def _read_wordnet(directory: Path) -> tuple[Synset, ...]:
    lexnames = read_lexnames(directory)
    names = {number: lex.name for number, lex in lexnames.items()}
    categories = {number: lex.category for number, lex in lexnames.items()}
    synsets: list[Synset] = []
    for filename, types in DATA_FILES:
        path = directory / filename
        for number, line in _lines(path):
            if line.startswith("  ") or not line.strip():
                continue  # the license header
            try:
                synsets.append(_parse_synset(line, types, names, categories))
            except (ValueError, IndexError) as exc:
                raise DataError(f"{path}, line {number}: {exc}") from None
    return tuple(synsets)


def read_lexnames(directory: Path) -> dict[int, Lexname]:
    """The lexicographer files listed in ``directory/lexnames`` by number (WordNet 3.0: 45,
    ``adj.all`` to ``adj.ppl``). A malformed line raises :class:`DataError`."""
    return dict(_read_lexnames(Path(directory).resolve()))


@functools.lru_cache(maxsize=4)
def _read_lexnames(directory: Path) -> tuple[tuple[int, Lexname], ...]:
    path = directory / "lexnames"
    found: dict[int, Lexname] = {}
    for number, line in _lines(path):
        if not line.strip():
            continue
        fields = line.split()
        if len(fields) != 3 or not fields[0].isdecimal() or fields[2] not in ("1", "2", "3", "4"):
            raise DataError(
                f"{path}, line {number}: expected a number, a name and a syntactic category "
                f"1-4, found {line.strip()!r}"
            )
        lex = Lexname(int(fields[0]), fields[1], int(fields[2]))
        if lex.number in found:
            raise DataError(f"{path}, line {number}: lexicographer file {lex.number} repeated")
        found[lex.number] = lex
    if not found:
        raise DataError(f"{path}: no lexicographer files")
    return tuple(found.items())


def _lines(path: Path) -> list[tuple[int, str]]:
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise DataError(f"file not found: {path}") from None
    except UnicodeDecodeError as exc:
        raise DataError(f"{path}: not UTF-8 text ({exc})") from None
    return list(enumerate(text.split("\n"), start=1))


def _parse_synset(
    line: str, types: frozenset[str], names: dict[int, str], categories: dict[int, int]
) -> Synset:
    """One synset line; ``ValueError`` (or ``IndexError``) saying what is wrong."""
    head, bar, gloss = line.partition(" | ")
    if not bar:
        head, bar, gloss = line.rstrip().partition(" |")  # an empty gloss
        if not bar or gloss:
            raise ValueError("no ' | ' before the gloss")
    fields = head.split()
    if len(fields) < 6:
        raise ValueError(f"expected at least 6 fields before the gloss, found {len(fields)}")
    offset, lex_filenum, ss_type, w_cnt = fields[:4]
    if len(offset) != 8 or not offset.isdecimal():
        raise ValueError(f"synset offset {offset!r} is not 8 decimal digits")
    if ss_type not in types:
        raise ValueError(f"synset type {ss_type!r} is not one of {sorted(types)} in this file")
    if not lex_filenum.isdecimal() or int(lex_filenum) not in names:
        raise ValueError(f"lexicographer file {lex_filenum!r} is not in lexnames")
    lexfile = int(lex_filenum)
    if categories[lexfile] != _CATEGORY[ss_type]:
        raise ValueError(f"lexicographer file {names[lexfile]} is not of synset type {ss_type!r}")
    if len(w_cnt) != 2 or not _HEX.issuperset(w_cnt):
        raise ValueError(f"word count {w_cnt!r} is not 2 hexadecimal digits")
    count = int(w_cnt, 16)
    if count < 1:
        raise ValueError("a synset needs at least one word")
    end = 4 + 2 * count
    if end >= len(fields):
        raise ValueError(f"expected {count} words (w_cnt {w_cnt}) and a pointer count")
    words = fields[4:end:2]
    lex_ids = fields[5:end:2]
    ids = "".join(lex_ids)
    if len(lex_ids) != count or len(ids) != count or not _HEX.issuperset(ids):
        raise ValueError(f"expected {count} words, each with a 1-digit hexadecimal lex_id")
    if ss_type in "as":
        words = [_MARKER.sub("", w) for w in words]
    p_cnt = fields[end]
    if not p_cnt.isdecimal():
        raise ValueError(f"pointer count {p_cnt!r} is not a decimal number")
    end += 1 + 4 * int(p_cnt)
    if ss_type == "v" and end < len(fields):
        f_cnt = fields[end]
        if not f_cnt.isdecimal():
            raise ValueError(f"frame count {f_cnt!r} is not a decimal number")
        end += 1 + 3 * int(f_cnt)
    if end != len(fields):
        raise ValueError(
            f"the counts (w_cnt {w_cnt}, p_cnt {p_cnt}) call for {end} fields before the "
            f"gloss, found {len(fields)}"
        )
    definition, examples = split_gloss(gloss)
    return Synset(int(offset), ss_type, names[lexfile], tuple(words), definition, examples)


def split_gloss(gloss: str) -> tuple[str, tuple[str, ...]]:
    """(definition, examples) of a WordNet gloss, e.g. ``a member of the genus Canis ...;
    occurs in many breeds; "the dog barked all night"``.

    The examples start at the first double quote outside parentheses that begins the gloss
    or follows ``;``, ``:`` or ``,`` (almost always ``; "``); failing that, at the first
    double quote outside parentheses (an example introduced without punctuation). Quotes
    inside parentheses (``(especially in the phrase "make strides")``) stay in the
    definition, as do the quotes of a gloss with no other. The definition is the text
    before, less trailing spaces and ``;:,``.

    The examples are the double-quoted strings after it, split at semicolons next to a
    quote; text outside the quotes (attributions such as ``- Henry Miller``) is dropped.
    About 20 glosses miss a quote: a part with an odd number of quotes is repaired by
    closing it at its end (``"a notice of sale``) or opening it at its start (``drop
    names"``), or, quoted at both ends, taken whole (``"I"m siding against ..."``). A gloss
    whose only quote is a stray closing one at its end takes its last ``;``-separated part
    as the example (``close in; darkness enclosed him"``); with no ``;``, the quote is
    dropped and the gloss has no example.
    """
    gloss = gloss.strip()
    if '"' not in gloss:
        return gloss.rstrip(" ;:,"), ()
    end, start = _examples_start(gloss)
    examples: list[str] = []
    for part in _BETWEEN_EXAMPLES.split(gloss[start:]) if start is not None else ():
        part = part.strip()
        if part.count('"') % 2:
            if part.startswith('"') and part.endswith('"'):
                examples.append(part[1:-1])
                continue
            part = part + '"' if part.startswith('"') else '"' + part
        examples.extend(_QUOTED.findall(part))
    return gloss[:end].rstrip(" ;:,"), tuple(e.strip() for e in examples if e.strip())


def _examples_start(gloss: str) -> tuple[int, int | None]:
    """Where the definition of ``gloss`` ends and its examples start (None: no examples);
    see :func:`split_gloss`."""
    depth = 0
    first: int | None = None
    for i, char in enumerate(gloss):
        if char == "(":
            depth += 1
        elif char == ")":
            depth = max(0, depth - 1)
        elif char == '"' and depth == 0:
            if _INTRODUCED.search(gloss, 0, i):
                return i, i
            if first is None:
                first = i
    if first is None:
        return len(gloss), None
    if first == len(gloss) - 1:  # a stray closing quote at the end
        semicolon = gloss.rfind(";", 0, first)
        return (first, None) if semicolon < 0 else (semicolon, semicolon + 1)
    return first, first
