"""Flower's side of the anchor workload (``benchmarks/anchor.toml``), as a Flower user
writes it: a ClientApp and a ServerApp on flwr's Message API, run by Flower's simulation
engine (Ray backend) with ``flwr.serverapp.strategy.FedAvg``.

The client: the MiniLM backbone from Hugging Face transformers with PEFT LoRA (r = 8,
alpha 16, dropout 0, query/value), mean pooling and a linear head; its 32 MRPC training
rows (rows [32 k, 32 k + 32) of the file, the anchor's sequential partition) tokenized
once (max length 128); one epoch of random batches of 16, each padded to its longest
example, fresh AdamW (lr 5e-4, weight decay 0.01). The backbone and the tokenized rows
are built once per Ray actor and reused across messages, which is what Flower's
simulation allows and its examples do with cached datasets. What travels: the LoRA
factors and the head. No evaluation.

On a GPU (``simulate(..., device="cuda", gpus_per_client=g)``) every actor puts its model
and batches on the card and Ray packs ``1 / g`` actors onto it (``client_resources``), as
Flower's documentation has a user do.
"""

from __future__ import annotations

import os
import time
from functools import cache
from typing import Any

import torch
from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import FedAvg
from peft import LoraConfig, get_peft_model
from torch import nn
from transformers import AutoModel, AutoTokenizer

from fedloom.data import get_task, load_glue
from fedloom.models.catalog import minilm_dir

NUM_CLIENTS, CLIENT_ROWS, ROUNDS, BATCH, LR, SEED = 8, 32, 3, 16, 5e-4, 0
#: the GLUE directory and the clients' device, for the client processes (Ray actors
#: inherit the environment)
DATA_DIR, DEVICE = "ANCHOR_GLUE_DIR", "ANCHOR_DEVICE"


class PairClassifier(nn.Module):
    """MiniLM with LoRA, mean pooling over the attention mask, a linear head."""

    def __init__(self) -> None:
        super().__init__()
        encoder = AutoModel.from_pretrained(minilm_dir(), dtype=torch.float32)
        self.encoder = get_peft_model(encoder, LoraConfig(
            r=8, lora_alpha=16, lora_dropout=0.0, target_modules=["query", "value"]))
        self.classifier = nn.Linear(encoder.config.hidden_size, 2)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                **inputs: torch.Tensor) -> torch.Tensor:
        hidden = self.encoder(input_ids=input_ids, attention_mask=attention_mask,
                              **inputs).last_hidden_state
        mask = attention_mask.unsqueeze(-1).to(hidden.dtype)
        return self.classifier((hidden * mask).sum(1) / mask.sum(1))

    def trainable_state(self) -> dict[str, torch.Tensor]:
        names = {n for n, p in self.named_parameters() if p.requires_grad}
        return {n: t for n, t in self.state_dict().items() if n in names}


def _device() -> torch.device:
    return torch.device(os.environ.get(DEVICE, "cpu"))


@cache
def _model() -> PairClassifier:
    torch.manual_seed(SEED)
    return PairClassifier().to(_device())


@cache
def _tokenizer() -> Any:
    return AutoTokenizer.from_pretrained(minilm_dir())


@cache
def _rows(partition: int) -> list[dict[str, Any]]:
    examples = load_glue(get_task("MRPC"), "train", os.environ[DATA_DIR])
    mine = examples[partition * CLIENT_ROWS:(partition + 1) * CLIENT_ROWS]
    tokenizer = _tokenizer()
    return [{**tokenizer(e.text_a, e.text_b, truncation=True, max_length=128),
             "labels": int(e.label)} for e in mine]


client_app = ClientApp()


@client_app.train()
def train(msg: Message, context: Context) -> Message:
    partition = int(context.node_config["partition-id"])
    model, rows = _model(), _rows(partition)
    model.load_state_dict(msg.content["arrays"].to_torch_state_dict(), strict=False)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad],
                                  lr=LR, weight_decay=0.01)
    generator = torch.Generator().manual_seed(SEED * 1000 + partition)
    order = torch.randperm(len(rows), generator=generator).tolist()
    model.train()
    losses = []
    for start in range(0, len(rows), BATCH):
        chunk = [rows[i] for i in order[start:start + BATCH]]
        batch = _tokenizer().pad([{k: v for k, v in r.items() if k != "labels"} for r in chunk],
                                 return_tensors="pt").to(_device())
        labels = torch.tensor([r["labels"] for r in chunk], device=_device())
        loss = nn.functional.cross_entropy(model(**batch), labels)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    content = RecordDict({
        "arrays": ArrayRecord({n: t.cpu() for n, t in model.trainable_state().items()}),
        "metrics": MetricRecord({"num-examples": len(rows),
                                 "train_loss": sum(losses) / len(losses)}),
    })
    return Message(content=content, reply_to=msg)


server_app = ServerApp()
#: seconds of the strategy's rounds, set by the ServerApp (it runs in this process)
rounds_seconds: list[float] = []


@server_app.main()
def main(grid: Grid, context: Context) -> None:
    strategy = FedAvg(fraction_train=1.0, fraction_evaluate=0.0, min_train_nodes=NUM_CLIENTS,
                      min_available_nodes=NUM_CLIENTS)
    start = time.perf_counter()
    initial = {n: t.cpu() for n, t in _model().trainable_state().items()}
    strategy.start(grid=grid, initial_arrays=ArrayRecord(initial), num_rounds=ROUNDS)
    rounds_seconds.append(time.perf_counter() - start)


def simulate(data_dir: str, device: str = "cpu", gpus_per_client: float = 0.0
             ) -> dict[str, float]:
    """Flower's simulation of the anchor workload on ``device`` (each client actor asking
    Ray for ``gpus_per_client`` of a GPU); the seconds of its rounds."""
    from flwr.simulation import run_simulation

    os.environ[DATA_DIR], os.environ[DEVICE] = data_dir, device
    resources = {"num_cpus": 1, "num_gpus": gpus_per_client}
    run_simulation(server_app=server_app, client_app=client_app, num_supernodes=NUM_CLIENTS,
                   backend_config={"client_resources": resources})
    if not rounds_seconds:
        raise RuntimeError("Flower's simulation ended without running the strategy")
    return {"seconds": rounds_seconds[-1]}
