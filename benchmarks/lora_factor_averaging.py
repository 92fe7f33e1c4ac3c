"""How far is each LoRA-aware method's aggregate from the mean of the clients' updates?

Client k ends its round with the weight change E_k = M + B_k A_k of every adapted module
(M: the merged update it received, zero here; in B·A units, the scale alpha / r common to
all). The exact aggregate is T = Σ_k p_k E_k (p_k ∝ n_k); the server's new global adapter
makes G = M' + B' A'. This script trains one round of K clients from the same start for
each local budget and reports, over all adapted modules (Frobenius),

    relative error = ‖G − T‖ / ‖T − E_0‖,       E_0 = the start's B_0 A_0,

for every method. FedIT (FedAvg of the factors) errs by −Cov_k(B, A), second order in
how far the clients drift apart; FFA-LoRA and FedSVD (A shared), FedEx-LoRA (the
residual merged), FLoRA (the stacked product merged) and FlexLoRA (the product averaged
at full size) are exact by construction, so their error measures float rounding; HetLoRA
weights clients by ‖B_k A_k‖ instead of n_k, by design. Methods whose clients train the
same way from the same start share one local training: FedIT, FedEx-LoRA, FLoRA, HetLoRA
and FlexLoRA train A and B; FFA-LoRA and FedSVD train B only.

    python -m benchmarks.lora_factor_averaging --local-epochs 1 4 8 --max-train-examples 1200
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence

import torch

from fedloom import algorithms
from fedloom.algorithms import ClientContext, ClientResult
from fedloom.algorithms.lora_factors import A_SUFFIX, B_SUFFIX, factor_modules, merged_of
from fedloom.config import load_config
from fedloom.experiment import Experiment
from fedloom.models.merged import merged_name
from fedloom.params import Params
from fedloom.runtime.clients import client_seed

METHODS = ("fedit", "ffa_lora", "fedex_lora", "flora", "fedsvd", "hetlora", "flexlora")
#: the method whose local training stands for each group (see the module docstring)
TRAINS_LIKE = {"ffa_lora": "ffa_lora", "fedsvd": "ffa_lora"}


def effective(params: Params, module: str, like: Params) -> torch.Tensor:
    """M + B A of ``module`` (float64); what ``params`` lacks (a client's merged update, or
    the A an FFA-LoRA client did not send) is ``like``'s, which it started from."""
    source = params if merged_name(module) in params else like
    a = params.get(module + A_SUFFIX, like[module + A_SUFFIX]).double()
    return merged_of(source, module) + params[module + B_SUFFIX].double() @ a


def relative_error(start: Params, results: Sequence[ClientResult], new: Params) -> float:
    """‖G − T‖ / ‖T − E_0‖ over every adapted module (see the module docstring)."""
    total = sum(r.num_examples for r in results)
    gap, change = 0.0, 0.0
    for module in factor_modules(start):
        target = sum(r.num_examples / total * effective(r.params, module, start) for r in results)
        gap += (effective(new, module, start) - target).pow(2).sum().item()
        change += (target - effective(start, module, start)).pow(2).sum().item()
    return (gap / change) ** 0.5


def one_round(exp: Experiment, method: str, epochs: float, start: Params) -> list[ClientResult]:
    """Every client's result of one round of ``method``'s local training from ``start``."""
    alg = algorithms.create(method)
    settings = exp.cfg.train.model_copy(update={"local_epochs": epochs, "local_steps": None})
    return [alg.local_train(ClientContext(c.client_id, exp.model, c.train, settings, 0, 1, {},
                                          client_seed(exp.cfg.seed, 0, c.client_id)), start)
            for c in exp.clients]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", default="examples/mrpc_fedavg.toml")
    parser.add_argument("--local-epochs", type=float, nargs="+", default=[1.0, 4.0, 8.0])
    parser.add_argument("--max-train-examples", type=int, default=0,
                        help="the pooled training set's size (0: all)")
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="a config override, e.g. data.data_dir=\"../shared/data/glue\"")
    args = parser.parse_args()
    cfg = load_config(args.config,
                      [f"data.max_train_examples={args.max_train_examples}", *args.set])
    exp = Experiment.build(cfg)
    start = exp.model.get_params()
    methods = args.methods.split(",")
    for epochs in args.local_epochs:
        trained: dict[str, list[ClientResult]] = {}
        row: dict[str, float] = {"local_epochs": epochs}
        for method in methods:
            like = TRAINS_LIKE.get(method, "fedit")
            if like not in trained:
                trained[like] = one_round(exp, like, epochs, start)
            alg = algorithms.create(method)
            new = alg.aggregate(alg.init(start), trained[like]).global_params
            row[method] = relative_error(start, trained[like], new)
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
