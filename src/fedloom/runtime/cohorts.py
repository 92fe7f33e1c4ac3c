"""Mixed-backbone federations (``[[model.groups]]``): whose server state a client belongs
to.

A method that does not span backbones runs within architecture: one server state per
backbone, each aggregating the round's results of its own clients (a backbone none of
whose clients was sampled keeps its state). A spanning method (``spans_backbones``,
FedMosaic) and every single-backbone federation have one state for all clients.

Each backbone's cohort is evaluated with the state :meth:`Servers.state_for` gives it, and
the evaluations are joined by :func:`fedloom.evaluation.scopes.merge_evaluations`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from fedloom.algorithms import Algorithm, ClientResult, ServerState
from fedloom.device import to_cpu
from fedloom.experiment import Experiment
from fedloom.params import Params

#: the key of the one state of a single-backbone federation or a spanning method
ALL = ""
#: a server step: (the state's key, the state, its clients' results) -> the next state
Step = Callable[[str, ServerState, Sequence[ClientResult]], ServerState]


@dataclass(frozen=True)
class Servers:
    """The server states of a run, by backbone (or the one state, under :data:`ALL`)."""

    states: dict[str, ServerState]
    backbone_of: Mapping[int, str]

    @classmethod
    def init(cls, exp: Experiment) -> Servers:
        """Every backbone's first state, or the one state of all clients (a mixed-rank
        federation's from :meth:`Algorithm.init_ranked`)."""
        alg = exp.algorithm
        backbone_of = {c.client_id: exp.backbone_of(c.client_id) for c in exp.clients}
        # the server's state lives on the CPU, wherever the models run (fedloom.device)
        initial = {b: to_cpu(m.get_params()) for b, m in exp.models.items()}
        first = initial[next(iter(exp.models))]
        if exp.ranks:
            return cls.restored(exp, {ALL: alg.init_ranked(first, exp.ranks)})
        if not exp.mixed:
            return cls.restored(exp, {ALL: alg.init(first)})
        if alg.spans_backbones:
            return cls.restored(exp, {ALL: alg.init_mixed(initial, backbone_of)})
        return cls.restored(exp, {b: alg.init(params) for b, params in initial.items()})

    @classmethod
    def restored(cls, exp: Experiment, states: dict[str, ServerState]) -> Servers:
        """The states of a checkpoint, for ``exp``'s clients."""
        return cls(dict(states), {c.client_id: exp.backbone_of(c.client_id) for c in exp.clients})

    def key(self, client_id: int) -> str:
        return ALL if ALL in self.states else self.backbone_of[client_id]

    def state_of(self, client_id: int) -> ServerState:
        """The state client ``client_id``'s payload comes from."""
        return self.states[self.key(client_id)]

    def payloads(self, alg: Algorithm, client_ids: Sequence[int]) -> dict[int, Params]:
        """Each client's payload from its state (:meth:`Algorithm.payloads`, the clients
        of one state together), in the order of ``client_ids``."""
        by_key: dict[str, list[int]] = {}
        for cid in client_ids:
            by_key.setdefault(self.key(cid), []).append(cid)
        out: dict[int, Params] = {}
        for key, ids in by_key.items():
            out.update(alg.payloads(self.states[key], ids))
        return {cid: out[cid] for cid in client_ids}

    def state_for(self, backbone: str) -> ServerState:
        """The state a backbone's cohort is evaluated with."""
        return self.states[ALL if ALL in self.states else backbone]

    def aggregate(
        self, alg: Algorithm, results: Sequence[ClientResult], step: Step | None = None
    ) -> Servers:
        """Each state aggregated with its own clients' results (none: unchanged), by
        ``step`` (default: :meth:`Algorithm.aggregate`)."""
        states = dict(self.states)
        for key, state in self.states.items():
            own = [r for r in results if self.key(r.client_id) == key]
            if own:
                states[key] = alg.aggregate(state, own) if step is None else step(key, state, own)
        return Servers(states, self.backbone_of)

    def tagged(self) -> list[tuple[dict[str, str], ServerState]]:
        """(the backbone to tag its rows with, or nothing, state) for every state."""
        return [
            ({} if key == ALL else {"backbone": key}, state) for key, state in self.states.items()
        ]
