"""Generative fine-tuning (issue 68): a prompt/response task trained with the causal-LM
loss on the response only and scored by generating.

What is checked: the loss equals transformers' own causal-LM loss on the sequences with
the prompt's labels masked (-100), example by example, whatever the padding of the batch;
the response ends with end-of-text, a long prompt is cut from its left inside the frame, a
long response is cut and counted or refused by key; generation is seeded (the same text
twice) and greedy by default; a run on your own JSONL file trains (the responses' NLL
falls), writes the generative metrics and summary entries, and its config.toml rebuilds
the experiment; every label-only piece is refused by its key, exit 2, one line."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import tomli_w
import torch
from conftest import tiny_raw
from generative_rows import prompt_rows, write_jsonl
from typer.testing import CliRunner

from fedloom.cli import app
from fedloom.config import ConfigError, GenerationConfig, ModelConfig, validate
from fedloom.data import Example
from fedloom.data.tasks import generation_task
from fedloom.experiment import Experiment
from fedloom.models.fedmodel import FedModel
from fedloom.models.generative import GenerativeHead

TASK = generation_task("generation")


def _model(max_length: int = 64, backbone: str = "tiny-llama", **kwargs: object) -> FedModel:
    cfg = ModelConfig(backbone=backbone, precision="fp32")
    return FedModel.build(cfg, TASK, max_length, 0, **kwargs)  # type: ignore[arg-type]


def _head(model: FedModel) -> GenerativeHead:
    assert isinstance(model.head, GenerativeHead)
    return model.head




@pytest.mark.parametrize("backbone", ["tiny-llama", "tiny-gpt2"])
def test_the_loss_is_transformers_causal_lm_loss_on_the_response_tokens(backbone: str) -> None:
    """Σ over examples of HF's loss (prompt labels -100, no padding) × response tokens,
    over all response tokens, equals the head's loss on the left-padded batch; each
    example's own mean is its ``example_losses`` entry. On Llama (rotary positions) and
    GPT-2 (learned absolute positions, LoRA on its Conv1D layers)."""
    model = _model(backbone=backbone)
    head = _head(model)
    torch.manual_seed(1)
    with torch.no_grad():  # a trained-looking adapter: LoRA's B is zero as built
        for p in model.trainable_parameters().values():
            p.add_(0.05 * torch.randn_like(p))
    examples = [Example("Say hi.", None, "hi there"),
                Example("A much longer prompt that asks for a long answer.", None,
                        "a long answer with several words in it"),
                Example("Name a fruit.", None, "apple")]
    features = head.encode(examples)
    batch = head.collate(features)
    head.eval()
    totals, counts = [], []
    for f in features:
        ids = torch.tensor([f["prompt_ids"] + f["response_ids"]])
        labels = torch.tensor([[-100] * len(f["prompt_ids"]) + f["response_ids"]])
        with torch.no_grad():
            loss = head.lm(input_ids=ids, labels=labels).loss
        totals.append(float(loss) * len(f["response_ids"]))
        counts.append(len(f["response_ids"]))
    with torch.no_grad():
        assert float(head.loss(batch)) == pytest.approx(sum(totals) / sum(counts), rel=1e-5)
        each = head.example_losses(batch)
    assert each.tolist() == pytest.approx([t / c for t, c in zip(totals, counts)], rel=1e-5)


def test_the_response_ends_with_end_of_text_and_a_long_prompt_is_cut_from_its_left() -> None:
    head = _head(_model(max_length=24))
    words = " ".join(f"w{i}" for i in range(40))
    (short, long) = head.encode([Example("Say hi.", None, "hi"),
                                 Example(f"{words} keep this end", None, "ok")])
    assert short["response_ids"][-1] == head.eos and not short["cut"]
    assert len(long["prompt_ids"]) + len(long["response_ids"]) == 24
    text = head.tokenizer.decode(long["prompt_ids"])
    assert "keep this end" in text and "w0 " not in text  # its beginning went
    assert long["prompt_ids"][-len(head._after):] == head._after  # the frame is whole


def test_a_long_response_is_cut_and_counted_or_refused_by_key() -> None:
    long = Example("Tell me everything.", None, " ".join(["word"] * 60))
    cut = _head(_model(max_length=24)).encode([long])[0]
    assert cut["cut"] and len(cut["prompt_ids"]) + len(cut["response_ids"]) == 24
    assert cut["response_ids"][-1] != _head(_model(max_length=24)).eos
    strict = _head(_model(max_length=24, truncate_responses=False))
    with pytest.raises(ValueError, match=r"^data\.truncate_responses: example 0's response"):
        strict.encode([long])


def test_generation_is_seeded_and_greedy_by_default() -> None:
    features = _head(_model()).encode([Example(f"Prompt {i}.", None, "x") for i in range(5)])
    greedy = _model(generation=GenerationConfig(max_new_tokens=6))
    first = greedy.generate(features, 2)
    assert first == greedy.generate(features, 3) and all(first)  # batching does not matter
    sampled = GenerationConfig(max_new_tokens=6, do_sample=True, temperature=2.0)
    a = _model(generation=sampled).generate(features, 2)
    assert a == _model(generation=sampled).generate(features, 2)  # the same text twice
    assert a != first


def _run(tmp_path: Path, *overrides: str, rows: int = 120) -> tuple[int, str, Path]:
    train = write_jsonl(tmp_path / "train.jsonl", prompt_rows(rows))
    dev = write_jsonl(tmp_path / "dev.jsonl", prompt_rows(24))
    raw = tiny_raw(
        'data.task="generation"', f'data.train_path="{train}"', f'data.dev_path="{dev}"',
        "data.max_train_examples=0", "data.max_dev_examples=0", 'model.backbone="tiny-llama"',
        "eval.generation.max_new_tokens=8", *overrides)
    config = tmp_path / "gen.toml"
    config.write_text(tomli_w.dumps(raw))
    result = CliRunner().invoke(
        app, ["run", "--no-report", str(config), "--output-dir", str(tmp_path / "runs")])
    runs = sorted((tmp_path / "runs").glob("*")) if (tmp_path / "runs").is_dir() else []
    return result.exit_code, result.stderr, runs[-1] if runs else tmp_path


def test_a_run_on_your_own_prompt_response_file_trains_and_scores_generations(
    tmp_path: Path,
) -> None:
    code, err, run = _run(tmp_path, 'partition.scheme="feature"', 'partition.feature="topic"',
                          "partition.num_clients=2", "federation.rounds=3",
                          "train.local_steps=6", "train.lr=0.02",
                          'eval.metrics=["rougeL", "exact_match", "token_f1", "nll", '
                          '"perplexity"]')
    assert code == 0, err
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    dev = [r for r in rows if r.get("scope") == "global/dev"]
    assert len(dev) == 3 and all(r["n"] == 24 for r in dev)
    assert dev[-1]["nll"] < dev[0]["nll"] - 0.05  # the responses got likelier
    assert dev[-1]["perplexity"] == pytest.approx(math.exp(dev[-1]["nll"]), rel=1e-6)
    assert dev[-1]["loss"] == dev[-1]["nll"]
    assert all(0 <= dev[-1][m] <= 1 for m in ("rougeL", "exact_match", "token_f1"))
    summary = json.loads((run / "summary.json").read_text())
    assert summary["task_kind"] == "generation" and summary["main_metric"] == "rougeL"
    # each client scored on the dev pairs of its own topic (12 of the 24), and its split
    assert summary["client_mode"] == "dev_matched"
    clients = [r for r in rows if r.get("scope") == "global/clients"][-1]["per_client"]
    assert all(scores["n"] == 12 for scores in clients.values()), clients
    assert any(r.get("scope") == "global/clients_split" for r in rows)
    assert summary["responses_cut"] == {"clients": 0, "dev": 0}
    assert set(summary["global"]["clients"]) >= {"rougeL", "nll"}
    samples = [json.loads(x) for x in (run / "samples.jsonl").read_text().splitlines()]
    assert [r["client"] for r in samples] == [0, 0, 0, 1, 1, 1]
    assert all(r["prompt"].startswith("Describe the ") and r["reference"] and
               isinstance(r["global"], str) and r["personal"] is None for r in samples)
    # fedloom eval on the dev file scores the final global adapter as the run did
    scored = CliRunner().invoke(app, ["eval", str(run), "--data", str(tmp_path / "dev.jsonl")])
    assert scored.exit_code == 0, scored.stderr
    again_dev = json.loads(scored.stdout)["global"]
    assert again_dev == pytest.approx({k: dev[-1][k] for k in again_dev}, rel=1e-6)
    # the run directory's config builds the same experiment (what resume and eval read)
    again = Experiment.build(validate(__import__("tomllib").loads(
        (run / "config.toml").read_text())))
    assert again.task.generative and len(again.dev or []) == 24


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (['model.backbone="tiny-bert"'], "model.backbone: tiny-bert is an encoder"),
        (['partition.scheme="dirichlet"'], 'partition.scheme: "dirichlet" skews'),
        (["partition.concept.fraction=0.5"], "partition.concept: a concept shift"),
        (['eval.baselines=["majority"]'], 'eval.baselines: "majority" predicts a class'),
        (['eval.client_mode="dev_weighted"'], "eval.client_mode:"),
        (['eval.client_mode="dev_matched"'], 'eval.client_mode: "dev_matched" does not'),
        (['eval.metrics=["accuracy"]'], "eval.metrics: task 'generation': metrics"),
        (['algorithm.name="fedlc"'], "algorithm.name"),
        (['algorithm.name="fedem"'], "algorithm.name: fedem needs class labels"),
        (['attack.name="label_flip"', "attack.fraction=0.34"], "attack.name: label_flip"),
        (['data.label_names=["a", "b"]'], "data.label_names: generative task"),
        (['data.response_field="answer"'], "line 1: missing field 'answer'"),
        (["eval.generation.max_new_tokens=0"], "eval.generation.max_new_tokens"),
        (["eval.generation.temperature=0.0"], "eval.generation.temperature"),
        (["eval.generation.beams=2"], "eval.generation.beams: unknown key"),
        (["data.truncate_responses=false", "data.max_length=10"],
         "data.truncate_responses: example"),
    ],
)
def test_what_a_generative_task_cannot_run_with_is_refused_by_key(
    tmp_path: Path, overrides: list[str], message: str
) -> None:
    code, err, _ = _run(tmp_path, "federation.rounds=1", *overrides, rows=30)
    lines = [x for x in err.strip().splitlines() if x.startswith("error")]
    assert code == 2 and len(lines) == 1 and message in lines[0], err
    assert not (tmp_path / "runs").is_dir() or not any((tmp_path / "runs").glob("*/metrics*"))


def test_an_empty_response_is_refused_naming_the_file_and_line(tmp_path: Path) -> None:
    rows = prompt_rows(30)
    rows[4]["response"] = "  "
    train = write_jsonl(tmp_path / "bad.jsonl", rows)
    code, err, _ = _run(tmp_path, f'data.train_path="{train}"')
    assert code == 2 and f"{train}, line 5: the response is empty" in err, err


@pytest.mark.parametrize(
    "overrides",
    [
        ['algorithm.name="ditto"'],
        ['algorithm.name="ifca"', "algorithm.num_clusters=2"],
        ['algorithm.name="fedsa_lora"'],
        ['algorithm.name="fedavg"', "eval.baselines=[\"zero_shot\", \"local\"]"],
        ['algorithm.name="fedavg"', 'privacy.level="client"', "privacy.noise_multiplier=0.3",
         "privacy.clip_norm=0.5", 'privacy.noise="client"', 'secagg.protocol="secagg+"'],
        ['algorithm.name="fedavg"', 'privacy.level="sample"', "privacy.noise_multiplier=0.5",
         "privacy.clip_norm=1.0"],
        ['algorithm.name="fedavg"', 'transforms=[{name = "compress", compressor = "topk"}]',
         'attack.name="alie"', "attack.clients=[1]"],
        ['algorithm.name="flexlora"', 'model.backbone="tiny-gpt2"'],
    ],
    ids=["ditto", "ifca", "fedsa_lora", "zero_shot+local", "client DP+secagg+", "DP-SGD",
         "top-k+ALIE", "GPT-2+flexlora"],
)
def test_methods_and_pieces_run_on_a_generative_task(tmp_path: Path, overrides: list[str]) -> None:
    """Each finishes a round on the generative task with its scores (the teacher-forced
    NLL, and ROUGE-L of three generated tokens) for every adapter it reports."""
    code, err, run = _run(tmp_path, "federation.rounds=1", 'eval.metrics=["rougeL", "nll"]',
                          "eval.generation.max_new_tokens=3", *overrides,
                          rows=60)
    assert code == 0, err
    summary = json.loads((run / "summary.json").read_text())
    scored = [a for a in ("global", "personal", "local", "zero_shot") if a in summary]
    assert scored and all(math.isfinite(summary[a]["clients"]["nll"]["mean"]) for a in scored)
    if "zero_shot" in overrides[-1]:
        assert {"zero_shot", "local"} <= set(summary)
    if "personal" in summary:  # Others by the references' NLL alone: no K² generations
        others = summary["self_others"]["others"]
        assert "nll" in others and "rougeL" not in others, others
        assert "rougeL" in summary["self_others"]["self"]
    samples = [json.loads(x) for x in (run / "samples.jsonl").read_text().splitlines()]
    assert samples and all(r["prompt"] and r["reference"] for r in samples)
    assert all(isinstance(r["personal"], str) for r in samples) == ("personal" in summary)


def test_a_merged_update_acts_on_gpt2s_conv1d_layer_as_on_a_linear_one() -> None:
    """GPT-2 stores a Conv1D weight as (in, out), the transpose of a product B A: a merged
    update M (out, in) makes the layer compute (W0 + s M) x + s B A x all the same."""
    from fedloom.models.merged import merged_name

    model = _model(backbone="tiny-gpt2")
    module = "lm.transformer.h.0.attn.c_attn"
    layer = model.merged.layers[module]
    out_features, in_features = model.merged.shape(module)
    assert model.merged.transposed(module) and (out_features, in_features) == (96, 32)
    g = torch.Generator().manual_seed(0)
    params = {n: t + 0.1 * torch.randn(t.shape, generator=g)
              for n, t in model.initial_params.items()}
    merged = torch.randn(out_features, in_features, generator=g)
    x = torch.randn(3, in_features, generator=g)
    model.head.eval()  # no LoRA dropout
    model.set_params(params)
    before = layer(x)
    model.set_params(params | {merged_name(module): merged})
    scale = layer.scaling["default"]
    torch.testing.assert_close(layer(x), before + scale * x @ merged.T, rtol=1e-5, atol=1e-5)


# --- chat records (data.messages_field) -----------------------------------------------------

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _chat(*turns: tuple[str, str]) -> dict[str, object]:
    return {"messages": [{"role": r, "content": c} for r, c in turns], "user": "u1"}


def test_chat_records_are_read_with_their_turns_and_refused_naming_file_and_line(
    tmp_path: Path,
) -> None:
    from fedloom.data import DataError, load_chat_table

    good = write_jsonl(tmp_path / "chat.jsonl", [_chat(("system", "Be brief."), ("user", "Hi"),
                                                   ("assistant", "Hello."))])
    (example,) = load_chat_table(good)
    assert example.chat == (("system", "Be brief."), ("user", "Hi")) and example.label == "Hello."
    assert example.text_a == "Hi" and example.meta == {"user": "u1"}
    bad = {
        "last turn is the response": _chat(("user", "Hi"), ("user", "Again")),
        "role 'bot' is not one of": _chat(("user", "Hi"), ("bot", "Hello.")),
        "turn 1: the content is empty": _chat(("user", "Hi"), ("assistant", " ")),
        "before the response is the user's": _chat(("system", "S"), ("assistant", "Hello.")),
        "at least two": _chat(("assistant", "Hello.")),
    }
    for message, record in bad.items():
        path = write_jsonl(tmp_path / "bad.jsonl", [_chat(("user", "a"), ("assistant", "b")), record])
        with pytest.raises(DataError, match=rf"bad.jsonl, line 2: field 'messages'.*{message}"):
            load_chat_table(path)
    with pytest.raises(DataError, match=r"use \.jsonl"):
        load_chat_table(tmp_path / "chat.csv")


def _chat_head(max_length: int) -> GenerativeHead:
    """tiny-llama's head with a ChatML template on its tokenizer (it has none of its own)."""
    from fedloom.models.heads import prompt_frame

    head = _head(_model(max_length=max_length))
    head.tokenizer.chat_template = CHATML
    head.lead = ""
    head._before, head._after = prompt_frame(head.tokenizer, "")
    return head


def test_a_chat_prompt_is_the_template_rendered_and_cut_from_its_earliest_turns() -> None:
    turns = (("system", "be brief"), ("user", "first question"), ("assistant", "first answer"),
             ("user", "second question"))
    head = _chat_head(256)
    (f,) = head.encode([Example("second question", None, "ok", chat=turns)])
    rendered = head.tokenizer.apply_chat_template(
        [{"role": r, "content": c} for r, c in turns], add_generation_prompt=True, tokenize=False)
    before, after = rendered.split("second question")
    assert f["prompt_ids"] == head._ids(before) + head._ids("second question") + head._ids(after)
    # too long for 96 tokens: the oldest turns go, the system prompt and the last question stay
    long = (("system", "be brief"), *((("user", "q " * 8), ("assistant", "a " * 8)) * 3),
            ("user", "last question"))
    short = _chat_head(96)
    (g,) = short.encode([Example("last question", None, "ok", chat=long)])
    text = short.tokenizer.decode(g["prompt_ids"])
    assert len(g["prompt_ids"]) + len(g["response_ids"]) <= 96
    assert "be brief" in text and "last question" in text
    assert 0 < text.count("q q q q q q q q") < 3  # some earlier turns, not all


def test_a_run_on_chat_records_trains(tmp_path: Path) -> None:
    chats = [_chat(("user", r["prompt"]), ("assistant", r["response"])) for r in prompt_rows(40)]
    train = write_jsonl(tmp_path / "chats.jsonl", chats[8:])
    dev = write_jsonl(tmp_path / "chat-dev.jsonl", chats[:8])
    code, err, run = _run(tmp_path, f'data.train_path="{train}"', f'data.dev_path="{dev}"',
                          'data.messages_field="messages"',
                          "federation.rounds=1", 'eval.metrics=["rougeL", "nll"]')
    assert code == 0, err
    assert json.loads((run / "summary.json").read_text())["task_kind"] == "generation"


@pytest.mark.needs_glue("MRPC", "RTE")
def test_a_multi_task_generative_federation_holds_each_task_on_its_clients(tmp_path: Path) -> None:
    """partition.tasks over built-in generative tasks: one pool tagged by task, each client
    on its task's examples, scored on every task's metrics."""
    raw = tiny_raw('partition.tasks.names=["mrpc-paraphrase", "rte-generate"]',
                   "partition.num_clients=4", "data.max_train_examples=40",
                   "data.max_dev_examples=8", 'model.backbone="tiny-llama"',
                   "eval.generation.max_new_tokens=3", "federation.rounds=1",
                   output_dir=tmp_path)
    exp = Experiment.build(validate(raw))
    assert exp.task.generative and exp.task.name == "mrpc-paraphrase+rte-generate"
    assert exp.task.metrics == ("rougeL", "rouge1", "rouge2", "nll", "exact_match")
    tasks = {c.client_id: {exp.data.train[i].meta["task"] for i in c.split.train}
             for c in exp.clients}
    assert tasks == {0: {"mrpc-paraphrase"}, 1: {"rte-generate"}, 2: {"mrpc-paraphrase"},
                     3: {"rte-generate"}}
    with pytest.raises(ConfigError, match="partition.tasks.names: generative and classif"):
        Experiment.build(validate({**raw, "partition": {**raw["partition"],
                                                        "tasks": {"names": ["mrpc-paraphrase",
                                                                            "RTE"]}}}))
