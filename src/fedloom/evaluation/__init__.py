"""Evaluation: what a client is scored on, how a round's adapters are scored, and scoring a
finished run. The round loop (:mod:`fedloom.server.loop`) calls :func:`.round.evaluate_round`
and writes its rows and checkpoints; ``fedloom eval`` calls :func:`.finished_run.score_run`.

- :mod:`.score`: an adapter's metrics, loss and ``n`` on examples (weighted where they say).
- :mod:`.dev_weighted`: the task's dev set relabelled and reweighted to a client's label mix.
- :mod:`.splits`: which splits a client is scored on, by scope (``clients``, ``val``...).
- :mod:`.round`: a round's server state scored on the dev set and the clients' splits.
- :mod:`.scopes`: :class:`.scopes.Evaluation`, scores summarized by scope, joined over backbones.
- :mod:`.self_others`: Self / Others, each client's adapter scored on the others' splits.
- :mod:`.majority`: the majority-label baseline's scores (``[eval] baselines``).
- :mod:`.run_task`: what a finished run's adapters were trained for (its config.toml).
- :mod:`.run_data`: labelled data for ``fedloom eval``, read in the run's label space.
- :mod:`.finished_run`: a finished run's checkpoints verified and scored (``fedloom eval``).

Elsewhere: the metrics and their summaries over clients, :mod:`fedloom.data.metrics`
(``compute_metrics``, ``summarize``); the rule for ``eval.client_mode``,
:mod:`fedloom.client_mode`; the ``local`` baseline's configuration,
:mod:`fedloom.baselines.local`.
"""
