"""Sample generations of a generative run (``samples.jsonl`` in the run directory): for the
first examples of each client's test split, the prompt, the reference response, and the
answers of the global adapter and of the client's personal adapter, as they were generated
at the last evaluation (the run's ``[eval.generation]`` settings). The report shows them as
a table; they are what a reader checks the scores against.

Written by the server of a simulation only: on Flower's own-data nodes the server holds no
client examples, and a client's personal adapter stays on its node.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from fedloom.params import Params

if TYPE_CHECKING:
    from fedloom.experiment import Experiment
    from fedloom.runtime.cohorts import Servers

#: the examples of each client's test split shown
PER_CLIENT = 3
#: the run directory's file
SAMPLES_FILE = "samples.jsonl"


def generation_samples(
    exp: Experiment,
    servers: Servers,
    adapters: Mapping[int, Params],
    round_: int,
    per_client: int = PER_CLIENT,
) -> list[dict[str, Any]]:
    """One record per shown example (module docstring), clients in id order; ``global`` or
    ``personal`` is None where the method has no such adapter."""
    rows: list[dict[str, Any]] = []
    for cohort in exp.cohorts():
        backbone = next(iter(cohort.models), "")
        state = servers.state_for(backbone)
        model, batch = cohort.model, cohort.cfg.eval.batch_size
        for client in sorted(cohort.clients_at(round_), key=lambda c: c.client_id):
            features = client.test[:per_client]
            if not features:
                continue
            answers: dict[str, list[str] | None] = {"global": None, "personal": None}
            if exp.algorithm.has_global:
                model.set_params(state.global_params)
                answers["global"] = model.generate(features, batch)
            if client.client_id in adapters:
                model.set_params(adapters[client.client_id])
                answers["personal"] = model.generate(features, batch)
            for i, f in enumerate(features):
                rows.append(
                    {
                        "client": client.client_id,
                        "prompt": f["prompt"],
                        "reference": f["label"],
                        **{k: None if v is None else v[i] for k, v in answers.items()},
                    }
                )
    return rows
