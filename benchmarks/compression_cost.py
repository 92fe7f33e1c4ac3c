"""What each compression operator costs on one LoRA update: encoded bytes and encode /
decode time.

    python -m benchmarks.compression_cost [--repeats 10] [--threads 1] [--json PATH]

The update is MiniLM's (all-MiniLM-L6-v2: 6 layers, hidden 384, FFN 1536) LoRA adapter at
fedloom's default r = 16 on the default BERT targets (query, key, value,
attention.output.dense, intermediate.dense, output.dense): per layer four 16 × 384 A and
384 × 16 B factors, intermediate's 16 × 384 and 1536 × 16, output's 16 × 1536 and
384 × 16; 72 matrices, 663,552 float32 values, i.i.d. N(0, 1) (seed 0). The flat
operators compress the 663,552 values as one vector (one encode, one decode); PowerSGD,
a matrix operator, compresses each of the 72 matrices (its times and bytes are the sums,
warm-started from the previous repeat as in training).

Each time is the median of ``--repeats`` runs of ``encode`` (bytes out) and of
``decode`` (bytes in, tensor out) on the CPU, at ``--threads`` torch threads. Bytes are
the encoding's length, header included; the ratio is float32's 4 · 663,552 bytes over
them.

``--train`` also measures the real thing: one MiniLM client's round of local training
(``--train-steps`` AdamW steps of batch 16 on SST-2, the default LoRA r = 16 adapter and
its head) against what the ``compress`` transform adds to that round on the update it
produced: the client's compression (``up``: the delta, error feedback, encode) and the
server's decoding, each the median of ``--repeats``, as a percentage of the training time.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import time
from typing import Any

import torch

from fedloom.comm.compressors import Compressor, create

HIDDEN, FFN, LAYERS, RANK = 384, 1536, 6, 16
#: (d_out, d_in) of each adapted linear layer of one BERT block
TARGETS = ((HIDDEN, HIDDEN),) * 4 + ((FFN, HIDDEN), (HIDDEN, FFN))

#: (operator, hyperparameters)
OPERATORS: list[tuple[str, dict[str, Any]]] = [
    ("identity", {}),
    ("fp16", {}),
    ("bf16", {}),
    ("qsgd", {"levels": 1}),
    ("qsgd", {"levels": 4}),
    ("qsgd", {"levels": 16}),
    ("terngrad", {}),
    ("natural", {}),
    ("ps_quant", {"norm": float("inf"), "levels": 1}),
    ("ps_quant", {"norm": 2.0, "levels": 4}),
    ("randk", {"ratio": 0.01}),
    ("randk", {"ratio": 0.1}),
    ("topk", {"ratio": 0.01}),
    ("topk", {"ratio": 0.1}),
    ("sign", {}),
    ("powersgd", {"rank": 1}),
    ("powersgd", {"rank": 4}),
]


def lora_shapes() -> list[tuple[int, int]]:
    """The 72 LoRA factor shapes: A (r × d_in) and B (d_out × r) per target per layer."""
    return [s for _ in range(LAYERS) for out, inp in TARGETS for s in ((RANK, inp), (out, RANK))]


def median_ms(repeats: int, run: Any) -> tuple[float, Any]:
    times, result = [], None
    for _ in range(repeats):
        start = time.perf_counter()
        result = run()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3, result


def measure(
    compressor: Compressor, tensors: list[torch.Tensor], repeats: int
) -> dict[str, float | int]:
    generator = torch.Generator().manual_seed(1)
    states: list[dict[str, Any]] = [{} for _ in tensors]

    def encode() -> list[bytes]:
        return [compressor.encode(t, generator, s) for t, s in zip(tensors, states, strict=True)]

    encode_ms, encoded = median_ms(repeats, encode)
    decode_ms, _ = median_ms(repeats, lambda: [compressor.decode(b) for b in encoded])
    size = sum(len(b) for b in encoded)
    values = sum(t.numel() for t in tensors)
    return {
        "bytes": size,
        "ratio": round(4 * values / size, 2),
        "encode_ms": round(encode_ms, 2),
        "decode_ms": round(decode_ms, 2),
    }


def client_round(steps: int) -> tuple[float, dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(seconds of one MiniLM client's local training round, its update, its payload)."""
    from pathlib import Path

    from fedloom.config import validate
    from fedloom.experiment import Experiment

    glue = Path(__file__).resolve().parents[2] / "shared" / "data" / "glue"
    raw = {
        "data": {
            "task": "SST-2",
            "data_dir": str(glue),
            "max_train_examples": 1000,
            "max_dev_examples": 50,
        },
        "partition": {"scheme": "iid", "num_clients": 4},
        "model": {"backbone": "minilm"},
        "algorithm": {"name": "fedavg"},
        "train": {"local_steps": steps, "batch_size": 16},
    }
    exp = Experiment.build(validate(raw))
    from fedloom.runtime.clients import ClientHost

    payload = exp.algorithm.init(exp.model_for(0).initial_params).global_params
    host = ClientHost(exp, [0])
    host.train(0, 0, 0, payload)  # warm-up: first-call allocations
    start = time.perf_counter()
    reply = host.train(0, 1, 0, payload)
    seconds = time.perf_counter() - start
    assert reply.result is not None
    return seconds, reply.result.params, payload


def in_a_round(steps: int, repeats: int) -> list[dict[str, Any]]:
    """Each operator's ``compress`` transform on a real client update, against the round."""
    from fedloom.transforms import chain

    seconds, update, payload = client_round(steps)
    values = sum(t.numel() for t in payload.values())
    print(f"one client round: {steps} steps, {seconds:.2f} s; {values:,} shared values\n")
    rows = []
    for name, hp in OPERATORS:
        transform = chain([{"name": "compress", "compressor": name, **hp}])
        up_ms, sent = median_ms(repeats, functools.partial(transform.up, update, payload, 0, 0, {}))
        server_ms, _ = median_ms(
            repeats, functools.partial(transform.server, {0: sent}, {0: payload}, 0)
        )
        settings = ", ".join(f"{k}={v}" for k, v in hp.items()) or "–"
        share = (up_ms + server_ms) / (1e3 * seconds)
        rows.append(
            {
                "operator": name,
                "settings": settings,
                "client_ms": round(up_ms, 1),
                "server_ms": round(server_ms, 1),
                "share": round(100 * share, 2),
                "train_seconds": round(seconds, 3),
            }
        )
    print("| operator | settings | client: compress ms | server: decode ms | % of the round |")
    print("|---|---|---:|---:|---:|")
    for row in rows:
        print(
            f"| {row['operator']} | {row['settings']} | {row['client_ms']} | "
            f"{row['server_ms']} | {row['share']} |"
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", metavar="PATH", default=None, help="also write the rows here")
    parser.add_argument("--train", action="store_true", help="also time a real client round")
    parser.add_argument("--train-steps", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.train:
        in_a_round(args.train_steps, args.repeats)
        return

    generator = torch.Generator().manual_seed(0)
    matrices = [torch.randn(shape, generator=generator) for shape in lora_shapes()]
    flat = torch.cat([m.reshape(-1) for m in matrices])
    rows = []
    for name, hp in OPERATORS:
        compressor = create(name, **hp)
        tensors = matrices if compressor.matrix else [flat]
        settings = ", ".join(f"{k}={v}" for k, v in hp.items()) or "–"
        rows.append(
            {"operator": name, "settings": settings} | measure(compressor, tensors, args.repeats)
        )

    print(
        f"{flat.numel():,} float32 values ({4 * flat.numel():,} bytes) in {len(matrices)} "
        f"LoRA matrices; median of {args.repeats}; {args.threads} torch thread(s)\n"
    )
    print("| operator | settings | bytes | ratio vs float32 | encode ms | decode ms |")
    print("|---|---|---:|---:|---:|---:|")
    for row in rows:
        print(
            f"| {row['operator']} | {row['settings']} | {row['bytes']:,} | {row['ratio']} | "
            f"{row['encode_ms']} | {row['decode_ms']} |"
        )
    if args.json:
        with open(args.json, "w") as out:
            json.dump(
                {
                    "values": flat.numel(),
                    "matrices": len(matrices),
                    "threads": args.threads,
                    "repeats": args.repeats,
                    "rows": rows,
                },
                out,
                indent=2,
            )


if __name__ == "__main__":
    main()
