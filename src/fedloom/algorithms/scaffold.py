"""SCAFFOLD (Karimireddy et al. 2020, "SCAFFOLD: Stochastic Controlled Averaging for
Federated Learning", Algorithm 1 with option I or II).

The server keeps a control variate c, client i its own c_i (in its local state, starting
at 0). In round t, with x the global adapter and η_l the local learning rate:

    client:  y ← x;  K times:  y ← y - η_l (g_i(y) - c_i + c)
             c_i⁺ = c_i - c + (x - y) / (K η_l)                 (option II)
             c_i⁺ = g_i(x)                                       (option I)
             sends Δy_i = y - x and Δc_i = c_i⁺ - c_i
    server:  x ← x + η_g mean_S(Δy_i)                           (η_g = ``eta_g``)
             c ← c + (|S| / N) mean_S(Δc_i)                      (N = ``num_clients``)

The correction (c - c_i) enters the gradient as the extra loss sum <w - sg(w), c - c_i>
(sg = stop-gradient), whose value is 0 and whose gradient is exactly c - c_i, so the
reported ``train_loss`` stays the task loss. K η_l is the sum of the learning rates the
local steps actually used, as train_locally reports them (schedule included;
``train.head_lr`` for the head). Option I's g_i(x) is the client's gradient at x on
``control_batches`` batches of ``train.batch_size`` (an extra forward/backward each).

``option = "auto"`` (the default) takes II with ``train.optimizer = "sgd"`` and I with
AdamW. Option II reads the mean gradient off the distance travelled, which holds for SGD
only: AdamW moves every coordinate by about η_l per step whatever the gradient's size, so
(x - y) / (K η_l) is O(1) per coordinate where gradients are O(1e-2), and the correction
c - c_i swamps the gradient. Option I's control variates are gradients, in the units the
correction is added in, whatever the optimizer does with the sum. (On MRPC with 10
clients at Dirichlet 0.1 and AdamW, both options, like FedAvg, swing between the two
classes from round to round at that budget; BENCHMARKS.md has the numbers.)

c travels with the payload (``scaffold.c/<name>``) and Δc_i with the result
(``scaffold.dc/<name>``): SCAFFOLD's doubled communication is real here. The means are
FedAvg's weighting, ``uniform`` by default as in the paper (``examples`` weights both x
and c by n_i). ``num_clients`` unset means |S| / N = 1 (full participation).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch

from fedloom.algorithms import aggregators
from fedloom.algorithms.base import ClientContext, ClientResult, ServerState
from fedloom.algorithms.fedavg import FedAvg, aggregation_weights
from fedloom.algorithms.registry import register
from fedloom.params import Params, flatten, stack, unflatten
from fedloom.train.local import lr_group, train_locally

C, DC = "scaffold.c/", "scaffold.dc/"


@register("scaffold")
@dataclass(frozen=True)
class Scaffold(FedAvg):
    not_a_mean = "its control variates travel beside the update and are not clipped"
    weighting: Literal["examples", "uniform", "capped"] = "uniform"
    eta_g: float = 1.0
    num_clients: int | None = None
    option: Literal["auto", "I", "II"] = "auto"
    control_batches: int = 4

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.option not in ("auto", "I", "II"):
            raise ValueError(f"algorithm.option: must be 'auto', 'I' or 'II' (got {self.option!r})")
        if self.control_batches < 1:
            raise ValueError(
                f"algorithm.control_batches: must be >= 1 (got {self.control_batches})"
            )
        if self.eta_g <= 0:
            raise ValueError(f"algorithm.eta_g: must be > 0 (got {self.eta_g})")
        if self.num_clients is not None and self.num_clients < 1:
            raise ValueError(f"algorithm.num_clients: must be >= 1 (got {self.num_clients})")

    def check_federation(self, clients_per_round: int, num_clients: int) -> None:
        """FedAvg's checks, and N = ``num_clients``, when given, must be the federation's K:
        c's step |S| / N is the fraction of the clients that took part."""
        super().check_federation(clients_per_round, num_clients)
        if self.num_clients is not None and self.num_clients != num_clients:
            raise ValueError(
                f"algorithm.num_clients: {self.num_clients}, but the federation has "
                f"{num_clients} clients (partition.num_clients); SCAFFOLD's N is that number "
                f"(leave it unset when every client takes part in every round)"
            )

    def init(self, global_params: Params) -> ServerState:
        zeros = {n: torch.zeros_like(p, dtype=torch.float32) for n, p in global_params.items()}
        return ServerState(round=0, global_params=global_params, extra={"c": zeros})

    def payload(self, state: ServerState, client_id: int) -> Params:
        return {**state.global_params, **{C + n: v for n, v in state.extra["c"].items()}}

    def local_train(self, ctx: ClientContext, payload: Params) -> ClientResult:
        x = {n: v for n, v in payload.items() if not n.startswith(C)}
        c = {n[len(C) :]: v for n, v in payload.items() if n.startswith(C)}
        c_i = ctx.state.get("scaffold_c") or {n: torch.zeros_like(v) for n, v in c.items()}
        ctx.model.set_params(x)
        named = ctx.model.trainable_parameters()
        correction = {n: (c[n] - c_i[n]).to(p.device, p.dtype) for n, p in named.items()}

        def corrected() -> torch.Tensor:
            terms = (((p - p.detach()) * correction[n]).sum() for n, p in named.items())
            return sum(terms, torch.zeros(()))

        option = self.option
        if option == "auto":
            option = "II" if ctx.settings.optimizer == "sgd" else "I"
        if option == "I":
            c_new = self._gradient_at(ctx, x)
            ctx.model.set_params(x)
        metrics = train_locally(ctx, extra_loss=corrected)
        y = ctx.model.get_params()
        n_ex = len(ctx.train)
        if option == "II":
            c_new = {}
            for n in y:
                k_eta = metrics[f"lr_sum_{lr_group(n)}"]
                # no step taken (learning rate 0 all round): nothing learned about the gradient
                c_new[n] = (
                    c_i[n] - c[n] + (x[n].float() - y[n].float()) / k_eta if k_eta > 0 else c_i[n]
                )
        ctx.state["scaffold_c"] = c_new
        params = {**y, **{DC + n: c_new[n] - c_i[n] for n in y}}
        return ClientResult(ctx.client_id, params, n_ex, metrics)

    def _gradient_at(self, ctx: ClientContext, x: Params) -> Params:
        """Option I: c_i⁺ = g_i(x), the client's minibatch gradient at the global adapter."""
        from fedloom.diagnostics.gradients import client_gradient_estimate

        names = list(ctx.model.trainable_parameters())
        estimate = client_gradient_estimate(
            ctx.model, x, ctx.train, self.control_batches, ctx.settings.batch_size, ctx.seed
        )
        grads = unflatten(estimate.mean, x, names, torch.float32)  # the estimate is on the CPU
        return {n: g.to(x[n].device) for n, g in grads.items()}

    def aggregate(self, state: ServerState, results: Sequence[ClientResult]) -> ServerState:
        x_params, c_params = state.global_params, state.extra["c"]
        names = sorted(x_params)
        x = flatten(x_params, names).double()
        models = [
            ClientResult(r.client_id, {n: r.params[n] for n in names}, r.num_examples)
            for r in results
        ]
        point, rule_extra = self.combine_flat(state, models, names)
        x_new = x + self.eta_g * (point - x)
        w = torch.tensor(
            aggregation_weights([r.num_examples for r in results], self.weighting, self.cap),
            dtype=torch.float64,
        )
        dc = stack([{n: r.params[DC + n] for n in names} for r in results], names).double()
        share = 1.0 if self.num_clients is None else len(results) / self.num_clients
        c_new = flatten(c_params, names).double() + share * aggregators.mean(dc, w)
        extra = {**state.extra, **rule_extra, "c": unflatten(c_new, x_params, names, torch.float32)}
        return self.next_state(state, global_params=unflatten(x_new, x_params, names), extra=extra)
