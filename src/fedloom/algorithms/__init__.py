"""Federated algorithms: ``algorithms.create(name, **hp)`` (see DESIGN.md)."""

from fedloom.algorithms import centralized, fedavg, local  # noqa: F401  (registration)
from fedloom.algorithms.base import Algorithm, ClientContext, ClientResult, ServerState
from fedloom.algorithms.registry import AlgorithmError, available, create, register

__all__ = [
    "Algorithm",
    "AlgorithmError",
    "ClientContext",
    "ClientResult",
    "ServerState",
    "available",
    "create",
    "register",
]
