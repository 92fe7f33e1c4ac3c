"""Client drift: how far local training moved a client from the model it received.

drift_k = ‖w_k − w‖₂ over the (shared) tensors, with w the payload and w_k the client's
parameters after its local round. With E local SGD steps of size η,
w_k − w = −η Σ_{e<E} ∇F_k(w_k^e), so drift grows with E, η and how far each client's
objective pulls away from the others' — the "client drift" that Karimireddy et al. 2020
(SCAFFOLD) show slows FedAvg down on heterogeneous data and that SCAFFOLD's control
variates and FedProx's proximal term (Li et al. 2020) restrain.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from fedloom.params import Params


def client_drift(start: Params, end: Params, names: Sequence[str] | None = None) -> float:
    """‖end − start‖₂ over the tensors named ``names`` (default: every tensor both hold),
    computed in float64."""
    names = sorted(start.keys() & end.keys()) if names is None else list(names)
    if not names:
        raise ValueError("client_drift: no tensor in common")
    total = sum(float(((end[n].double() - start[n].double()) ** 2).sum()) for n in names)
    return total**0.5


def drift_summary(drifts: Mapping[int, float]) -> dict[str, float | dict[int, float]]:
    """{"mean", "max", "per_client"} of the drifts of one round's clients."""
    if not drifts:
        raise ValueError("drift_summary of no clients")
    values = list(drifts.values())
    return {
        "mean": sum(values) / len(values),
        "max": max(values),
        "per_client": dict(drifts),
    }
