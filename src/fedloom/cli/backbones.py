"""``fedloom backbones``: the named backbones and the heads."""

from __future__ import annotations

from pathlib import Path

import typer


def backbones() -> None:
    """List the named backbones (model.backbone) and the heads (model.head).

    A backbone is named in the experiment file with [model] backbone = "NAME", or given
    as any Hugging Face model id or local model directory; the head that scores its
    output is [model] head = "NAME".

    Example:
        fedloom backbones
    """
    import ast
    import importlib.util
    import typing

    from fedloom.config import ModelConfig
    from fedloom.models.catalog import PACKAGED, BackboneError, resolve_backbone

    typer.echo("backbones (model.backbone = ...):")
    width = max(len(n) for n in PACKAGED)
    for backbone, what in PACKAGED.items():
        try:
            spec = resolve_backbone(backbone)
            where = f"{spec.kind}; {'random weights, tokenizer from ' if spec.tiny else ''}{spec.source}"
        except BackboneError as err:
            where = f"not installed: {err}"
        typer.echo(f"    {backbone:<{width}}  {what} ({where})")
    typer.echo(f"    {'<id or path>':<{width}}  any Hugging Face model id or local model directory")
    # the heads' docstrings, read from their module's source: importing it loads torch
    heads_module = importlib.util.find_spec("fedloom.models.heads")
    source = heads_module.origin if heads_module is not None else None
    if source is None:
        raise RuntimeError("fedloom.models.heads has no source file to read")
    docs = {
        node.name: ast.get_docstring(node) or ""
        for node in ast.parse(Path(source).read_text(encoding="utf-8")).body
        if isinstance(node, ast.ClassDef)
    }
    heads = {"classifier": docs["ClassifierHead"], "verbalizer": docs["VerbalizerHead"]}
    typer.echo("heads (model.head = ...):")
    for head in typing.get_args(ModelConfig.model_fields["head"].annotation):
        what = (
            " ".join(heads[head].split())
            if head in heads
            else "classifier on an encoder, verbalizer on a causal LM"
        )
        typer.echo(f"    {head:<{width}}  {what}")
