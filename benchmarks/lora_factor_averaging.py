"""How much does averaging LoRA factors separately distort the averaged update?

FedAvg over LoRA averages A and B separately, so the server's weight change is
mean(B) mean(A) - B0 A0, while averaging the clients' actual weight changes would give
mean(B A) - B0 A0. The gap is

    mean(B) mean(A) - mean(B A) = -Cov_k(B, A)       (weighted over clients k)

which is second order in how far the clients drift apart. This script trains one round
of K clients from the same start for a given local budget and reports, over all adapted
layers, the relative error  ||mean(B)mean(A) - mean(BA)|| / ||mean(BA) - B0 A0||.

    python -m benchmarks.lora_factor_averaging --config examples/mrpc_fedavg.toml --local-epochs 0.25 1
"""

from __future__ import annotations

import argparse
import json

import torch

from fedloom.algorithms import ClientContext
from fedloom.config import load_config
from fedloom.experiment import Experiment
from fedloom.params import Params, weighted_average
from fedloom.runtime.local import client_seed


def factor_pairs(params: Params) -> list[tuple[str, str]]:
    return [(n, n.replace("lora_A", "lora_B")) for n in sorted(params) if "lora_A" in n]


def relative_error(start: Params, clients: list[Params], weights: list[float]) -> float:
    """||mean(B)mean(A) - mean(BA)|| / ||mean(BA) - B0A0|| summed over layers (Frobenius)."""
    mean = weighted_average(clients, weights)
    w = torch.tensor(weights, dtype=torch.float64) / sum(weights)
    gap, change = 0.0, 0.0
    for a_name, b_name in factor_pairs(start):
        products = torch.stack([c[b_name].double() @ c[a_name].double() for c in clients])
        mean_product = torch.einsum("k,kij->ij", w, products)
        product_of_means = mean[b_name].double() @ mean[a_name].double()
        base = start[b_name].double() @ start[a_name].double()
        gap += (product_of_means - mean_product).pow(2).sum().item()
        change += (mean_product - base).pow(2).sum().item()
    return (gap / change) ** 0.5


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", default="examples/mrpc_fedavg.toml")
    parser.add_argument("--local-epochs", type=float, nargs="+", default=[0.25, 1.0])
    args = parser.parse_args()
    cfg = load_config(args.config)
    exp = Experiment.build(cfg)
    start = exp.model.get_params()
    rows = []
    for epochs in args.local_epochs:
        settings = cfg.train.model_copy(update={"local_epochs": epochs, "local_steps": None})
        results = []
        for client in exp.clients:
            ctx = ClientContext(client.client_id, exp.model, client.train, settings, 0, 1, {},
                                client_seed(cfg.seed, 0, client.client_id))
            results.append(exp.algorithm.local_train(ctx, start).params)
        weights = [float(len(c.train)) for c in exp.clients]
        rows.append({"local_epochs": epochs, "relative_error": relative_error(start, results, weights)})
        print(json.dumps(rows[-1]), flush=True)


if __name__ == "__main__":
    main()
