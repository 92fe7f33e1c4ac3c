"""The documentation runs: every code block of README.md and docs/**/*.md is executed here,
so that a wrong command, key or config in the docs fails a test. Also: no Markdown link of
README.md, docs/ or BENCHMARKS.md leaves the repository, and README.md stays short.

Conventions for writing the docs (the test enforces them)
--------------------------------------------------------
Every fenced block carries one of these language tags:

``toml``    an experiment config, validated by fedloom's own checks: ``load_config``
            (``fedloom.config``: the schema, every section and key) and ``build_algorithm``
            (``fedloom.experiment``: the algorithm and its hyperparameters, [aggregation],
            [[transforms]], [privacy] against the federation): what ``fedloom run`` checks
            before it loads any data. A fragment is validated merged onto the config named
            by an HTML comment right before the block, ``<!-- base: examples/mrpc_fedavg.toml -->``
            (a path in the repository); without one, onto the defaults (every key has one).
``python``  a script, run in a subprocess in the document's working directory (below);
            it must exit 0.
``bash``    commands, one a line (a trailing ``\\`` continues it, ``#`` starts a comment,
            ``> FILE`` sends its stdout to FILE; no pipes or ``&&``); each must exit 0. How
            each kind of command runs is under "bash" below.
``jsonl``   data: every line must be a JSON object.
``text``    shown output or a diagram; not run.

``<!-- file: PATH -->`` right before a ``toml`` or ``jsonl`` block also writes the block to
PATH in the document's working directory, for the document's later bash blocks (a
``file:`` block is a whole config: no ``base:`` with it).

bash
----
A document's bash blocks run in document order in a working directory of its own, which
holds a symlink to each top-level entry of the repository (examples/, src/, ...) and has
``../shared/data/glue`` beside it (the GLUE data), so the docs' relative paths work and
nothing is written into the repository. ``RUN_DIR`` in a command is the run directory the
document's last ``fedloom run`` wrote, ``SWEEP_DIR`` the sweep directory of its last
``fedloom sweep``; a word with ``*`` is expanded as the shell would.

- ``fedloom ...`` runs fedloom's command line in this process (its console-script entry
  point, through click's test runner), so that torch is imported once.
- ``fedloom run CONFIG``, ``fedloom sweep CONFIG`` and ``fedloom diagnose CONFIG`` would
  train or measure for minutes: the test appends :data:`TINY` (one round, a few dozen
  examples, the 2-layer ``tiny-bert`` backbone, one local step; for a generative task
  :data:`TINY_GENERATIVE`, the 2-layer ``tiny-llama``), after the command's own
  ``--set`` options, so it wins. It also appends ``--no-report`` where the command has that
  option (the report has its own block: ``fedloom report RUN_DIR``).
- ``fedloom run --resume RUN_DIR``: a killed run cannot be made cheaply, so the test marks
  the finished RUN_DIR ``interrupted`` in its status.json first; the resume then loads its
  last checkpoint and finishes it.
- ``fedloom serve``, ``fedloom join`` and ``fedloom run`` of a config whose runtime is
  ``ray`` or ``flower`` start servers, SuperNodes or a Ray cluster (a Flower loopback run
  of the smallest config takes 90 s here, a Ray one about a minute; tests/test_flower_runtime.py
  and tests/test_ray_runtime.py run them): the test parses the command line with the real
  command (every option and value must be accepted) and validates its config, with the
  command's ``--set`` overrides, as a ``toml`` block is validated; nothing is started.
- ``python ...`` runs in a subprocess with this interpreter.
- Flower's own tools (``flower-superlink``, ``flower-supernode``, ``flwr``) would start
  Flower's servers: every ``--option`` the command uses must appear in the tool's
  ``--help`` for the same subcommand.
- :data:`EXEMPT` lists the few commands that cannot run inside a test, each with why.
- Any other command fails the test: add a rule here, or write it as prose.
"""

from __future__ import annotations

import copy
import glob
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tomllib
from collections.abc import Iterator
from dataclasses import dataclass, field
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any

import click
import pytest
import tomli_w
import typer
from conftest import GLUE_DIR, require_glue
from typer.testing import CliRunner

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = sorted([README, *(ROOT / "docs").rglob("*.md")])
#: the Markdown files whose links must stay in the repository
LINKED = [*DOCS, ROOT / "BENCHMARKS.md"]

LANGUAGES = ("toml", "python", "bash", "jsonl", "text")
README_MAX_LINES = 200

#: appended to ``fedloom run / sweep / diagnose CONFIG``: a run of seconds, not minutes
TINY = [
    "federation.rounds=1",
    "data.max_train_examples=64",
    "data.max_dev_examples=16",
    "model.backbone=tiny-bert",
    "train.local_steps=1",
    "partition.min_size=1",
]
#: what :data:`TINY` becomes for a generative task's config: the 2-layer causal LM
#: ``tiny-llama`` (an encoder is refused there), and answers of four tokens
TINY_GENERATIVE = [
    *(item for item in TINY if not item.startswith("model.backbone=")),
    "model.backbone=tiny-llama",
    "eval.generation.max_new_tokens=4",
]

#: commands a test cannot run (a prefix of the command's words), and why
EXEMPT: dict[tuple[str, ...], str] = {
    ("make", "setup"): "creates .venv and installs every dependency (network, minutes)",
    ("make", "run"): "the quickstart, minutes of MiniLM training; the lead runs it for the "
    "README's table",
    ("make", "test"): "the test suite itself (CI's .ci/run calls it)",
    ("make", "lint"): "ruff and mypy over src/ (CI runs it beside make test)",
    ("pip",): "installs packages (network); make setup installs the same from constraints.txt",
    ("python", "-m", "fedloom.algorithm_catalog"): "rewrites src/fedloom/algorithm_catalog.json; "
    "a test of the suite fails when that file and the registry differ",
}

FLOWER_TOOLS = ("flower-superlink", "flower-supernode", "flwr")
#: commands whose run would start servers, nodes or a cluster: parsed and validated only
START_SERVERS = ("serve", "join")


# --- reading the Markdown ------------------------------------------------------------------


@dataclass
class Block:
    doc: Path
    line: int  # of the opening fence, 1-based
    lang: str
    text: str
    base: str | None = None  # <!-- base: PATH -->
    file: str | None = None  # <!-- file: PATH -->

    @property
    def where(self) -> str:
        return f"{self.doc.relative_to(ROOT)}:{self.line}"


FENCE = re.compile(r"^( {0,3})(`{3,}|~{3,})\s*([^`\s]*)")
DIRECTIVE = re.compile(r"^<!--\s*(base|file):\s*(\S+)\s*-->\s*$")


def blocks(doc: Path) -> list[Block]:
    lines = doc.read_text(encoding="utf-8").splitlines()
    out: list[Block] = []
    i = 0
    while i < len(lines):
        match = FENCE.match(lines[i])
        if not match:
            i += 1
            continue
        fence, lang = match.group(2), match.group(3)
        directives: dict[str, str] = {}
        j = i - 1
        while j >= 0 and not lines[j].strip():
            j -= 1
        while j >= 0 and (d := DIRECTIVE.match(lines[j].strip())):
            directives[d.group(1)] = d.group(2)
            j -= 1
        end = i + 1
        while end < len(lines) and not lines[end].strip().startswith(fence[0] * len(fence)):
            end += 1
        text = "\n".join(lines[i + 1 : end]) + "\n"
        out.append(Block(doc, i + 1, lang, text, directives.get("base"), directives.get("file")))
        i = end + 1
    return out


ALL_BLOCKS = [b for doc in DOCS for b in blocks(doc)]


def of_kind(lang: str) -> list[Any]:
    return [pytest.param(b, id=b.where) for b in ALL_BLOCKS if b.lang == lang]


# --- block kinds: tags, toml, jsonl, python ----------------------------------------------------


def test_every_block_has_a_known_language() -> None:
    wrong = [
        f"{b.where}: {b.lang or 'no language tag'}" for b in ALL_BLOCKS if b.lang not in LANGUAGES
    ]
    assert not wrong, f"fenced blocks need one of {LANGUAGES}: " + "; ".join(wrong)
    misplaced = [
        b.where
        for b in ALL_BLOCKS
        if (b.base and b.lang != "toml")
        or (b.file and b.lang not in ("toml", "jsonl"))
        or (b.base and b.file)
    ]
    assert not misplaced, f"base: goes with toml fragments, file: with toml/jsonl: {misplaced}"


def deep_merge(base: dict[str, Any], top: dict[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(base)
    for key, value in top.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def check_config(path: Path, overrides: list[str] | None = None) -> None:
    """What ``fedloom run`` checks before it loads data (a ConfigError names the key)."""
    from fedloom.config import load_config
    from fedloom.experiment import build_algorithm

    build_algorithm(load_config(path, overrides or []))


@pytest.mark.parametrize("block", of_kind("toml"))
def test_toml_block_is_a_valid_config(block: Block, tmp_path: Path) -> None:
    from fedloom.config import ConfigError

    try:
        raw = tomllib.loads(block.text)
    except tomllib.TOMLDecodeError as err:
        pytest.fail(f"{block.where}: not TOML: {err}")
    if block.base is not None:
        base = ROOT / block.base
        assert base.is_file(), f"{block.where}: base {block.base} is not a file of the repository"
        raw = deep_merge(tomllib.loads(base.read_text(encoding="utf-8")), raw)
    path = tmp_path / "block.toml"
    path.write_text(tomli_w.dumps(raw), encoding="utf-8")
    try:
        check_config(path)
    except ConfigError as err:
        pytest.fail(f"{block.where}: {err}")


@pytest.mark.parametrize("block", of_kind("jsonl"))
def test_jsonl_block_is_json_lines(block: Block) -> None:
    for n, line in enumerate(block.text.splitlines(), start=1):
        assert isinstance(json.loads(line), dict), f"{block.where}, line {n}: not a JSON object"


def workdir(base: Path) -> Path:
    """A working directory that mirrors the repository (symlinks), ../shared/data/glue beside."""
    work = base / "repo"
    work.mkdir(parents=True)
    for entry in ROOT.iterdir():
        if entry.name not in (".git", "runs", "build", "dist") and not entry.name.endswith(".png"):
            (work / entry.name).symlink_to(entry)
    glue = base / "shared" / "data" / "glue"
    glue.parent.mkdir(parents=True)
    if GLUE_DIR.is_dir():
        glue.symlink_to(GLUE_DIR.resolve())
    return work


@pytest.mark.parametrize("block", of_kind("python"))
def test_python_block_runs(block: Block, tmp_path: Path) -> None:
    if "examples/" in block.text:
        require_glue()
    work = workdir(tmp_path)
    script = tmp_path / "block.py"
    script.write_text(block.text, encoding="utf-8")
    done = subprocess.run(
        [sys.executable, str(script)],
        check=False,
        cwd=work,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, f"{block.where} exited {done.returncode}:\n{done.stderr[-3000:]}"


# --- bash ----------------------------------------------------------------------------------


def commands(block: Block) -> Iterator[tuple[int, list[str]]]:
    """(line, words) of each command of a bash block."""
    pending, start = "", 0
    for n, line in enumerate(block.text.splitlines(), start=block.line + 1):
        if not pending:
            start = n
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        words = shlex.split(pending + line, comments=True)
        pending = ""
        if words:
            yield start, words


def exempt(words: list[str]) -> str | None:
    for prefix, why in EXEMPT.items():
        if tuple(words[: len(prefix)]) == prefix:
            return why
    return None


def fedloom_app() -> typer.Typer:
    (point,) = entry_points(group="console_scripts", name="fedloom")
    return point.load()


@dataclass
class Session:
    """One document's bash blocks: its working directory and what its commands made."""

    work: Path
    app: typer.Typer
    run_dir: Path | None = None
    sweep_dir: Path | None = None
    failures: list[str] = field(default_factory=list)

    def dirs(self, marker: str) -> set[Path]:
        found = set()
        for top, subdirs, files in os.walk(self.work):  # symlinks are not followed
            if marker in files:
                found.add(Path(top))
        return found

    def substitute(self, where: str, words: list[str]) -> list[str]:
        out: list[str] = []
        for word in words:
            for name, value in (("SWEEP_DIR", self.sweep_dir), ("RUN_DIR", self.run_dir)):
                if name in word:
                    if value is None:
                        raise AssertionError(f"{where}: {name} before any command made one")
                    word = word.replace(name, str(value))
            matches = sorted(glob.glob(word)) if "*" in word else []
            out.extend(matches or [word])
        return out

    def command(self, name: str) -> click.Command:
        group = typer.main.get_command(self.app)
        assert isinstance(group, click.Group)
        cmd = group.commands.get(name)
        assert cmd is not None, f"fedloom has no command {name!r}"
        return cmd

    def has_option(self, name: str, option: str) -> bool:
        return any(option in (*p.opts, *p.secondary_opts) for p in self.command(name).params)

    def parse(self, words: list[str]) -> tuple[click.Command, dict[str, Any]]:
        """The real command's parse of ``words`` (every option and value checked)."""
        cmd = self.command(words[0])
        with cmd.make_context(words[0], list(words[1:])) as ctx:
            return cmd, dict(ctx.params)

    def config_of(self, words: list[str]) -> tuple[Path | None, list[str]]:
        """The command's CONFIG argument and ``--set`` overrides."""
        cmd, params = self.parse(words)
        config = next(
            (params[p.name] for p in cmd.params if isinstance(p, click.Argument) and p.name), None
        )
        sets = next((params[p.name] for p in cmd.params if "--set" in p.opts and p.name), None)
        return (Path(config) if config is not None else None), list(sets or [])

    def invoke(self, words: list[str]) -> Any:
        result = CliRunner().invoke(self.app, words)
        if result.exit_code != 0:
            import traceback

            trace = (
                "".join(traceback.format_exception(*result.exc_info))
                if (result.exc_info and not isinstance(result.exception, SystemExit))
                else ""
            )
            raise AssertionError(
                f"exit status {result.exit_code}: {result.stderr[-1500:]}{trace[-3000:]}"
            )
        return result

    def fedloom(self, words: list[str]) -> str:
        sub = words[0] if words else ""
        if sub in START_SERVERS or sub == "run" and "--resume" not in words:
            config, sets = self.config_of(words)
            if sub in START_SERVERS or config is not None and self.runtime(config, sets) != "local":
                if config is not None:
                    check_config(config, sets)
                return ""
        if sub == "run" and "--resume" in words:
            self.interrupt(Path(words[words.index("--resume") + 1]))
        elif sub in ("run", "sweep", "diagnose") and "--resume" not in words:
            config, sets = self.config_of(words)
            tiny = TINY_GENERATIVE if config and self.generative(config, sets) else TINY
            words = [*words, *(w for item in tiny for w in ("--set", item))]
            if self.has_option(sub, "--no-report"):
                words.append("--no-report")
        runs, sweeps = self.dirs("status.json"), self.dirs("plan.toml")
        result = self.invoke(words)
        if sub == "run" and "--resume" not in words:
            self.run_dir = self.made(self.dirs("status.json") - runs, "run")
        if sub == "sweep" and "--resume" not in words:
            self.sweep_dir = self.made(self.dirs("plan.toml") - sweeps, "sweep")
        return result.stdout

    @staticmethod
    def made(new: set[Path], kind: str) -> Path:
        """The one new directory that no other new one holds (a run's baselines/local/
        is a run directory inside it)."""
        top = [d for d in new if not any(o in d.parents for o in new)]
        assert len(top) == 1, f"fedloom {kind} made {len(top)} {kind} directories"
        return top[0]

    @staticmethod
    def generative(config: Path, sets: list[str]) -> bool:
        from fedloom.config import load_config
        from fedloom.federation import is_generative

        return is_generative(load_config(config, sets).data.task)

    @staticmethod
    def runtime(config: Path, sets: list[str]) -> str:
        from fedloom.config import load_config

        return load_config(config, sets).runtime.name

    @staticmethod
    def interrupt(run_dir: Path) -> None:
        status_file = run_dir / "status.json"
        status = json.loads(status_file.read_text(encoding="utf-8"))
        if status.get("state") == "finished":
            status_file.write_text(json.dumps({**status, "state": "interrupted"}), encoding="utf-8")

    def flower_tool(self, words: list[str]) -> None:
        tool = shutil.which(words[0], path=str(Path(sys.executable).parent)) or shutil.which(
            words[0]
        )
        assert tool, f"{words[0]} is not installed"
        leading = []
        for word in words[1:]:
            if word.startswith("-"):
                break
            leading.append(word)
        helped = subprocess.run(
            [tool, *leading, "--help"],
            check=False,
            capture_output=True,
            text=True,
            timeout=120,
            cwd=self.work,
        )
        options = set(re.findall(r"(?<![\w-])--[a-z][\w-]*", helped.stdout + helped.stderr))
        used = [w.split("=")[0] for w in words[1:] if w.startswith("--")]
        unknown = [option for option in used if option not in options]
        assert not unknown, f"{' '.join(words[: 1 + len(leading)])} has no option {unknown}"

    def run(self, where: str, words: list[str]) -> None:
        redirect = None
        if ">" in words:
            at = words.index(">")
            words, redirect = words[:at], words[at + 1 :]
            assert len(redirect) == 1, "> FILE takes one file"
        for word in ("|", "||", "&&", ";", "<", "2>", "&>"):
            assert word not in words, f"shell syntax {word!r}: one command a line"
        words = self.substitute(where, words)
        stdout = ""
        if words[0] == "fedloom":
            stdout = self.fedloom(words[1:])
        elif words[0] in ("python", "python3"):
            done = subprocess.run(
                [sys.executable, *words[1:]],
                check=False,
                cwd=self.work,
                capture_output=True,
                text=True,
                timeout=300,
            )
            assert done.returncode == 0, f"exit status {done.returncode}: {done.stderr[-2000:]}"
            stdout = done.stdout
        elif words[0] in FLOWER_TOOLS:
            self.flower_tool(words)
        else:
            raise AssertionError("no rule runs this command (tests/test_docs.py says which do)")
        if redirect:
            (self.work / redirect[0]).write_text(stdout, encoding="utf-8")


def documents_with_bash() -> list[Any]:
    return [
        pytest.param(doc, id=str(doc.relative_to(ROOT)))
        for doc in DOCS
        if any(b.lang == "bash" for b in blocks(doc))
    ]


@pytest.mark.parametrize("doc", documents_with_bash())
def test_bash_blocks_run(doc: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    work = workdir(tmp_path)
    monkeypatch.chdir(work)
    session = Session(work, fedloom_app())
    saved = dict(os.environ)  # `fedloom run --quiet` sets a few variables, in this process
    try:
        run_blocks(doc, session)
    finally:
        os.environ.clear()
        os.environ.update(saved)
    assert not session.failures, "\n".join(session.failures)


def run_blocks(doc: Path, session: Session) -> None:
    work = session.work
    for block in blocks(doc):
        if block.file is not None:
            target = work / block.file
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(block.text, encoding="utf-8")
        if block.lang != "bash":
            continue
        for line, words in commands(block):
            where = f"{doc.relative_to(ROOT)}:{line}"
            if exempt(words):
                continue
            if words[0] in ("fedloom", "python"):
                require_glue()
            try:
                session.run(where, words)
            except Exception as err:  # noqa: BLE001 - every failing command is reported
                session.failures.append(f"{where}: {' '.join(words)}\n    {err}")


def test_exempt_commands_are_few_and_used() -> None:
    used = {
        prefix
        for b in ALL_BLOCKS
        if b.lang == "bash"
        for _, words in commands(b)
        for prefix in EXEMPT
        if tuple(words[: len(prefix)]) == prefix
    }
    assert len(EXEMPT) <= 8
    assert used == set(EXEMPT), f"exempt but in no bash block: {set(EXEMPT) - used}"


# --- the README ----------------------------------------------------------------------------


def test_readme_is_short() -> None:
    lines = README.read_text(encoding="utf-8").splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines"


def test_readme_has_the_test_command() -> None:
    # CI's .ci/run calls the README's test command
    bash = [words for b in blocks(README) if b.lang == "bash" for _, words in commands(b)]
    assert ["make", "test"] in bash


def test_readme_states_the_quickstarts_data() -> None:
    """The quickstart paragraph's sentences and clients are examples/quickstart.toml's
    (it once said 1,200 sentences, about 120 each, of an example that used 600)."""
    example = tomllib.loads((ROOT / "examples" / "quickstart.toml").read_text(encoding="utf-8"))
    prose = " ".join(README.read_text(encoding="utf-8").split())
    sentences, clients = example["data"]["max_train_examples"], example["partition"]["num_clients"]
    assert f"{sentences:,} SST-2 sentences" in prose
    assert f"split over {clients} clients" in prose
    assert f"{sentences // clients} sentences each on average" in prose


# --- links ---------------------------------------------------------------------------------

INLINE_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]*)>?(?:\s+\"[^\"]*\")?\s*\)")
REFERENCE = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s.*)?$", re.MULTILINE)
AUTOLINK = re.compile(r"<([a-zA-Z][a-zA-Z0-9+.-]*:[^>\s]*)>")
BARE_URL = re.compile(r"\b(?:https?|ftp)://\S+|\bwww\.\S+")
SCHEME = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")


def prose(text: str) -> str:
    """``text`` without fenced blocks, inline code and HTML comments."""
    kept, fence = [], None
    for line in text.splitlines():
        match = FENCE.match(line)
        if fence is None and match:
            fence = match.group(2)
            continue
        if fence is not None:
            if line.strip().startswith(fence[0] * len(fence)):
                fence = None
            continue
        kept.append(line)
    out = "\n".join(kept)
    out = re.sub(r"<!--.*?-->", "", out, flags=re.DOTALL)
    return re.sub(r"(`+)(?:(?!\1).)+?\1", "", out)


def heading_slugs(doc: Path) -> set[str]:
    """GitHub's anchors of ``doc``'s headings (inline code keeps its text in them)."""
    seen: dict[str, int] = {}
    out = set()
    fence = None
    for line in doc.read_text(encoding="utf-8").splitlines():
        match = FENCE.match(line)
        if fence is None and match:
            fence = match.group(2)
            continue
        if fence is not None:
            if line.strip().startswith(fence[0] * len(fence)):
                fence = None
            continue
        head = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not head:
            continue
        title = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", head.group(1)).replace("`", "")
        slug = re.sub(r"[^\w\- ]", "", title.strip().lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def link_problems(doc: Path) -> list[str]:
    text = prose(doc.read_text(encoding="utf-8"))
    targets = INLINE_LINK.findall(text) + REFERENCE.findall(text) + AUTOLINK.findall(text)
    problems = [f"a URL in the text: {url}" for url in BARE_URL.findall(text)]
    for target in targets:
        if SCHEME.match(target):
            problems.append(f"{target}: leaves the repository")
            continue
        path_part, _, anchor = target.partition("#")
        path = (doc.parent / path_part).resolve() if path_part else doc
        if not path.is_relative_to(ROOT):
            problems.append(f"{target}: outside the repository")
        elif not path.exists():
            problems.append(f"{target}: no such file")
        elif anchor and path.suffix == ".md" and anchor not in heading_slugs(path):
            problems.append(f"{target}: no heading #{anchor} in {path.relative_to(ROOT)}")
    return [f"{doc.relative_to(ROOT)}: {p}" for p in problems]


@pytest.mark.parametrize(
    "doc", [pytest.param(d, id=str(d.relative_to(ROOT))) for d in LINKED if d.is_file()]
)
def test_links_stay_in_the_repository(doc: Path) -> None:
    problems = link_problems(doc)
    assert not problems, "\n".join(problems)
