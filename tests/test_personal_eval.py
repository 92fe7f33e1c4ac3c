"""`fedloom eval --personal` after a run scores exactly the adapters the clients used.

For every personalized method: the run's own client-side scores of each client's
personal adapter on its test split are reproduced by `fedloom eval --personal` from the
saved checkpoints on that same test split (written out as a JSONL file), so what eval
reads is what the clients used — also for the dual-adapter model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import needs_glue, tiny_raw
from typer.testing import CliRunner

from fedloom.cli import app
from fedloom.config import load_config
from fedloom.federation import FederatedData

runner = CliRunner()

#: the clients of a method's run where two will not do: FedEM seeds its three components
#: (its default) from the first round's clients. Two suffice otherwise: each eval below
#: scores every client's adapter on one client's split
CLIENTS = {"fedem": 3}
METHODS = ["local", "ditto", "fedper", "fedsa_lora", "fedrep", "fedavg_ft", "pfedme",
           "perfedavg", "apfl", "l2gd", "fedlocal_global", "ifca", "cfl", "fedu", "mocha", "mixture_admm", "pfedmac", "fedem"]


@needs_glue
@pytest.mark.parametrize("method", METHODS)
def test_eval_personal_reproduces_the_clients_scores(method: str, tmp_path: Path) -> None:
    clients = CLIENTS.get(method, 2)
    raw = tiny_raw(f"algorithm.name={method}", "federation.rounds=1",
                   f"partition.num_clients={clients}")
    raw["data"]["text_fields"] = ["sentence1", "sentence2"]
    config = tmp_path / "c.toml"
    import tomli_w

    config.write_text(tomli_w.dumps(raw))
    result = runner.invoke(app, ["run", "--no-report", str(config), "--output-dir", str(tmp_path / "runs"),
                                 "--quiet", "--json"], catch_exceptions=False)
    assert result.exit_code == 0, result.stderr
    (run,) = (tmp_path / "runs").iterdir()
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    # the clients' own test splits: "clients" in split mode, "clients_split" beside the
    # dev-weighted scores (the default, auto, here)
    (personal,) = [r for r in rows if r["scope"] == "personal/clients_split"]
    data = FederatedData.build(load_config(run / "config.toml"))
    names = data.task.label_names
    for split in data.splits:
        path = tmp_path / f"client{split.client_id}.jsonl"
        with path.open("w") as f:
            for e in data.examples(split, split.test):
                f.write(json.dumps({"sentence1": e.text_a, "sentence2": e.text_b,
                                    "label": names[e.label]}) + "\n")
        out = runner.invoke(app, ["eval", str(run), "--data", str(path), "--personal"],
                            catch_exceptions=False)
        assert out.exit_code == 0, out.stderr
        scored = json.loads(out.stdout)["personal"]["clients"][str(split.client_id)]
        expected = personal["per_client"][str(split.client_id)]
        assert scored["n"] == expected["n"]
        assert scored["accuracy"] == pytest.approx(expected["accuracy"])
        assert scored["loss"] == pytest.approx(expected["loss"], rel=1e-5)
