"""FFA-LoRA (Sun et al., ICLR 2024, "Improving LoRA in Privacy-preserving Federated
Learning"): A stays frozen at its random initialization A_0 on every client, only B (and
the head) trains and travels:

    client k:  B_k ← local training of B from B^t, with A = A_0
    server:    B^{t+1} = Σ_k p_k B_k,     A^{t+1} = A_0

Every client's weight change s B_k A_0 shares the factor A_0, so averaging B is averaging
the weight changes exactly: Σ_k p_k s B_k A_0 = s B^{t+1} A_0. Half the upload of FedIT.

fedloom keeps the paper's rule and PEFT's initialization (A Kaiming-uniform, B zero);
the paper also raises alpha to make up for the frozen A, which in fedloom is
``model.lora.alpha``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

from fedloom.algorithms.base import ClientContext, ClientResult, ServerState
from fedloom.algorithms.fedavg import FedAvg
from fedloom.algorithms.lora_factors import A_SUFFIX, check_factors
from fedloom.algorithms.registry import register
from fedloom.params import Params
from fedloom.train.local import train_locally


@register("ffa_lora")
@dataclass(frozen=True)
class FFALoRA(FedAvg):
    """FedAvg of B (and the head) with every LoRA A frozen at its initial value."""

    per_example_client_step: ClassVar[bool] = True

    def check_model(self, params: Params) -> None:
        check_factors(params, self.name)

    def local_train(self, ctx: ClientContext, payload: Params) -> ClientResult:
        ctx.model.set_params(payload)
        trained = [n for n in ctx.model.param_names if not n.endswith(A_SUFFIX)]
        metrics = train_locally(ctx, only=trained)
        params = ctx.model.get_params()
        return ClientResult(ctx.client_id, {n: params[n] for n in trained}, len(ctx.train), metrics)

    def aggregate(self, state: ServerState, results: Sequence[ClientResult]) -> ServerState:
        """B and the head by FedAvg's step; A as it was."""
        shared, extra = self.combine(state, results)
        return self.next_state(
            state,
            global_params={**state.global_params, **shared},
            extra={**state.extra, **extra},
        )
