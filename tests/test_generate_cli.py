"""``fedloom generate``: a generative run's saved adapter answering prompts.

What is checked, on one tiny Ditto run of a prompt/response file (tiny-llama, 2 clients,
1 round, so a global and two personal adapters are saved): ``--prompt`` prints what
``FedModel.generate`` answers with the global checkpoint in place, the same text twice;
``--client 1`` answers with client 1's personal checkpoint; ``--input``/``--output`` writes
one record per input record, its other fields kept, atomically; the run's
``[eval.generation]`` settings are replaced by their options and a bad value is refused
naming the option; a run that is not generative, a missing or empty prompt, a client
without a personal adapter, a damaged checkpoint and an output folder that does not exist
are each refused with one line, exit status 2."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import tomli_w
from conftest import tiny_raw
from generative_rows import prompt_rows, write_jsonl
from typer.testing import CliRunner, Result

from fedloom.cli import app
from fedloom.config import load_config
from fedloom.data import Example
from fedloom.data.tasks import generation_task
from fedloom.models.fedmodel import FedModel
from fedloom.runtime.rundir import load_params

PROMPTS = ["Describe the cat.", "Describe the rice.", "Tell me about a horse and a cow."]




def invoke(*args: object) -> Result:
    return CliRunner().invoke(app, ["generate", *map(str, args)])


def error_line(result: Result) -> str:
    """The one ``error:`` line of a refused command (exit status 2)."""
    lines = [x for x in result.stderr.strip().splitlines() if x.startswith("error")]
    assert result.exit_code == 2 and len(lines) == 1, (result.exit_code, result.stderr)
    return lines[0]


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A finished Ditto run of a generative task: global and personal adapters saved."""
    tmp = tmp_path_factory.mktemp("generate")
    train = write_jsonl(tmp / "train.jsonl", prompt_rows(24))  # type: ignore[arg-type]
    raw = tiny_raw(
        'data.task="generation"', f'data.train_path="{train}"', "data.max_train_examples=0",
        'model.backbone="tiny-llama"', 'algorithm.name="ditto"', "partition.num_clients=2",
        "federation.rounds=1", "train.local_steps=2", "train.lr=0.05",
        'eval.metrics=["rougeL", "nll"]', "eval.generation.max_new_tokens=6")
    config = tmp / "gen.toml"
    config.write_text(tomli_w.dumps(raw))
    result = CliRunner().invoke(
        app, ["run", "--no-report", str(config), "--output-dir", str(tmp / "runs")])
    assert result.exit_code == 0, result.stderr
    (run_dir,) = (tmp / "runs").iterdir()
    assert (run_dir / "checkpoints" / "personal" / "client_001.safetensors").is_file()
    return run_dir


def expected(
    run_dir: Path, checkpoint: str, prompts: list[str], batch_size: int, **settings: object
) -> list[str]:
    """``FedModel.generate``'s answers with ``checkpoint`` in place and the run's
    generation ``settings`` replaced, on the model built from the run's config, a prompt
    encoded as for answering (with an empty reference response)."""
    cfg = load_config(run_dir / "config.toml")
    generation = cfg.eval.generation.model_copy(update=settings)
    model = FedModel.build(cfg.model, generation_task("generation"), cfg.data.max_length,
                           cfg.seed, generation=generation)
    model.set_params(load_params(run_dir / "checkpoints" / checkpoint))
    return model.generate(model.encode([Example(p, None, "") for p in prompts]), batch_size)


def test_a_prompt_is_answered_by_the_global_adapter_the_same_twice(run: Path) -> None:
    first = invoke(run, "--prompt", PROMPTS[0])
    assert first.exit_code == 0, first.stderr
    (answer,) = expected(run, "global.safetensors", PROMPTS[:1], 1)
    assert answer and first.stdout == answer + "\n"
    assert "global.safetensors" in first.stderr and "round 1 of 1" in first.stderr
    assert "the run finished" in first.stderr
    again = invoke(run, "--prompt", PROMPTS[0])
    assert again.exit_code == 0 and again.stdout == first.stdout


def test_several_prompts_are_answered_in_their_order(run: Path) -> None:
    result = invoke(run, "--prompt", PROMPTS[0], "--prompt", PROMPTS[1], "--batch-size", 2)
    assert result.exit_code == 0, result.stderr
    assert result.stdout.splitlines() == expected(run, "global.safetensors", PROMPTS[:2], 2)


def test_a_client_answers_with_its_personal_adapter(run: Path) -> None:
    personal = load_params(run / "checkpoints" / "personal" / "client_001.safetensors")
    shared = load_params(run / "checkpoints" / "global.safetensors")
    assert any(not personal[k].equal(shared[k]) for k in shared)  # a different adapter
    result = invoke(run, "--prompt", PROMPTS[0], "--client", 1)
    assert result.exit_code == 0, result.stderr
    (answer,) = expected(run, "personal/client_001.safetensors", PROMPTS[:1], 1)
    assert result.stdout == answer + "\n"
    assert "client 1's personal adapter" in result.stderr


def test_an_input_file_is_answered_record_by_record_into_the_output(
    run: Path, tmp_path: Path
) -> None:
    records = [{"id": i, "question": p, "topic": ["x", i]} for i, p in enumerate(PROMPTS)]
    source = write_jsonl(tmp_path / "in.jsonl", records)  # type: ignore[arg-type]
    with source.open("a") as handle:
        handle.write("\n")  # a blank line is skipped
    out = tmp_path / "out.jsonl"
    result = invoke(run, "--input", source, "--prompt-field", "question", "--output", out,
                    "--max-new-tokens", 3, "--batch-size", 2)
    assert result.exit_code == 0, result.stderr
    written = [json.loads(x) for x in out.read_text().splitlines()]
    answers = expected(run, "global.safetensors", PROMPTS, 2, max_new_tokens=3)
    assert [w.pop("response") for w in written] == answers
    assert written == [{"prompt": r["question"], "id": r["id"], "topic": r["topic"]}
                       for r in records]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.jsonl", "out.jsonl"]
    assert result.stdout == ""


def test_an_input_file_with_references_is_answered_on_stdout_beside_them(
    run: Path, tmp_path: Path
) -> None:
    """The run's own prompt/response file: its "response" (the reference) is not
    overwritten: the answer needs a field of its own (--response-field)."""
    source = write_jsonl(tmp_path / "dev.jsonl", prompt_rows(3))  # type: ignore[arg-type]
    line = error_line(invoke(run, "--input", source))
    assert f"{source}, line 1: the record already has a field 'response'" in line
    result = invoke(run, "--input", source, "--response-field", "generated")
    assert result.exit_code == 0, result.stderr
    written = [json.loads(x) for x in result.stdout.splitlines()]
    answers = expected(run, "global.safetensors", [r["prompt"] for r in prompt_rows(3)], 32)
    assert written == [{"prompt": r["prompt"], "generated": a, "response": r["response"],
                        "topic": r["topic"]} for r, a in zip(prompt_rows(3), answers)]


def test_sampling_is_seeded_and_greedy_ignores_the_sampling_settings(run: Path) -> None:
    sampled = [invoke(run, "--prompt", PROMPTS[0], "--do-sample", "--temperature", 2.0,
                      "--top-k", 0) for _ in range(2)]
    assert all(r.exit_code == 0 for r in sampled) and sampled[0].stdout == sampled[1].stdout
    assert sampled[0].stdout == "".join(
        a + "\n" for a in expected(run, "global.safetensors", PROMPTS[:1], 1, do_sample=True,
                                   temperature=2.0, top_k=0))
    greedy = invoke(run, "--prompt", PROMPTS[0], "--temperature", 2.0)
    assert greedy.exit_code == 0
    assert greedy.stdout == invoke(run, "--prompt", PROMPTS[0]).stdout
    assert "warning: --temperature has no effect without --do-sample" in greedy.stderr


@pytest.mark.parametrize(
    ("options", "named"),
    [
        (["--max-new-tokens", "0"], "--max-new-tokens 0:"),
        (["--temperature", "0", "--do-sample"], "--temperature 0.0:"),
        (["--top-p", "1.5"], "--top-p 1.5:"),
        (["--batch-size", "0"], "--batch-size 0:"),
        (["--prompt", "  "], "--prompt '  ': the prompt is empty"),
        (["--client", "7"], "--client 7: the run has clients 0 to 1"),
    ],
)
def test_a_bad_setting_or_prompt_is_refused_naming_its_option(
    run: Path, options: list[str], named: str
) -> None:
    assert named in error_line(invoke(run, "--prompt", "Say hi.", *options))


def test_a_run_that_is_not_generative_is_refused(tmp_path: Path) -> None:
    (tmp_path / "config.toml").write_text(tomli_w.dumps(tiny_raw()))  # MRPC on tiny-bert
    line = error_line(invoke(tmp_path, "--prompt", "Say hi."))
    assert f"{tmp_path / 'config.toml'}: data.task = 'MRPC' is not a generative task" in line


def test_a_missing_prompt_field_is_refused_naming_the_file_and_line(
    run: Path, tmp_path: Path
) -> None:
    source = write_jsonl(tmp_path / "in.jsonl", [{"prompt": "Say hi."}, {"question": "Say hi."}])
    out = write_jsonl(tmp_path / "out.jsonl", [{"old": True}])
    line = error_line(invoke(run, "--input", source, "--output", out))
    assert f"{source}, line 2: missing field 'prompt'" in line
    assert json.loads(out.read_text()) == {"old": True}  # not touched
    empty = write_jsonl(tmp_path / "empty.jsonl", [{"prompt": "Say hi."}, {"prompt": " "}])
    assert f"{empty}, line 2: field 'prompt': the prompt is empty" in error_line(
        invoke(run, "--input", empty))


def test_an_output_into_a_missing_folder_is_refused_and_leaves_nothing(
    run: Path, tmp_path: Path
) -> None:
    source = write_jsonl(tmp_path / "in.jsonl", [{"prompt": "Say hi."}])
    out = tmp_path / "missing" / "out.jsonl"
    line = error_line(invoke(run, "--input", source, "--output", out))
    assert f"--output {out}: the folder {out.parent} does not exist" in line
    assert not out.parent.exists()


def test_a_client_without_a_personal_adapter_or_a_damaged_checkpoint_is_refused(
    run: Path, tmp_path: Path
) -> None:
    copy = Path(shutil.copytree(run, tmp_path / "run"))
    (copy / "checkpoints" / "personal" / "client_001.safetensors").unlink()
    line = error_line(invoke(copy, "--prompt", "Say hi.", "--client", 1))
    assert "--client 1:" in line and "no personal adapter of client 1" in line
    damaged = copy / "checkpoints" / "global.safetensors"
    damaged.write_bytes(damaged.read_bytes()[:-20])
    line = error_line(invoke(copy, "--prompt", "Say hi."))
    assert f"{damaged}: damaged checkpoint" in line and "no previous checkpoint" in line
