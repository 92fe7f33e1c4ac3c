"""fedloom's client-side messages as Flower records (flwr's Message API) and back.

A payload or an update (``Params``) travels as an ``ArrayRecord`` (numpy arrays, no
pickle); a message of secure aggregation as its wire bytes (:mod:`fedloom.secagg.wire`)
in a ``ConfigRecord``; bfloat16 tensors, which numpy cannot hold, travel as float32 (exact) with their
names in a ``ConfigRecord`` beside it, and come back as bfloat16. A client's metrics are a
``MetricRecord``; everything else (round, attempt, the verdict on a client's pending
state, scores with undefined entries) a ``ConfigRecord``.

What a client sends: a train reply carries what the method shares (``ClientResult.params``;
under secure aggregation nothing, its update leaving masked in the protocol's messages),
an evaluate reply its scores only: the adapter a client is scored with stays on its node.
"""

from __future__ import annotations

import json
from typing import Any

import torch
from flwr.app import ArrayRecord, ConfigRecord, MetricRecord, RecordDict

from fedloom.algorithms import ClientResult
from fedloom.params import Params
from fedloom.runtime.clients import ScopeMetrics, TrainReply
from fedloom.secagg import wire

#: the ConfigRecord with a message's fedloom fields
FIELDS = "fedloom"
#: the ConfigRecord with a message of secure aggregation's protocol
SECAGG = "secagg"


def field_int(record: ConfigRecord, key: str) -> int:
    """``record[key]``, which must be an int (a ConfigRecord holds any of Flower's scalars)."""
    value = record[key]
    if not isinstance(value, int):
        raise TypeError(f"message field {key!r}: expected an int, got {type(value).__name__}")
    return value


def put_params(content: RecordDict, key: str, params: Params) -> None:
    """``params`` into ``content[key]`` (an ArrayRecord, names in order)."""
    bf16 = [name for name, t in params.items() if t.dtype == torch.bfloat16]
    content[key] = ArrayRecord(
        {
            name: (t.float() if t.dtype == torch.bfloat16 else t).detach().contiguous()
            for name, t in params.items()
        }
    )
    content[f"{key}.bf16"] = ConfigRecord({"names": bf16})


def take_params(content: RecordDict, key: str) -> Params:
    """The ``Params`` :func:`put_params` stored under ``key``."""
    names = content.config_records[f"{key}.bf16"]["names"]
    bf16 = set(names) if isinstance(names, list) else set()
    return {
        name: (t.to(torch.bfloat16) if name in bf16 else t)
        for name, t in content.array_records[key].to_torch_state_dict().items()
    }


def request(fields: dict[str, Any], payload: Params | None = None) -> RecordDict:
    """A message to a client: its fedloom ``fields`` and, if any, its ``payload``."""
    content = RecordDict({FIELDS: ConfigRecord(fields)})
    if payload is not None:
        put_params(content, "payload", payload)
    return content


def train_reply_record(reply: TrainReply) -> RecordDict:
    content = RecordDict(
        {
            FIELDS: ConfigRecord(
                {
                    "client_id": reply.client_id,
                    "missing": reply.missing or "",
                    "num_examples": 0 if reply.result is None else reply.result.num_examples,
                }
            )
        }
    )
    if reply.result is not None:
        put_params(content, "params", reply.result.params)
        content["metrics"] = MetricRecord({k: float(v) for k, v in reply.result.metrics.items()})
    return content


def train_reply_from(content: RecordDict) -> TrainReply:
    fields = content.config_records[FIELDS]
    cid = field_int(fields, "client_id")
    if "params" not in content:
        return TrainReply(cid, None, str(fields["missing"]) or "no update")
    record = content.metric_records["metrics"]  # scalars only: train_reply_record's
    metrics = {k: float(v) for k, v in record.items() if isinstance(v, int | float)}
    result = ClientResult(
        cid, take_params(content, "params"), field_int(fields, "num_examples"), metrics
    )
    return TrainReply(cid, result, str(fields["missing"]) or None)


def scores_record(scores: ScopeMetrics | None) -> RecordDict:
    """A client's evaluation as it leaves its node: its scores by scope (JSON: a score may
    be undefined, which a MetricRecord cannot hold; None: a method without an adapter of
    the client's own), and nothing else. The adapter it was scored with stays on the node."""
    return RecordDict({FIELDS: ConfigRecord({"scores": json.dumps(scores)})})


def scores_from(content: RecordDict) -> ScopeMetrics | None:
    """The scores of a :func:`scores_record`."""
    scores = json.loads(str(content.config_records[FIELDS]["scores"]))
    if scores is not None and not isinstance(scores, dict):
        raise TypeError(f"message field 'scores': expected a table, got {type(scores).__name__}")
    return scores


def secagg_request(fields: dict[str, Any], message: Any) -> RecordDict:
    """A stage of secure aggregation to a client: its fedloom ``fields`` and the
    protocol's ``message`` to it."""
    content = request(fields)
    content[SECAGG] = ConfigRecord({"message": wire.pack(message)})
    return content


def secagg_message_from(content: RecordDict) -> Any:
    """The protocol's message in a :func:`secagg_request` or :func:`secagg_answer`; None
    when the client did not answer."""
    if SECAGG not in content:
        return None
    data = content.config_records[SECAGG]["message"]
    if not isinstance(data, bytes):
        raise TypeError("message field 'message': expected bytes")
    return wire.unpack(data)


def secagg_answer(client_id: int, message: Any) -> RecordDict:
    """A client's answer to a stage (None: it does not answer, having stopped)."""
    content = RecordDict({FIELDS: ConfigRecord({"client_id": client_id})})
    if message is not None:
        content[SECAGG] = ConfigRecord({"message": wire.pack(message)})
    return content
