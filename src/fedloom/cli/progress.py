"""Progress while a federation runs: a live bar on a terminal, one line per round
elsewhere, nothing with ``--quiet`` (which also silences the libraries' own bars)."""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator
from typing import Any

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from fedloom.cli.consoles import err_console


def silence_progress() -> None:
    """No progress bars or info logging from transformers, huggingface_hub or datasets."""
    os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] = "1"
    os.environ["TRANSFORMERS_VERBOSITY"] = "error"
    os.environ["TRANSFORMERS_NO_ADVISORY_WARNINGS"] = "1"
    with contextlib.suppress(ImportError):
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        hf_logging.set_verbosity_error()
    with contextlib.suppress(ImportError):
        from huggingface_hub.utils import disable_progress_bars

        disable_progress_bars()
    with contextlib.suppress(ImportError):
        import datasets

        datasets.disable_progress_bars()
        datasets.logging.set_verbosity_error()


def hide_library_bars() -> None:
    """No progress bars of transformers or huggingface_hub (loading a model's weights):
    fedloom reports its own phases."""
    os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] = "1"
    with contextlib.suppress(ImportError):
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()


#: what a progress event's kind reports, by its last word (``"local baseline round"``)
_PHASES = {"round": "rounds", "client": "clients training", "evaluate": "clients scored"}


def _phase_of(kind: str) -> tuple[str, str]:
    """(prefix, last word) of an event kind: ``"local baseline round"`` ->
    ``("local baseline", "round")``."""
    prefix, _, last = kind.rpartition(" ")
    return prefix, last


@contextlib.contextmanager
def progress_hook(run_dir: Any, total: int, quiet: bool) -> Iterator[Any]:
    """The progress hook for simulate: none with --quiet; live bars on a terminal (rounds,
    the clients training, the clients scored; the same for a baseline trained after the
    run); elsewhere one plain line per round and per evaluation
    (``round 3/8: train_loss 0.4123, 12.3 s``, ``evaluation: 8/8 clients scored, 41.0 s``)."""
    if quiet:
        yield None
        return
    if not err_console.is_terminal:
        last_line = [time.perf_counter()]
        round_from: dict[str, float] = {}  # per phase prefix: when its round began
        trained_at: dict[str, float] = {}  # ... and when its last client finished training

        def line(kind: str, done: int, of: int) -> None:
            prefix, last = _phase_of(kind)
            now = time.perf_counter()
            began = round_from.setdefault(prefix, last_line[0])
            if last == "round":
                loss = run_dir.latest.get("train", {}).get("train_loss") if not prefix else None
                shown = f"train_loss {loss:.4f}, " if isinstance(loss, (int, float)) else ""
                text = f"round {done}/{of}: {shown}{now - began:.1f} s"
                round_from[prefix] = trained_at[prefix] = now
            elif last == "evaluate":
                if done < of:
                    return
                since = trained_at.get(prefix, began)
                text = f"evaluation: {done}/{of} clients scored, {now - since:.1f} s"
            else:  # a client's training reply: the evaluation starts after the last one
                trained_at[prefix] = now
                return
            err_console.print(
                f"{prefix}: {text}" if prefix else text, highlight=False, soft_wrap=True
            )
            err_console.file.flush()
            last_line[0] = now

        yield line
        return
    with Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=err_console,
        transient=False,
    ) as bar:
        tasks: dict[str, Any] = {"round": bar.add_task("rounds", total=total)}

        def hook(kind: str, done: int, of: int) -> None:
            if kind not in tasks:
                prefix, last = _phase_of(kind)
                name = _PHASES.get(last, last)
                tasks[kind] = bar.add_task(f"{prefix}: {name}" if prefix else name, total=of)
            bar.update(tasks[kind], completed=done, total=of)

        yield hook
