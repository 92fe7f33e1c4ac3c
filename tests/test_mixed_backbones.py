"""Mixed-backbone federations ([[model.groups]]): the config's checks, one model per
backbone with clients encoded by their own, methods run within architecture (one state per
backbone), and FedMosaic sharing PQ-LoRA across backbones block by block and role by
role (fedloom.runtime.cohorts, fedloom.algorithms.fedmosaic.pq_keys)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import GLUE_DIR, needs_glue, tiny_raw
from safetensors import safe_open
from safetensors.torch import load_file

from fedloom.algorithms import ClientResult
from fedloom.algorithms.fedmosaic import TASK_VECTOR, FedMosaic, pq_keys
from fedloom.config import ConfigError, validate
from fedloom.evaluation.finished_run import score_run
from fedloom.evaluation.score import evaluate
from fedloom.evaluation.splits import scored_splits
from fedloom.experiment import Experiment, pooled_party_ids
from fedloom.federation import FederatedData, public_texts
from fedloom.models import align
from fedloom.models.fedmodel import FedModel
from fedloom.runtime.rundir import RunDir, load_params
from fedloom.server import simulate


def mixed_raw(*overrides: str, tmp_path: Path | None = None) -> dict:
    raw = tiny_raw("diagnostics.every=0", "federation.rounds=2", "partition.num_clients=4",
                   *overrides, output_dir=tmp_path)
    raw["model"]["groups"] = [{"clients": [2, 3], "backbone": "tiny-llama"}]
    return raw


@pytest.mark.parametrize(("groups", "message"), [
    ([{"clients": [1, 1], "backbone": "tiny-llama"}], r"client 1 is already"),
    ([{"clients": [1], "backbone": "tiny-llama"}, {"clients": [2], "backbone": "tiny-llama"}],
     r"groups\[1\].backbone"),
    ([{"clients": [0], "backbone": "tiny-bert"}], r"groups\[0\].backbone"),
    ([{"clients": [9], "backbone": "tiny-llama"}], r"groups\[0\].clients: \[9\]"),
    ([{"clients": [], "backbone": "tiny-llama"}], r"model\.groups\[0\]\.clients"),
])
def test_groups_are_checked(groups: list, message: str) -> None:
    raw = tiny_raw("partition.num_clients=4")
    raw["model"]["groups"] = groups
    with pytest.raises(ConfigError, match=message):
        validate(raw)


def test_pq_keys_match_blocks_bottom_up_and_modules_by_role() -> None:
    bert = ["e.layer.1.attention.self.query.lora_P.local", "e.layer.5.output.dense.lora_Q.local",
            "e.layer.5.attention.output.dense.lora_P.local", "e.layer.1.query.lora_A.local.weight"]
    llama = ["m.layers.13.self_attn.q_proj.lora_P.global", "m.layers.29.mlp.down_proj.lora_Q.global",
             "m.layers.29.self_attn.o_proj.lora_P.global", "m.layers.29.mlp.gate_proj.lora_P.global"]
    keys_b, keys_l = pq_keys(bert), pq_keys(llama)
    assert keys_b == {bert[0]: (0, "query", "P"), bert[1]: (1, "mlp_down", "Q"),
                      bert[2]: (1, "attn_out", "P")}
    assert keys_l[llama[0]] == (0, "query", "P") and keys_l[llama[1]] == (1, "mlp_down", "Q")
    assert keys_l[llama[3]] == (1, "mlp_gate", "P")  # no BERT counterpart


BERT_SLOT = {"e.layer.0.attention.self.query.lora_P.global": torch.zeros(2, 2),
             "e.layer.0.attention.self.query.lora_A.global.weight": torch.zeros(2, 3)}
LLAMA_SLOT = {"m.layers.3.self_attn.q_proj.lora_P.global": torch.zeros(2, 2),
              "m.layers.3.self_attn.q_proj.lora_A.global.weight": torch.zeros(2, 5)}


def sent(cid: int, names: dict, value: float) -> ClientResult:
    params = {n.replace(".global", ".local"): torch.full_like(t, value) for n, t in names.items()}
    return ClientResult(cid, {**params, TASK_VECTOR: torch.ones(2, 2)}, 10)


@pytest.mark.parametrize("share_pq", [True, False])
@pytest.mark.parametrize("absent", ["initial", "renormalize"])
def test_fedmosaic_shares_p_and_q_across_backbones_and_nothing_else(
    share_pq: bool, absent: str
) -> None:
    """Llama client 2's others are 0, 1 (bert) and 3 (llama), 1/3 each. Its LoRA A comes
    from client 3 only: at weight 1/3, the bert clients' 2/3 on the initial slot (zeros),
    or renormalized to weight 1; P likewise unless P is shared across backbones."""
    alg = FedMosaic(share_pq=share_pq, weighting="uniform", absent=absent)
    state = alg.init_mixed({"bert": BERT_SLOT, "llama": LLAMA_SLOT},
                           {0: "bert", 1: "bert", 2: "llama", 3: "llama"})
    state = alg.aggregate(state, [sent(0, BERT_SLOT, 1.0), sent(1, BERT_SLOT, 3.0),
                                  sent(2, LLAMA_SLOT, 10.0), sent(3, LLAMA_SLOT, 20.0)])
    payload = alg.payload(state, 2)
    assert payload.keys() == LLAMA_SLOT.keys()
    p_name, a_name = list(LLAMA_SLOT)
    partner_only = 20.0 / 3 if absent == "initial" else 20.0
    expected_p = (1.0 + 3.0 + 20.0) / 3 if share_pq else partner_only
    torch.testing.assert_close(payload[p_name], torch.full((2, 2), expected_p))
    torch.testing.assert_close(payload[a_name], torch.full((2, 5), partner_only))


@needs_glue
def test_an_ordinary_method_runs_within_each_backbone(tmp_path: Path) -> None:
    cfg = validate(mixed_raw("algorithm.name=fedavg", tmp_path=tmp_path))
    exp = Experiment.build(cfg)
    assert list(exp.models) == ["tiny-bert", "tiny-llama"] and exp.mixed and exp.anchor is None
    for c in exp.clients:  # every client's data is encoded by its own model
        assert ("prompt_ids" in c.train[0]) == (c.client_id >= 2)
    run = RunDir.create(tmp_path / "runs", cfg.name)
    summary = simulate(exp, run)
    assert set(summary["backbones"]) == {"tiny-bert", "tiny-llama"}
    assert summary["global"]["clients"]["accuracy"]["n"] == 4
    bert = load_params(run.checkpoints / "global-tiny-bert.safetensors")
    llama = load_params(run.checkpoints / "global-tiny-llama.safetensors")
    assert set(bert) == set(exp.models["tiny-bert"].param_names)
    assert set(llama) == set(exp.models["tiny-llama"].param_names)
    rows = [json.loads(line) for line in run.metrics_path.read_text().splitlines()]
    dev_rows = [r for r in rows if r.get("scope") == "global/dev"]
    assert {r["backbone"] for r in dev_rows} == {"tiny-bert", "tiny-llama"}
    # `fedloom eval` scores each backbone's global adapter with its own model
    scored = score_run(run.path, GLUE_DIR, notify=lambda _: None)
    assert set(scored["global_by_backbone"]) == {"tiny-bert", "tiny-llama"}
    final = {r["backbone"]: r for r in dev_rows if r["round"] == 2}
    for backbone, scores in scored["global_by_backbone"].items():
        assert scores["n"] >= final[backbone]["n"]  # the whole dev set, not the run's subset


def test_centralized_pools_each_backbone_s_clients_into_one_party(tmp_path: Path) -> None:
    cfg = validate(mixed_raw("algorithm.name=centralized", tmp_path=tmp_path))
    exp = Experiment.build(cfg)
    assert pooled_party_ids(cfg) == [0, 2]
    parties = exp.parties()
    assert [p.client_id for p in parties] == [0, 2]
    for party, members in zip(parties, ([0, 1], [2, 3])):  # each in its own model's encoding
        assert party.train == [f for c in exp.clients if c.client_id in members for f in c.train]
    run = RunDir.create(tmp_path / "runs", cfg.name)
    summary = simulate(exp, run)
    assert set(summary["backbones"]) == {"tiny-bert", "tiny-llama"}
    assert summary["global"]["clients"]["accuracy"]["n"] == 4
    rows = [json.loads(line) for line in run.metrics_path.read_text().splitlines()]
    assert [r["clients"] for r in rows if r.get("scope") == "train"] == [[0, 2], [0, 2]]


@needs_glue
def test_fedmosaic_spans_backbones_with_the_smallest_as_anchor(tmp_path: Path) -> None:
    cfg = validate(mixed_raw("algorithm.name=fedmosaic", tmp_path=tmp_path))
    exp = Experiment.build(cfg)
    sizes = {b: m.backbone_size for b, m in exp.models.items()}
    assert exp.anchor == min(sizes, key=sizes.get)
    encoded_as = "prompt_ids" if exp.anchor == "tiny-llama" else "input_ids"
    for c in exp.clients:  # every client's training data, encoded for the anchor too
        anchor_train = exp.anchor_train[c.client_id]
        assert len(anchor_train) == len(c.train) and encoded_as in anchor_train[0]
        assert [f["label"] for f in anchor_train] == [f["label"] for f in c.train]
    run = RunDir.create(tmp_path / "runs", cfg.name)
    summary = simulate(exp, run)
    assert summary["relevance"]["clients"] == [0, 1, 2, 3]  # one relevance over both backbones
    assert summary["personal"]["clients"]["accuracy"]["n"] == 4
    for cid in range(4):
        adapter = load_params(run.checkpoints / "personal" / f"client_{cid:03d}.safetensors")
        assert set(adapter) == set(exp.model_for(cid).param_names)
    # the aligned PQ-LoRA factors the models used are in the run directory, and both
    # adapters of a PQ layer use them; an unaligned build differs
    assert [p.name for p in (run.path / "alignment").iterdir()] == exp.alignment
    big = next(b for b in exp.models if b != exp.anchor)
    tensors = load_file(run.path / "alignment" / exp.alignment[0])
    model = exp.models[big]
    layer = next(m for m in model.head.modules() if hasattr(m, "lora_P"))
    a_global, a_local = layer.lora_A["global"].weight, layer.lora_A["local"].weight
    assert torch.equal(a_global, a_local)
    assert any(torch.equal(a_global, t) for k, t in tensors.items() if k.startswith("big."))
    unaligned = FedModel.build(exp.cfg.model.for_backbone(big), exp.task, 64, cfg.seed)
    fresh = next(m for m in unaligned.head.modules() if hasattr(m, "lora_P"))
    assert not torch.equal(fresh.lora_A["global"].weight, a_global)
    # `fedloom eval --personal` builds each client's own backbone, aligned as in the run
    scored = score_run(run.path, GLUE_DIR, personal=True, notify=lambda _: None)
    assert sorted(scored["personal"]["clients"]) == ["0", "1", "2", "3"]


@needs_glue
def test_a_group_adapting_its_upper_blocks_aligns_them_and_caches_its_prefix(
        tmp_path: Path) -> None:
    raw = mixed_raw("algorithm.name=fedmosaic", "model.lora.pq_blocks=1", tmp_path=tmp_path)
    raw["model"]["groups"][0]["lora"] = {**raw["model"].get("lora", {}), "layers": [1]}
    raw["model"]["groups"][0]["prefix_cache"] = True
    cfg = validate(raw)
    exp = Experiment.build(cfg)
    llama, bert = exp.models["tiny-llama"], exp.models["tiny-bert"]
    assert llama.head.prefix is not None and bert.head.prefix is None
    pq = [n for n, m in llama.head.named_modules() if hasattr(m, "lora_P")]
    assert pq and all(".layers.1." in n for n in pq)
    summary = simulate(exp, RunDir.create(tmp_path / "runs", cfg.name))
    assert summary["personal"]["clients"]["accuracy"]["n"] == 4
    assert len(llama.head.prefix) > 0


@needs_glue
def test_pq_layers_moved_by_lora_layers_are_part_of_the_alignment_key(tmp_path: Path) -> None:
    raw = mixed_raw("algorithm.name=fedmosaic", "model.lora.pq_blocks=1", tmp_path=tmp_path)
    raw["model"]["groups"][0]["lora"] = {**raw["model"].get("lora", {}), "layers": [0]}
    exp = Experiment.build(validate(raw))
    with safe_open(str(tmp_path / ".alignment" / exp.alignment[0]), "pt") as f:
        meta = json.loads(f.metadata()[align._META_KEY])
    side = "big" if exp.anchor == "tiny-bert" else "anchor"
    assert meta[f"{side}_pq_layers"] == "0"  # PQ-LoRA at block 0, not the top block
    assert not any(k.endswith("_pq_layers") and not k.startswith(side) for k in meta)


@needs_glue
def test_public_texts_lie_outside_every_client_s_data(tmp_path: Path) -> None:
    cfg = validate(mixed_raw("algorithm.name=fedmosaic", tmp_path=tmp_path))
    texts = public_texts(cfg, 50)
    assert len(texts) == len(set(texts)) == 50
    data = FederatedData.build(cfg)
    pooled = {" ".join(t for t in (e.text_a, e.text_b) if t) for e in data.train}
    assert not pooled & set(texts)
    with pytest.raises(ConfigError, match="model.alignment.texts"):
        public_texts(cfg, 10**6)


@needs_glue
@pytest.mark.parametrize(("method", "personal"), [("local", True), ("fedavg", False)])
def test_others_crosses_backbones_on_dev_weighted_splits(
    method: str, personal: bool, tmp_path: Path
) -> None:
    """Others_i averages every other client's dev-weighted split, whatever its backbone: a
    bert client's adapter scored on a llama client's weighting of the dev set runs on
    bert's encoding of the same dev examples."""
    cfg = validate(mixed_raw(f"algorithm.name={method}", 'eval.client_mode="dev_weighted"',
                             tmp_path=tmp_path))
    exp = Experiment.build(cfg)
    run = RunDir.create(tmp_path / "runs", cfg.name)
    summary = simulate(exp, run)
    adapter = "personal" if personal else "global"
    rows = [json.loads(line) for line in run.metrics_path.read_text().splitlines()]
    (others,) = [r for r in rows if r.get("scope") == f"{adapter}/others"]
    assert summary["self_others"]["adapter"] == adapter
    assert all(o["clients"] == 3 for o in others["per_client"].values())
    cohorts = {next(iter(c.models)): c for c in exp.cohorts()}
    splits = {c.client_id: scored_splits(cohorts[exp.backbone_of(c.client_id)], c)["clients"]
              for c in exp.clients}
    for i in range(4):
        own = cohorts[exp.backbone_of(i)]
        name = (f"personal/client_{i:03d}" if personal
                else f"global-{exp.backbone_of(i)}")
        params = load_params(run.checkpoints / f"{name}.safetensors")
        on = [evaluate(own.model, params,  # D_j re-encoded by i's backbone, by dev_index
                       [{**own.dev[f["dev_index"]], "weight": f["weight"]} for f in splits[j]], 32)
              for j in range(4) if j != i]
        expected = sum(s["accuracy"] for s in on) / 3
        assert others["per_client"][str(i)]["accuracy"] == pytest.approx(expected, abs=1e-9)
