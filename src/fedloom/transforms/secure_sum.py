"""Secure aggregation as the chain's mask stage: the server learns the clients' weighted
mean update, never one client's update (``[secagg]``; the protocols are SecAgg,
:mod:`fedloom.secagg`, and homomorphic aggregation, :mod:`fedloom.homomorphic`; the
message rounds :mod:`fedloom.runtime.secure_round`).

The rule (TensorFlow Federated's ``MeanFactory`` over a ``SecureSumFactory``: a weighted
mean is a secure sum of w_k·x_k and of w_k). Client k, with update Δ_k = θ_k − s_k of the
tensors it shares (s_k the payload it trained from) and integer weight w_k (its examples,
or 1 under ``uniform`` weighting), sends through the protocol the integers

    x_k = [ w_k · q(Δ_k),  w_k,  #clipped_k ]  modulo 2^b,

q the stochastic b_q-bit quantizer on [−c, c] (:class:`fedloom.secagg.Quantizer`:
unbiased inside the range). The server unmasks S = Σ_k x_k over the clients U it could
sum (under homomorphic aggregation, the round's key holder decrypts it), and with W = Σ_k w_k and step Δ = 2c / (2^{b_q} − 1) rebuilds

    Δ̄ = (S_Δ · Δ − c · W) / W  =  Σ_k w_k (q(Δ_k)·Δ − c) / W,

the weighted mean of the dequantized updates: unbiased for Σ w_k Δ_k / W, within one step
Δ per coordinate, for updates inside the range. Each summed client's update, as the
aggregation sees it, is s_k + Δ̄: any weighted mean of those with the same weights is
exactly the weighted mean of the s_k + Δ_k, so every method whose server step is a
weighted mean of what the clients send aggregates as it would in the clear (to the
quantization), and nothing else is possible: the server holds no single update.

b_q is chosen each round as the largest with W·(2^{b_q} − 1) ≤ 2^b − 1, so that the sum
cannot wrap for the round's weights (the overflow bound of :mod:`fedloom.secagg.quantize`
with W unit-weight values in place of n clients); a fixed ``quant_bits`` that the round's
W would wrap is refused. The count of coordinates each client clipped travels in the sum
too, so the server learns how often c was too small without learning whose.

How fedloom differs: TFF's secure sum takes integers and leaves the float encoding to the
caller (``EncodedSumFactory``); here the mask stage quantizes with the bound derived for
the round's weights, and decodes into what the aggregation expects.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any, ClassVar, Literal

import numpy as np
import torch

from fedloom import homomorphic
from fedloom.homomorphic import HomomorphicConfig, HomomorphicSetup
from fedloom.params import Params, flatten, unflatten
from fedloom.secagg import RoundSetup, SecAggConfig, setup_round
from fedloom.secagg.masks import UInts, check_bits
from fedloom.secagg.messages import STAGES
from fedloom.secagg.quantize import bits_left, bits_needed, max_clients
from fedloom.transforms.base import Served, Stage, Transform

#: what the server hands the mask stage for each summed client: the unmasked sum
SUM_KEY = "secagg/sum"
#: and the quantization bits of the round (a one-element tensor)
QUANT_BITS_KEY = "secagg/quant_bits"
#: keeps the quantizer's rounding stream apart from the client's other seeded streams
ROUNDING_SALT = 0x5EC5


def quant_bits_for_weight(
    weight: int, bits: int, quant_bits: int | None, round_: str = "the round"
) -> int:
    """b_q for ``round_``, whose clients weigh ``weight`` (W) in all: ``quant_bits`` where
    it is set, else the largest with W·(2^{b_q} − 1) ≤ 2^``bits`` − 1; a ``ValueError``
    naming ``secagg.bits`` where the weighted sum could wrap."""
    fits = bits_left(weight, bits)
    if quant_bits is None and fits == 0:
        raise ValueError(
            f"secagg.bits: {bits} bits cannot hold the weighted sum of {round_} even at one "
            f"bit per value: its clients weigh {weight} in all; it needs secagg.bits = "
            f"{bits_needed(weight, 1)} or more"
        )
    if quant_bits is not None and quant_bits > fits:
        raise ValueError(
            f"secagg.bits: the weighted sum of {round_} can wrap modulo 2^{bits} at "
            f"secagg.quant_bits = {quant_bits}: its clients weigh {weight} in all, which "
            f"needs secagg.bits = {bits_needed(weight, quant_bits)} or more (or lower "
            f"secagg.quant_bits)"
        )
    return fits if quant_bits is None else quant_bits


@dataclass(frozen=True)
class SecureSum(Transform):
    name: ClassVar[str] = "secure_sum"
    stage: ClassVar[Stage] = "mask"
    hides_individual_updates: ClassVar[bool] = True
    needs_values: ClassVar[bool] = True
    needs_a_mean: ClassVar[bool] = True
    #: the protocol's settings (``[secagg]``: protocol, b, c, b_q, and SecAgg's t and k
    #: or Paillier's key size)
    config: SecAggConfig | HomomorphicConfig = field(default_factory=SecAggConfig)
    #: "examples": w_k = the client's training examples; "uniform": w_k = 1
    weighting: Literal["examples", "uniform"] = "examples"
    seed: int = 0

    @property
    def stages(self) -> tuple[str, ...]:
        """The protocol's stages in order (a client that stops at one answers no later one)."""
        return homomorphic.STAGES if isinstance(self.config, HomomorphicConfig) else STAGES

    @property
    def input_stage(self) -> str:
        """The stage at which a client's input leaves it, masked or encrypted."""
        return "encrypt" if isinstance(self.config, HomomorphicConfig) else "mask"

    def weight(self, num_examples: int) -> int:
        """w_k, the integer weight a client with ``num_examples`` examples sends."""
        return max(1, int(num_examples)) if self.weighting == "examples" else 1

    @staticmethod
    def dim(start: Params) -> int:
        """The length of a client's input: the shared coordinates, its weight and its
        clipped count."""
        return sum(t.numel() for t in start.values()) + 2

    def setup(
        self, weights: Mapping[int, int], round_: int, dim: int
    ) -> RoundSetup | HomomorphicSetup:
        """The round's public parameters for the clients of ``weights`` (client → w_k), b_q
        the largest that their total weight W cannot wrap; a ``ValueError`` naming the
        ``secagg`` key when the settings cannot hold them."""
        total, bits = sum(weights.values()), self.config.bits
        check_bits(bits)
        quant_bits = quant_bits_for_weight(
            total, bits, self.config.quant_bits, f"round {round_ + 1}"
        )
        if isinstance(self.config, HomomorphicConfig):
            config = replace(self.config, quant_bits=quant_bits)
            return homomorphic.setup_round(config, sorted(weights), round_, dim)
        return setup_round(
            replace(self.config, quant_bits=quant_bits), sorted(weights), round_, dim
        )

    def encode(
        self,
        update: Params,
        start: Params,
        weight: int,
        client_id: int,
        setup: RoundSetup | HomomorphicSetup,
    ) -> UInts:
        """Client ``client_id``'s input x_k for the round of ``setup`` (its update over
        ``start``, weighted by ``weight``); it never leaves the client unmasked or
        unencrypted."""
        names = sorted(start)
        if sorted(update) != names:
            raise ValueError(
                f"secagg: client {client_id} sends {sorted(set(update) ^ set(names))} "
                f"beside or instead of the payload's tensors; secure aggregation sums "
                f"updates of the payload's tensors"
            )
        delta = (flatten(update, names).double() - flatten(start, names).double()).numpy()
        if not np.all(np.isfinite(delta)):
            raise FloatingPointError(f"client {client_id}'s update is not finite")
        c = setup.clip_range
        clipped = int(np.count_nonzero(np.abs(delta) > c))
        rng = np.random.default_rng([self.seed, setup.round, client_id, ROUNDING_SALT])
        q = setup.quantizer.quantize(delta, rng)
        # each client's count is capped so that n of them cannot wrap the sum
        cap = max_clients(setup.bits, 1) // len(setup.clients)
        tail = np.array([weight, min(clipped, cap)], dtype=np.uint64)
        return np.concatenate([q * np.uint64(weight), tail])

    def server(
        self,
        updates: dict[int, Params],
        payloads: dict[int, Params],
        round_: int,
        state: Mapping[str, Any],
    ) -> Served:
        """Each summed client's update as s_k + Δ̄, from the unmasked sum."""
        if not updates:
            return Served(updates, state)
        first = updates[min(updates)]
        total = first[SUM_KEY].numpy().astype(np.float64)
        quant_bits = int(first[QUANT_BITS_KEY].item())
        levels = (1 << quant_bits) - 1
        c = self.config.clip_range
        weight, clipped = total[-2], total[-1]
        mean = (total[:-2] * (2 * c / levels) - c * weight) / weight
        delta = torch.from_numpy(mean)
        out: dict[int, Params] = {}
        for cid in updates:
            start = payloads[cid]
            names = sorted(start)
            vector = flatten(start, names).double() + delta
            out[cid] = unflatten(vector, start, names)
        return Served(
            out,
            state,
            {
                "clients": len(updates),
                "weight": int(weight),
                "clipped": int(clipped),
                "quant_bits": quant_bits,
                "step": 2 * c / levels,
            },
        )
