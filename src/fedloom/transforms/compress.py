"""Uplink compression: the client sends its update Δ = θ_k − θ (over the shared tensors it
was sent) through a compression operator C (:mod:`fedloom.comm.compressors`), as the
bytes that travel; the server decodes C(Δ) and adds it back to the payload.

With error feedback (Seide et al. 2014; Stich, Cordonnier & Jaggi 2018, "Sparsified SGD
with Memory"; Karimireddy et al. 2019, "Error Feedback Fixes SignSGD"), client k keeps the
part of its updates that compression dropped and adds it to its next one:

    p_k = Δ_k + e_k,    sent C(p_k),    e_k ← p_k − C(p_k)

so nothing is lost, only delayed; biased operators (top-k, sign, PowerSGD) need it to
converge. ``error_feedback`` defaults to on for biased operators and off for unbiased ones;
an unbiased operator under error feedback is used as C/(ω + 1), which is contractive
(:mod:`fedloom.comm.message`): C itself would let the residual grow when ω ≥ 1.
The residual e_k is this transform's part of the client's persistent local state: kept
with the client's other state, committed only when the server accepted the round, saved in
checkpoints and restored on resume. A client sampled rarely keeps its residual until its
next round (the memory of Stich et al. is per worker, not per round).

What is compressed: the floating-point tensors of the update that the payload also holds
(the shared part, with a reference point), all as one vector (PowerSGD: each matrix),
optionally only those matching ``tensors``; a method's extra tensors (SCAFFOLD's Δc)
travel as they are. Personal tensors never reach this stage: they are not in the update.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np
import torch

from fedloom.algorithms import sharing
from fedloom.comm import message
from fedloom.comm.settings import CompressionSettings
from fedloom.params import Params
from fedloom.transforms.base import Served, Stage, Transform
from fedloom.transforms.clip_update import shared_names

#: keeps the compressors' random draws apart from the run's other seeded streams
COMPRESS_SALT = 0xC0DE
#: which of the payload's shared tensors the update compresses (a bit each, sorted names)
NAMES = message.WIRE + "names"


def names_mask(universe: list[str], names: list[str]) -> torch.Tensor:
    """One bit per tensor of ``universe`` (sorted): whether it is among ``names``."""
    chosen = set(names)
    bits = np.array([n in chosen for n in sorted(universe)], dtype=np.uint8)
    return torch.from_numpy(np.packbits(bits))


def masked_names(universe: list[str], mask: torch.Tensor) -> list[str]:
    """The names :func:`names_mask` marked (a ``ValueError`` when it does not fit)."""
    ordered = sorted(universe)
    if mask.dtype != torch.uint8 or mask.numel() != (len(ordered) + 7) // 8:
        raise ValueError(f"{NAMES}: not a mask over the {len(ordered)} shared tensors")
    bits = np.unpackbits(mask.numpy())[: len(ordered)]
    return [n for n, b in zip(ordered, bits) if b]


def compress_generator(
    seed: int, round_: int, client_id: int, salt: int = COMPRESS_SALT
) -> torch.Generator:
    """The generator of client ``client_id``'s compressor in round ``round_`` (``salt``
    tells the uplink's draws from the downlink's)."""
    key = [seed, round_, client_id + 1, salt]
    return torch.Generator().manual_seed(int(np.random.default_rng(key).integers(2**63 - 1)))


@dataclass(frozen=True)
class Compress(CompressionSettings, Transform):
    name: ClassVar[str] = "compress"
    stage: ClassVar[Stage] = "compress"
    encodes_bytes: ClassVar[bool] = True
    #: keep what compression dropped and send it with the next update (None: on for the
    #: biased operators, off for the unbiased ones)
    error_feedback: bool | None = None
    #: name patterns (regular expressions, or ``head``: :mod:`fedloom.algorithms.sharing`):
    #: compress only the shared tensors they select (empty: every shared tensor)
    tensors: list[str] = field(default_factory=list)
    #: the experiment's seed (set by the chain, not a key)
    seed: int = 0

    def __post_init__(self) -> None:
        self.operator  # noqa: B018 - built now: a mistake names its key
        sharing.check_patterns(self.tensors, key="tensors")

    @property
    def feedback(self) -> bool:
        """Whether the residual is kept (the default: for biased operators)."""
        if self.error_feedback is not None:
            return self.error_feedback
        return not self.operator.unbiased

    @property
    def needs_each_update(self) -> bool:
        """The server decodes each client's bytes against that client's reference."""
        return True

    @property
    def keeps_client_state(self) -> bool:
        """The residual (error feedback) and PowerSGD's warm start live on the client."""
        return self.feedback or self.operator.matrix

    def selected(self, update: Params, payload: Params) -> list[str]:
        """The tensors compressed: shared, floating point, matching ``tensors``."""
        names = shared_names(update, payload)
        if self.tensors:
            names = sharing.select(names, self.tensors)
        return names

    def check_model(self, shared: Params, personal: Sequence[str]) -> None:
        """Refuse, once the model is built, what its tensors cannot satisfy: a ``tensors``
        pattern that selects a tensor the method keeps ``personal``, or none at all, k
        larger than the number of values compressed, and a rank that compresses no matrix."""
        for pattern in self.tensors:
            mine = sharing.select(personal, [pattern])
            if mine:
                raise ValueError(
                    f"tensors: {pattern!r} selects {mine[0]}, which the method keeps personal "
                    f"(personal tensors never travel, so there is nothing to compress)"
                )
            if not sharing.select(shared, [pattern]):
                raise ValueError(f"tensors: {pattern!r} selects no shared tensor")
        message.check(shared, self.selected(shared, shared), self.operator)

    def up(
        self,
        update: Params,
        payload: Params,
        client_id: int,
        round_: int,
        state: dict[str, Any],
    ) -> Params:
        names = self.selected(update, payload)
        if not names:
            return update
        compressor = self.operator
        delta = {n: update[n].float() - payload[n].float() for n in names}
        residual = state.get("residual") if self.feedback else None
        if residual:
            delta = {n: d + residual[n].to(d.device) for n, d in delta.items()}
        encoder = state.setdefault("encoder", {}) if compressor.matrix else None
        generator = compress_generator(self.seed, round_, client_id)
        wire = message.encode(delta, compressor, generator, encoder, contractive=self.feedback)
        wire[NAMES] = names_mask(self.selected(payload, payload), names)
        if self.feedback:
            sent = message.decode(wire, delta, compressor)
            state["residual"] = {n: delta[n] - sent[n] for n in names}
        rest = {n: t for n, t in update.items() if n not in delta}
        return {**rest, **wire}

    def server(
        self,
        updates: dict[int, Params],
        payloads: dict[int, Params],
        round_: int,
        state: Mapping[str, Any],
    ) -> Served:
        compressor = self.operator
        decoded: dict[int, Params] = {}
        rejected: dict[int, str] = {}
        for cid, wire in updates.items():
            payload = payloads[cid]
            if NAMES not in wire:  # nothing to decompress (a method that sent nothing shared)
                decoded[cid] = wire
                continue
            try:
                names = masked_names(self.selected(payload, payload), wire[NAMES])
                delta = message.decode(wire, {n: payload[n] for n in names}, compressor)
            except (KeyError, ValueError) as err:
                rejected[cid] = f"undecodable update ({type(err).__name__}: {err})"
                continue
            rest = {n: t for n, t in wire.items() if not n.startswith(message.WIRE)}
            decoded[cid] = {
                **rest,
                **{
                    n: (payload[n].float() + d.float()).to(payload[n].dtype)
                    for n, d in delta.items()
                },
            }
        return Served(decoded, state, rejected=rejected)
