"""``fedloom generate``: a generative run's saved adapter answering prompts."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated, Any

import typer

from fedloom.cli.consoles import notify
from fedloom.cli.errors import describe_error, fail
from fedloom.config import ConfigError


def generate(
    run_dir: Annotated[Path, typer.Argument(help="a run directory of a generative task")],
    prompt: Annotated[
        list[str] | None, typer.Option("--prompt", help="a prompt to answer (repeatable)")
    ] = None,
    input_: Annotated[
        Path | None,
        typer.Option("--input", help="a JSONL file of prompts, one JSON object per line"),
    ] = None,
    output: Annotated[
        Path | None,
        typer.Option(help="write the answers there as JSONL records (default: stdout)"),
    ] = None,
    client: Annotated[
        int | None,
        typer.Option(help="answer with this client's personal adapter (default: global)"),
    ] = None,
    prompt_field: Annotated[
        str | None,
        typer.Option(help="the field of --input's records with the prompt (default: the run's)"),
    ] = None,
    response_field: Annotated[
        str, typer.Option(help="the field of each output record with the answer")
    ] = "response",
    max_new_tokens: Annotated[
        int | None, typer.Option(help="most tokens an answer has (default: the run's)")
    ] = None,
    do_sample: Annotated[
        bool | None,
        typer.Option("--do-sample/--no-do-sample", help="sample (seeded) instead of greedy"),
    ] = None,
    temperature: Annotated[float | None, typer.Option(help="sampling temperature, > 0")] = None,
    top_p: Annotated[float | None, typer.Option(help="nucleus sampling's mass, in (0, 1]")] = None,
    top_k: Annotated[int | None, typer.Option(help="sample among the k likeliest (0: all)")] = None,
    num_beams: Annotated[int | None, typer.Option(help="beam search's beams (1: none)")] = None,
    repetition_penalty: Annotated[
        float | None, typer.Option(help="penalty on repeated tokens (1: none)")
    ] = None,
    no_repeat_ngram_size: Annotated[
        int | None, typer.Option(help="no n-gram of this size twice (0: off)")
    ] = None,
    batch_size: Annotated[
        int | None,
        typer.Option(help="prompts per generate call (default: the run's eval.batch_size)"),
    ] = None,
) -> None:
    """Answer prompts with a generative run's saved adapter.

    RUN_DIR is a run directory of a generative task written by fedloom run or fedloom
    serve; its newest good checkpoint answers, the global adapter or, with --client K,
    client K's personal one. The answers follow the run's [eval.generation] settings,
    each replaced by its option. With --prompt, the answers are printed, one per prompt;
    with --input, each record of the JSONL file is answered from its prompt field
    (data.prompt_field of the run, or --prompt-field) and written as a JSONL record with
    "prompt", "response" and the record's other fields, to --output (written whole or not
    at all) or stdout. Says on stderr which round the checkpoint is from and whether the
    run finished; bad settings, prompts and damaged checkpoints exit with status 2.

    Examples:
        fedloom generate runs/chat-20261122-130000 --prompt "Describe the cat."
        fedloom generate RUN_DIR --client 3 --input in.jsonl --output out.jsonl
        fedloom generate RUN_DIR --prompt "Say hi." --do-sample --temperature 0.7
    """
    from fedloom.data import DataError
    from fedloom.evaluation.generate_run import (
        answer_records,
        generate_from_run,
        read_prompt_file,
        run_config,
    )
    from fedloom.runtime.rundir import CheckpointError, atomic_write

    if (prompt is None) == (input_ is None):
        fail("pass --prompt TEXT or --input FILE.jsonl (one of them)")
    if prompt_field is not None and input_ is None:
        fail("--prompt-field: names the prompt's field of --input's records; --input is missing")
    if output is not None:
        if output.is_dir():
            fail(f"--output {output}: is a directory, not a file")
        if not output.parent.is_dir():
            fail(f"--output {output}: the folder {output.parent} does not exist")
    settings: dict[str, Any] = {
        "max_new_tokens": max_new_tokens,
        "do_sample": do_sample,
        "temperature": temperature,
        "top_p": top_p,
        "top_k": top_k,
        "num_beams": num_beams,
        "repetition_penalty": repetition_penalty,
        "no_repeat_ngram_size": no_repeat_ngram_size,
    }
    try:
        if input_ is not None:
            field = prompt_field or run_config(run_dir).data.prompt_field
            records = [r for _, r in read_prompt_file(input_, field, ("prompt", response_field))]
            prompts = [str(r[field]) for r in records]
        else:
            field, prompts = "prompt", list(prompt or [])
            records = [{"prompt": p} for p in prompts]
        answers = generate_from_run(
            run_dir,
            prompts,
            client=client,
            settings=settings,
            batch_size=batch_size,
            notify=notify,
        )
    except (ConfigError, DataError, CheckpointError, FileNotFoundError) as err:
        fail(str(err))
    if input_ is None and output is None:
        sys.stdout.write("".join(answer + "\n" for answer in answers))
        return
    lines = "".join(
        json.dumps(record, ensure_ascii=False) + "\n"
        for record in answer_records(records, field, answers, response_field)
    )
    if output is None:
        sys.stdout.write(lines)
        return
    try:
        atomic_write(output, lines.encode("utf-8"))
    except OSError as err:
        fail(f"--output {output}: {describe_error(err)}")
    notify(f"{len(answers)} answers written to {output}")
