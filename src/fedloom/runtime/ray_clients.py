"""Clients on Ray actors (``[runtime] name = "ray"``): :class:`RayClients`.

Each of ``runtime.workers`` actors builds the experiment from the run's config (one copy
of the backbone and the data) and is a :class:`~fedloom.runtime.clients.ClientHost` for
the clients it owns (client ``ids[i]`` on actor ``i mod workers``): their local states
live there and leave it only for a checkpoint. A round's payloads go to their owners at
once and the actors train their clients in parallel, each its own clients one after
another, as the embedded simulator does; the server side stays in the driver. Everything
between driver and actors travels as safetensors bytes
(:func:`fedloom.runtime.state_file.to_bytes`), never pickle.

The computations are the embedded simulator's, client by client (the same seeds, the same
model built from the same config), so a run's metrics equal the local runtime's; with one
torch thread per actor they are bit-identical.
"""

from __future__ import annotations

import os
import socket
import tomllib
from collections.abc import Callable, Mapping
from typing import Any, Self

import tomli_w
import torch

from fedloom.config import ConfigError, ExperimentConfig, to_toml_dict, validate
from fedloom.params import Params
from fedloom.runtime.clients import ClientHost, Scored, TrainReply
from fedloom.runtime.state_file import from_bytes, to_bytes


class ClientWorker:
    """The body of one Ray actor: a :class:`ClientHost` behind a bytes-only interface."""

    def __init__(self, config_toml: str, client_ids: list[int], threads: int, cwd: str) -> None:
        from fedloom.experiment import Experiment

        os.chdir(cwd)  # the config's relative paths are the driver's
        torch.set_num_threads(threads)
        self.host = ClientHost(Experiment.build(validate(tomllib.loads(config_toml))), client_ids)

    def train_many(self, round_: int, attempt: int, payloads: bytes) -> bytes:
        return to_bytes(self.host.train_many(round_, attempt, from_bytes(payloads)))

    def exchange(self, round_: int, stage: str, messages: dict[int, Any]) -> dict[int, Any]:
        # the protocol's messages (public keys, ciphertexts, masked integers) as Ray
        # serializes them; the update itself never leaves the actor unmasked
        return self.host.exchange(round_, stage, messages)

    def commit(self, client_ids: list[int]) -> None:
        self.host.commit(client_ids)

    def evaluate_many(self, round_: int, payloads: bytes) -> bytes:
        return to_bytes(self.host.evaluate_many(round_, from_bytes(payloads)))

    def score_many(self, round_: int, params: bytes) -> bytes:
        return to_bytes(self.host.score_many(round_, from_bytes(params)))

    def get_states(self) -> bytes:
        return to_bytes(self.host.get_states())

    def set_states(self, states: bytes) -> None:
        self.host.set_states(from_bytes(states))


def import_ray() -> Any:
    try:
        import ray
    except ImportError:
        raise ConfigError('runtime.name = "ray" needs Ray: pip install "fedloom[ray]"') from None
    return ray


def check_reachable(address: str | None, timeout: float = 5.0) -> None:
    """Refuse a ``runtime.address`` of the form ``[ray://]HOST:PORT`` where nothing accepts
    a TCP connection within ``timeout`` s: ``ray.init`` would retry it for minutes and
    then end the process. ``"auto"``, None and other forms are left to Ray."""
    if address is None or address == "auto":
        return
    host, _, port = address.split("://", 1)[-1].rpartition(":")
    if not host or not port.isdigit():
        return
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout).close()
    except OSError as err:
        raise ConfigError(
            f"runtime.address: no Ray cluster answers at {address!r} ({err.strerror or err})"
        ) from None


class RayClients:
    """The clients ``ids`` of the run configured by ``cfg``, on Ray actors; a context
    manager that stops the actors (and the Ray it started) on exit, also on error."""

    def __init__(self, cfg: ExperimentConfig, ids: list[int]) -> None:
        ray = self.ray = import_ray()
        runtime = cfg.runtime
        if cfg.train.device.startswith("cuda") and runtime.gpus_per_worker == 0:
            # Ray hides every GPU from an actor that asked for none
            raise ConfigError(
                f"runtime.gpus_per_worker: train.device = {cfg.train.device!r} "
                f"needs a share of a GPU for every Ray actor (e.g. 0.25: four "
                f"actors on one card)"
            )
        self.started = not ray.is_initialized()
        if self.started:
            local = runtime.address is None
            check_reachable(runtime.address)
            try:
                ray.init(
                    address=runtime.address,
                    include_dashboard=False,
                    log_to_driver=False,
                    logging_level="ERROR",
                    configure_logging=False,
                    num_cpus=runtime.workers * runtime.cpus_per_worker if local else None,
                )
            except (ConnectionError, ValueError, RuntimeError) as err:
                raise ConfigError(
                    f"runtime.address: cannot reach a Ray cluster at {runtime.address!r}: {err}"
                ) from None
        workers = min(runtime.workers, len(ids))
        self.owner = {cid: i % workers for i, cid in enumerate(ids)}
        actor = ray.remote(num_cpus=runtime.cpus_per_worker, num_gpus=runtime.gpus_per_worker)(
            ClientWorker
        )
        text = tomli_w.dumps(to_toml_dict(cfg))
        threads = max(1, int(runtime.cpus_per_worker))
        self.actors = [
            actor.remote(text, [c for c in ids if self.owner[c] == w], threads, os.getcwd())
            for w in range(workers)
        ]

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        for actor in self.actors:
            self.ray.kill(actor)
        if self.started:
            self.ray.shutdown()

    def _by_actor(self, payloads: dict[int, Params]) -> dict[int, dict[int, Params]]:
        out: dict[int, dict[int, Params]] = {}
        for cid, payload in payloads.items():
            out.setdefault(self.owner[cid], {})[cid] = payload
        return out

    def train_many(
        self,
        round_: int,
        attempt: int,
        payloads: dict[int, Params],
        on_reply: Callable[[int], None] | None = None,
    ) -> list[TrainReply]:
        pending = {
            self.actors[w].train_many.remote(round_, attempt, to_bytes(part)): w
            for w, part in self._by_actor(payloads).items()
        }
        replies: dict[int, TrainReply] = {}
        while pending:
            done, _ = self.ray.wait(list(pending), num_returns=1)
            for ref in done:
                pending.pop(ref)
                replies.update({r.client_id: r for r in from_bytes(self.ray.get(ref))})
            if on_reply:
                on_reply(len(replies))
        return [replies[cid] for cid in payloads]

    def exchange(self, round_: int, stage: str, messages: Mapping[int, Any]) -> dict[int, Any]:
        parts: dict[int, dict[int, Any]] = {}
        for cid, message in messages.items():
            parts.setdefault(self.owner[cid], {})[cid] = message
        answers: dict[int, Any] = {}
        for got in self.ray.get(
            [self.actors[w].exchange.remote(round_, stage, part) for w, part in parts.items()]
        ):
            answers.update(got)
        return answers

    def commit(self, client_ids: list[int]) -> None:
        self.ray.get(
            [
                a.commit.remote([c for c in client_ids if self.owner[c] == w])
                for w, a in enumerate(self.actors)
            ]
        )

    def evaluate_many(
        self,
        round_: int,
        payloads: dict[int, Params],
        on_reply: Callable[[int], None] | None = None,
    ) -> dict[int, Scored]:
        pending = [
            self.actors[w].evaluate_many.remote(round_, to_bytes(part))
            for w, part in self._by_actor(payloads).items()
        ]
        scored: dict[int, Scored] = {}
        while pending:
            done, pending = self.ray.wait(pending, num_returns=1)
            for ref in done:
                scored.update(from_bytes(self.ray.get(ref)))
            if on_reply:
                on_reply(len(scored))
        return {cid: scored[cid] for cid in payloads}

    def score_many(
        self, round_: int, params: dict[int, Params]
    ) -> dict[int, dict[str, dict[str, float | None]] | None]:
        refs = [
            self.actors[w].score_many.remote(round_, to_bytes(part))
            for w, part in self._by_actor(params).items()
        ]
        scores: dict[int, dict[str, dict[str, float | None]] | None] = {}
        for blob in self.ray.get(refs):
            scores.update(from_bytes(blob))
        return {cid: scores[cid] for cid in params}

    def get_states(self) -> dict[int, dict[str, Any]]:
        states: dict[int, dict[str, Any]] = {}
        for blob in self.ray.get([a.get_states.remote() for a in self.actors]):
            states.update(from_bytes(blob))
        return dict(sorted(states.items()))

    def set_states(self, states: dict[int, dict[str, Any]]) -> None:
        self.ray.get(
            [
                a.set_states.remote(
                    to_bytes({c: s for c, s in states.items() if self.owner.get(c) == w})
                )
                for w, a in enumerate(self.actors)
            ]
        )
