"""FLTrust's server update g_0 (``aggregation.rule = "fltrust"``,
:func:`fedloom.algorithms.aggregators.fltrust`): each round the server trains the global
adapter the clients started from on its root set D_0, and the rule reads g_0 = w_0' - w_t
in the round's server step.

The server trains as one more client that takes part in every round: the algorithm's own
local training (:meth:`Algorithm.local_train` with the run's ``[train]`` settings, as
:class:`fedloom.runtime.clients.ClientHost` trains a client) from the algorithm's payload
for the server's state, on the root set as the state's backbone encodes it
(:attr:`fedloom.experiment.Experiment.root`), with a seed drawn from (seed, round) and a
local state of its own (optimizer moments, a personal part), carried from round to round
in ``ServerState.extra[ROOT_STATE_KEY]`` and so checkpointed with the server: a resumed run
trains it as the uninterrupted run did. No transform, simulated fault, attack or DP-SGD
touches it: the root set is the server's own clean data. g_0 is in
``ServerState.extra[ROOT_UPDATE_KEY]`` during the server step only; the next state does
not keep it.

Every runtime runs this step, because the server side of a round is
:mod:`fedloom.server`'s in all of them (the Ray and Flower servers build the
experiment, root set included); a Flower deployment whose server holds no data
(``runtime.client_data = "nodes"``) refuses the rule.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from fedloom.algorithms import Algorithm, ClientResult, ServerState
from fedloom.algorithms.aggregation_rule import ROOT_UPDATE_KEY, averages
from fedloom.client_context import ClientContext
from fedloom.device import to_cpu, to_device
from fedloom.experiment import Experiment
from fedloom.params import Params
from fedloom.runtime.clients import client_seed
from fedloom.runtime.cohorts import ALL, Step

#: the ``ServerState.extra`` entry of the server's local state on its root set
ROOT_STATE_KEY = "fltrust_root_state"
#: the client id the server trains under (no client's)
ROOT_ID = -1
#: keeps the seeds of the server's training apart from the clients' (any fixed value)
ROOT_SEED_SALT = 0x5EED0


def trusts_root(alg: Algorithm) -> bool:
    """Whether ``alg`` aggregates with a rule that reads the server's root update."""
    return averages(alg) and alg.rule.needs_root_update


def root_update(
    exp: Experiment, state: ServerState, backbone: str, round_: int
) -> tuple[Params, dict[str, Any]]:
    """(g_0, the server's local state after training) of round ``round_`` (0-based):
    ``backbone``'s model trained on its root set from the payload of ``state``, and g_0
    the trained tensors minus what they were trained from."""
    alg, cfg, model = exp.algorithm, exp.cfg, exp.models[backbone]
    ctx = ClientContext(
        client_id=ROOT_ID,
        model=model,
        train=exp.root[backbone],
        settings=cfg.train,
        round=round_,
        total_rounds=cfg.federation.rounds,
        state=to_device(dict(state.extra.get(ROOT_STATE_KEY, {})), model.device),
        seed=client_seed(cfg.seed, round_, ROOT_SEED_SALT),
    )
    payload = alg.payload(state, ROOT_ID)
    result = alg.local_train(ctx, to_device(payload, model.device))
    start, trained = alg.trained_from(payload, result), to_cpu(result.params)
    update = {n: trained[n].float() - start[n].float() for n in trained if n in start}
    return update, to_cpu(ctx.state)


def server_step(exp: Experiment, round_: int) -> Step | None:
    """Round ``round_``'s server step with FLTrust's g_0 (for :meth:`Servers.aggregate`):
    g_0 computed once for each state, then the algorithm's own aggregation; None when the
    rule reads no root update."""
    if not trusts_root(exp.algorithm):
        return None

    def step(key: str, state: ServerState, results: Sequence[ClientResult]) -> ServerState:
        backbone = next(iter(exp.models)) if key == ALL else key
        update, local = root_update(exp, state, backbone, round_)
        given = replace(state, extra={**state.extra, ROOT_UPDATE_KEY: update})
        after = exp.algorithm.aggregate(given, results)
        kept = {k: v for k, v in after.extra.items() if k != ROOT_UPDATE_KEY}
        return replace(after, extra={**kept, ROOT_STATE_KEY: local})

    return step
