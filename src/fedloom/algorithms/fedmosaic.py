"""FedMosaic (Seo et al., ICLR 2026, arXiv 2506.11024; the final version calls PQ-LoRA
"Co-LoRA"; official code github.com/snumprlab/fedmosaic): relevance-guided personalized
aggregation (RELA) of gated dual adapters with PQ-LoRA, on the mosaic model
(:mod:`fedloom.models.mosaic`, ``[model] adapters = "mosaic"``, chosen automatically).

Client k holds a local adapter θ_k (local LoRA, local P/Q), one gate per adapted layer and
its head, all in ``ctx.state``; only θ_k and a sanitized task vector travel. In round t:

    client k:  G_k    = anchor gradient on its data        (fedloom.train.task_vector)
               v_k    ← EMA(sanitize(compress(G_k)))        (fedloom.algorithms.relevance)
               θ_k, gates, head ← local training with its global slot set to the payload
                                  θ̄_k and frozen                          (sends θ_k, v_k)
    server:    S_ij   = relevance(v_i, v_j)                 (mean per-column cosine)
               θ̄_i    = Σ_{j≠i} softmax_j(S_ij / T) θ_j     over the clients known so far

θ̄_i fills client i's global slot (local tensor names mapped to global ones). The server
keeps each known client's last θ_j and v_j; a client that has not sent a task vector yet
gets the uniform mean of the known clients' adapters, and before anybody is known the
initial adapter. P and Q train at ``train.lr`` times ``train.pq_lr_scale``
(:func:`fedloom.train.local.group_lr`; 5/3, the official code's text runs). PQ-LoRA sits
in one block per six adapted blocks by default (``model.lora.pq_blocks = "auto"``; the
official code's 4 blocks of its 16- to 28-block models), chosen on the validation split
of a concept-shift federation against fedloom's earlier 4 blocks, which on a 6-block
MiniLM froze A and B in most of the local adapter.

Scoring (``scored_slot``): a client is scored with the model it trained, its global slot
as it trained with it plus its local adapter, gates and head (``"kept"``, the official
code's: train_VLM_CL.py:316-336 saves the client's model after its local training and
eval_scripts/eval_VLM_CL.py:470 scores that). ``"latest"`` scores the local part with
the slot θ̄_k rebuilt from the last aggregate instead, which the gates and the local
adapter never trained with. Before its first training round a client uses the global
adapter alone (every gate pinned to it), as FedLocal-Global.

Every round logs the relevance matrix (scope ``relevance``, rows and columns in the order
of ``clients``); summary.json keeps the last one and the run directory its heatmap.

Mixed backbones (``[[model.groups]]``; the method spans them): every client computes its
task vector at the anchor, the smallest backbone of the federation at its initial
adapter, on its data encoded for the anchor, so all task vectors share one shape and S
spans every client. Client i's global slot gets, from a client j of its own backbone,
every adapter tensor; from a client of another backbone only P and Q, PQ block k with PQ
block k (counted from the bottom of each backbone) and module with module of the same
role (:func:`pq_keys`). ``absent`` says what a tensor gets from the clients that do not
contribute it:

- ``"renormalize"`` (the default, the official code's rule, federated_methods/
  fedmosaic_utils.py:55-150): each tensor's weights are renormalized over the clients
  that contribute it, so P and Q are weighted by the softmax over all the others and
  every other tensor by the softmax over the others of i's backbone. A tensor nobody
  else contributes is a copy of client i's own adapter (the official slot starts as a
  copy of the client's local adapter, fedmosaic_utils.py:70-74, and only what others
  contribute overwrites it): a client alone on its backbone gets its own local adapter
  in every layer but P and Q. fedloom's server takes that copy from the last adapter the
  client sent (its local adapter; with ``global_slot = "trained"`` its trained slot); a
  client that has sent none gets the initial slot.
- ``"initial"``: the weight of a client that lacks a tensor goes to the tensor's initial
  value (the global slot as built: B = 0, P = Q = 0), θ̄_i[n] = Σ_{j has n} w_ij θ_j[n] +
  (Σ_{j lacks n} w_ij) θ_init[n]. A client relevant to few of its own backbone gets
  little of their tensors, and a client alone on its backbone the initial slot (B = 0)
  outside P and Q.

The default follows the official code and the validation split of a two-backbone
concept-shift federation (seed 0), which ranks it above ``"initial"``; on its test
clients the two tie. In a single-backbone federation every known client has every tensor,
the two rules differ only for a client with no known other (its own adapter, or the
initial slot), the anchor is the client's own backbone and every tensor is aggregated by
name.

Differences from the paper and the official code (each also stated where it is
implemented): the task vector is compressed by a seeded random projection (the reference
keeps the first 40 % of rows: ``compression = "rows"``), scaled to norm 1 and noised with
a stated multiplier (the reference adds std 1e-4 with no bound); only clients known to the
server take part; the gate pools over non-padding tokens, has a bias and trains its
noise weight. The reference's clients are causal LMs sharing their frozen LM head; so
are fedloom's on a decoder (the verbalizer head, :mod:`fedloom.models.heads`), while an
encoder's classifier head is the client's own, trains with its local part and never
travels (``head = "own"``). ``head = "frozen"`` freezes it at its initial value instead,
a seeded function of the run's configuration and so the same head on every client of a
backbone, as the reference's shared LM head. ``"own"`` stays the default, chosen on the
validation split of a concept-shift federation (seed 0); on its test clients the two
scored within a point.

Every gate starts at g = ``gate_start`` (0.5, the paper's: its bias at logit(gate_start),
its weights at 0); below 1/2 the local adapter starts with the larger share.

``global_slot = "trained"`` (fedloom's variant; the paper's slot is ``"frozen"``, the
default): the global slot trains with the local part in the same steps (its gradient
scaled by the gate g) and client k sends its trained slot θ̄_k' instead of θ_k, so the
server's aggregate is θ̄_i = Σ_{j≠i} softmax_j(S_ij / T) θ̄_j'. The slot then carries its
relevant partners' training from round to round, a relevance-weighted FedAvg (as FedAMP's
and pFedGraph's personalized models), where the frozen slot is a mean of adapters each
trained on one client's data alone; the local adapter still never leaves the client.

Ablations: ``weighting = "uniform"`` (the mean over the known others instead of relevance
weights), ``noise_multiplier = 0`` (no sanitization noise), ``share_pq = false`` (P and Q
only within a backbone), ``absent = "initial"`` (see above), ``[model.lora] pq_blocks
= 0`` (ordinary LoRA everywhere), ``train.pq_lr_scale = 1`` (P and Q at the LoRA rate).
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch

from fedloom.algorithms import relevance as rela
from fedloom.algorithms.base import Algorithm, ClientContext, ClientResult, ServerState
from fedloom.algorithms.registry import register
from fedloom.algorithms.sharing import is_head
from fedloom.models.dual import GATE, global_only
from fedloom.models.mosaic import is_mosaic
from fedloom.models.pqlora import layer_index, role
from fedloom.params import Params
from fedloom.train.local import steps_per_round, train_locally
from fedloom.train.task_vector import anchor_gradient, sampled_batches

#: the task vector's name in a client's result (it is not an adapter tensor)
TASK_VECTOR = "rela.task_vector"
#: where a client keeps its local part (local adapter, gates, head), the global slot it
#: last trained with, and its task vector EMA
LOCAL, SLOT, VECTOR = "mosaic_local", "mosaic_slot", "task_vector"
_GLOBAL_SLOT = re.compile(r"\.lora_([ABPQ])\.global(\.|$)")
_LOCAL_ADAPTER = re.compile(r"\.lora_([ABPQ])\.local(\.|$)")
_PQ = re.compile(r"^(.*)\.lora_([PQ])\.(?:local|global)$")
#: a gate's bias (NoisyTokenGate: g = σ(mean_t x_t · w + b), w = 0 at the start)
_GATE_BIAS = f"{GATE}.proj.bias"
#: keeps the seeds of the task-vector batches and noise apart from training's
_VECTOR_SALT = 0x7E1A


def pq_keys(names: Iterable[str]) -> dict[str, tuple[int, str, str]]:
    """Each PQ-LoRA tensor name of one backbone's adapter -> (block k, module role, "P" or
    "Q"): block k is the k-th of the backbone's PQ layers from the bottom, so that block
    k of one backbone meets block k of another, module by role
    (:func:`fedloom.models.pqlora.role`). Modules without a role are left out."""
    parsed = {n: m for n in names if (m := _PQ.match(n)) is not None}
    indices = {layer_index(m.group(1)) for m in parsed.values()}
    layers = sorted(i for i in indices if i is not None)
    keys = {}
    for name, match in parsed.items():
        module_role, layer = role(match.group(1)), layer_index(match.group(1))
        if module_role is not None and layer is not None:
            keys[name] = (layers.index(layer), module_role, match.group(2))
    return keys


def as_global(name: str) -> str:
    """A local adapter tensor's name in the global slot (``lora_A.local`` -> ``lora_A.global``)."""
    return _LOCAL_ADAPTER.sub(r".lora_\1.global\2", name)


@register("fedmosaic")
@dataclass(frozen=True)
class FedMosaic(Algorithm):
    personalized = True
    has_global = False
    adapter_model = "mosaic"

    spans_backbones = True

    temperature: float = 0.5
    similarity: Literal["columns", "flat"] = "columns"
    weighting: Literal["relevance", "uniform"] = "relevance"
    grad_every: int = 5
    compression: Literal["projection", "rows"] = "projection"
    projection_rows: int = 32
    projection_cols: int = 128
    projection_seed: int = 0
    keep_fraction: float = 0.4
    noise_multiplier: float = 0.01
    ema_decay: float = 0.5
    share_pq: bool = True
    absent: Literal["renormalize", "initial"] = "renormalize"
    gate_start: float = 0.5
    global_slot: Literal["frozen", "trained"] = "frozen"
    scored_slot: Literal["kept", "latest"] = "kept"
    head: Literal["own", "frozen"] = "own"

    def __post_init__(self) -> None:
        checks = {
            "gate_start": 0 < self.gate_start < 1,
            "temperature": self.temperature > 0,
            "grad_every": self.grad_every >= 1,
            "projection_rows": self.projection_rows >= 1,
            "projection_cols": self.projection_cols >= 1,
            "keep_fraction": 0 < self.keep_fraction <= 1,
            "noise_multiplier": self.noise_multiplier >= 0,
            "ema_decay": 0 <= self.ema_decay < 1,
        }
        for key, ok in checks.items():
            if not ok:
                raise ValueError(f"algorithm.{key}: out of range (got {getattr(self, key)!r})")

    def check_model(self, params: Params) -> None:
        if not is_mosaic(params):
            raise ValueError(
                'model.adapters: fedmosaic needs the mosaic model ([model] adapters = "mosaic")'
            )

    # --- server --------------------------------------------------------------------------
    def init(self, global_params: Params) -> ServerState:
        return self.init_mixed({"": global_params}, {})

    def init_mixed(
        self, initial: Mapping[str, Params], backbone_of: Mapping[int, str]
    ) -> ServerState:
        """Each backbone's initial global slot, and which backbone every client runs (a
        client not listed runs the backbone ``""`` of a single-backbone federation)."""
        slots = {
            b: {n: t for n, t in params.items() if _GLOBAL_SLOT.search(n)}
            for b, params in initial.items()
        }
        first = next(iter(slots.values()))
        return ServerState(
            round=0,
            global_params=first,
            extra={
                "slots": slots,
                "pq_keys": {b: pq_keys(slot) for b, slot in slots.items()},
                "backbone_of": dict(backbone_of),
                "adapters": {},
                "vectors": {},
                "clients": [],
                "similarity": None,
            },
        )

    def weights(self, state: ServerState, client_ids: Sequence[int]) -> dict[int, dict[int, float]]:
        """Each of ``client_ids``'s weights over the known other clients (the softmax rows
        of the relevance matrix computed once for all of them)."""
        clients = state.extra["clients"]
        relevant = {}
        if self.weighting == "relevance" and any(c in clients for c in client_ids):
            relevant = rela.relevance_weights(
                state.extra["similarity"], clients, self.temperature, dict.fromkeys(clients, True)
            )
        out = {}
        for cid in client_ids:
            known = [c for c in clients if c != cid]
            out[cid] = (
                relevant[cid] if known and cid in relevant else {c: 1 / len(known) for c in known}
            )
        return out

    def backbone(self, state: ServerState, client_id: int) -> str:
        return state.extra["backbone_of"].get(client_id, "")

    def as_slot(self, state: ServerState, sender: int, target: str) -> Params:
        """What ``sender`` sent, under the names of backbone ``target``'s global slot: all
        of it from the same backbone; from another, its P and Q matched by block and role
        (with ``share_pq``), nothing else."""
        sent = state.extra["adapters"][sender]
        own = self.backbone(state, sender)
        if own == target:
            return {as_global(n): t for n, t in sent.items()}
        if not self.share_pq:
            return {}
        theirs = pq_keys(sent)
        ours = {key: name for name, key in state.extra["pq_keys"][target].items()}
        return {ours[key]: sent[name] for name, key in theirs.items() if key in ours}

    def payload(self, state: ServerState, client_id: int) -> Params:
        return self.payloads(state, [client_id])[client_id]

    def payloads(self, state: ServerState, client_ids: Sequence[int]) -> dict[int, Params]:
        """Each client's global slot θ̄_i, the clients of one backbone at once
        (:func:`fedloom.algorithms.relevance.personalized_aggregates`: one product per
        tensor, each sent adapter read once). A tensor no other client contributes is,
        with ``absent = "renormalize"``, the client's own last sent one (the initial
        value when it has sent none), with ``"initial"`` the initial value."""
        by_backbone: dict[str, list[int]] = {}
        for cid in client_ids:
            by_backbone.setdefault(self.backbone(state, cid), []).append(cid)
        out: dict[int, Params] = {}
        for target, ids in by_backbone.items():
            slot = state.extra["slots"][target]
            sent = {c: self.as_slot(state, c, target) for c in state.extra["adapters"]}
            fallback = slot if self.absent == "initial" else None
            mixed = rela.personalized_aggregates(
                sent, self.weights(state, ids), {n: t.shape for n, t in slot.items()}, fallback
            )
            for cid in ids:
                own = sent.get(cid, {}) if self.absent == "renormalize" else {}
                out[cid] = {**slot, **own, **mixed[cid]}
        return out

    def aggregate(self, state: ServerState, results: Sequence[ClientResult]) -> ServerState:
        adapters = dict(state.extra["adapters"])
        vectors = dict(state.extra["vectors"])
        for res in results:
            vectors[res.client_id] = res.params[TASK_VECTOR]
            adapters[res.client_id] = {n: t for n, t in res.params.items() if n != TASK_VECTOR}
        clients = sorted(vectors)
        similarity = rela.relevance([vectors[c] for c in clients], self.similarity)
        return self.next_state(
            state,
            extra={
                **state.extra,
                "adapters": adapters,
                "vectors": vectors,
                "clients": clients,
                "similarity": similarity,
            },
        )

    def round_rows(self, state: ServerState) -> list[dict[str, Any]]:
        if state.extra["similarity"] is None:
            return []
        return [{"scope": "relevance", **self.relevance_record(state)}]

    def relevance_record(self, state: ServerState) -> dict[str, Any]:
        """{"clients": ids, "matrix": S} as lists (rows and columns in the order of ids)."""
        return {
            "clients": list(state.extra["clients"]),
            "matrix": state.extra["similarity"].tolist(),
        }

    def summary(self, state: ServerState) -> dict[str, Any]:
        return (
            {} if state.extra["similarity"] is None else {"relevance": self.relevance_record(state)}
        )

    # --- client --------------------------------------------------------------------------
    def local_part(self, ctx: ClientContext, payload: Mapping[str, torch.Tensor]) -> Params:
        """The client's own tensors (local adapter, gates, head): kept, or initial, each
        gate's bias at logit(``gate_start``) so that it starts at g = ``gate_start``."""
        if LOCAL in ctx.state:
            return ctx.state[LOCAL]
        start = math.log(self.gate_start / (1 - self.gate_start))
        return {
            n: torch.full_like(t, start) if n.endswith(_GATE_BIAS) else t
            for n, t in ctx.model.initial_params.items()
            if n not in payload
        }

    def task_vector(self, ctx: ClientContext) -> torch.Tensor:
        """v_k: this round's sanitized anchor gradient folded into the client's EMA."""

        steps = steps_per_round(ctx.settings, len(ctx.train))
        anchor = ctx.model if ctx.anchor is None else ctx.anchor
        data = ctx.train if ctx.anchor_train is None else ctx.anchor_train
        batches = sampled_batches(
            data, steps, self.grad_every, ctx.settings.batch_size, ctx.seed ^ _VECTOR_SALT
        )
        grad = anchor_gradient(anchor, batches)
        if self.compression == "projection":
            compressed = rela.project(
                grad, self.projection_rows, self.projection_cols, self.projection_seed
            )
        else:
            compressed = rela.keep_rows(grad, self.keep_fraction)
        noise = torch.Generator().manual_seed(ctx.seed ^ _VECTOR_SALT)
        released = rela.sanitize(compressed, self.noise_multiplier, noise)
        return rela.ema(ctx.state.get(VECTOR), released, self.ema_decay)

    def trained_names(self, local: Iterable[str], payload: Iterable[str]) -> set[str]:
        """The tensors local training updates: the local part (without the head when
        ``head = "frozen"``), and with ``global_slot = "trained"`` the global slot."""
        own = {n for n in local if not (self.head == "frozen" and is_head(n))}
        return own | set(payload) if self.global_slot == "trained" else own

    def local_train(self, ctx: ClientContext, payload: Params) -> ClientResult:
        vector = self.task_vector(ctx)
        local = self.local_part(ctx, payload)
        ctx.model.set_params({**payload, **local})
        if self.global_slot == "frozen":
            sends = [n for n in local if _LOCAL_ADAPTER.search(n)]
        else:
            sends = list(payload)
        metrics = train_locally(ctx, only=self.trained_names(local, payload))
        trained = ctx.model.get_params()
        ctx.state[LOCAL] = {n: trained[n] for n in local}
        ctx.state[SLOT] = {n: trained[n] for n in payload}
        ctx.state[VECTOR] = vector
        sent = {n: trained[n] for n in sends}
        return ClientResult(ctx.client_id, {**sent, TASK_VECTOR: vector}, len(ctx.train), metrics)

    def client_adapter(self, ctx: ClientContext, payload: Params) -> Params:
        """The client's model: before its first training round the global adapter alone;
        after it, its local part with the global slot it last trained with
        (``scored_slot = "kept"``) or with ``payload``, the slot rebuilt from the last
        aggregate (``"latest"``)."""
        local = self.local_part(ctx, payload)
        if LOCAL not in ctx.state:
            return global_only({**payload, **local})
        slot = ctx.state[SLOT] if self.scored_slot == "kept" else payload
        return {**slot, **local}
