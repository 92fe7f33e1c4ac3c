"""Name -> algorithm class; ``create(name, **hp)`` checks the hyperparameters' names and
types against the algorithm's dataclass fields before constructing it.

Every hyperparameter is validated against its field's annotation, strictly: a bool is not
a number, a string is not a number, 2.5 is not an int (an int is a float). A mistake names
the config key (``algorithm.proximal_mu: expected a number for fedprox (got 'abc')``);
several mistakes are named on one line, separated by ``"; "``. This holds for every
registered algorithm, from its fields alone: nothing to repeat when a new one is added.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import sys
import types
import typing
from collections.abc import Callable, Sequence
from typing import Annotated, Any, Literal, TypeVar, Union

from pydantic import ConfigDict, TypeAdapter, ValidationError

from fedloom.algorithms.base import Algorithm, declares
from fedloom.config import STRICT, expected

_REGISTRY: dict[str, type[Algorithm]] = {}
A = TypeVar("A", bound=type[Algorithm])


class AlgorithmError(ValueError):
    """Unknown algorithm or bad hyperparameter; the message names the config key."""


def register(name: str) -> Callable[[A], A]:
    def wrap(cls: A) -> A:
        cls.name = name
        _REGISTRY[name] = cls
        return cls

    return wrap


def available() -> list[str]:
    return sorted(_REGISTRY)


def declaring(capability: str) -> list[str]:
    """The registered algorithms whose own class states ``capability``
    (:func:`fedloom.algorithms.base.declares`)."""
    return [name for name in available() if declares(_REGISTRY[name], capability)]


def rank_methods() -> list[str]:
    """The registered algorithms defined on per-client LoRA ranks (``mixed_ranks``)."""
    return [name for name in available() if _REGISTRY[name].mixed_ranks]


@dataclasses.dataclass(frozen=True)
class Hyperparameter:
    """One field of an algorithm's dataclass, as ``fedloom algorithms`` lists it."""

    name: str
    annotation: Any  # the resolved type (or the annotation string if it cannot be resolved)
    default: Any  # dataclasses.MISSING when required

    @property
    def required(self) -> bool:
        return self.default is dataclasses.MISSING

    @property
    def expected(self) -> str:
        return expected_type(self.annotation)


_STRICT = ConfigDict(**STRICT, arbitrary_types_allowed=True)


def _resolved_hints(cls: type) -> dict[str, Any]:
    """The classes' annotations as types; one unresolvable annotation only loses its field."""
    try:
        return typing.get_type_hints(cls, include_extras=True)
    except Exception:  # noqa: BLE001 - evaluating an annotation string can raise anything
        hints: dict[str, Any] = {}
        for owner in reversed(cls.__mro__):
            namespace = (
                vars(sys.modules[owner.__module__]) if owner.__module__ in sys.modules else {}
            )
            for key, value in inspect.get_annotations(owner).items():
                try:
                    hints[key] = typing.get_type_hints(
                        type("_One", (), {"__annotations__": {key: value}}),
                        namespace,
                        include_extras=True,
                    )[key]
                except Exception:  # noqa: BLE001 - as above, for this annotation alone
                    hints[key] = value
        return hints


@functools.cache
def _fields(name: str) -> tuple[tuple[Hyperparameter, TypeAdapter | None], ...]:
    cls = _get(name)
    hints = _resolved_hints(cls)
    out = []
    for f in dataclasses.fields(cls):
        if not f.init or "section" in f.metadata:  # set from another config section
            continue
        tp = hints.get(f.name, f.type)
        default: Any = f.default
        if f.default_factory is not dataclasses.MISSING:
            default = f.default_factory()
        try:
            adapter: TypeAdapter | None = (
                None if isinstance(tp, str) else TypeAdapter(tp, config=_STRICT)
            )
        except Exception:  # noqa: BLE001 - a type pydantic cannot check goes unchecked
            adapter = None
        out.append((Hyperparameter(f.name, tp, default), adapter))
    return tuple(out)


def hyperparameters(name: str) -> list[Hyperparameter]:
    """The hyperparameters of algorithm ``name``, from its dataclass fields."""
    return [h for h, _ in _fields(name)]


def description(name: str) -> str:
    """One line: the first paragraph of the class docstring, else of its module's docstring."""
    cls = _get(name)
    doc = cls.__dict__.get("__doc__") or ""
    if doc.startswith(f"{cls.__name__}("):  # the signature dataclasses writes when there is none
        doc = ""
    doc = doc or (sys.modules[cls.__module__].__doc__ or "")
    first = inspect.cleandoc(doc).split("\n\n", 1)[0]
    return " ".join(first.split())


def expected_type(tp: Any) -> str:
    """``float`` -> "a number", ``Literal['a', 'b']`` -> "one of 'a', 'b'", ..."""
    if isinstance(tp, str):
        return tp
    origin = typing.get_origin(tp)
    if origin is Annotated:
        return expected_type(typing.get_args(tp)[0])
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    if origin in (Union, types.UnionType):
        members = [a for a in typing.get_args(tp) if a is not type(None)]
        return " or ".join(expected_type(a) for a in members)
    if origin in (list, tuple, set, frozenset, Sequence) or tp in (list, tuple):
        args = [a for a in typing.get_args(tp) if a is not Ellipsis]
        return "a list" + (f" of {expected_type(args[0])}" if args else "")
    if origin is dict or tp is dict:
        return "a table"
    names = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}
    return names.get(tp, getattr(tp, "__name__", str(tp)))


def _get(name: str) -> type[Algorithm]:
    if name not in _REGISTRY:
        raise AlgorithmError(
            f"algorithm.name: unknown algorithm {name!r} (known: {', '.join(available())})"
        )
    return _REGISTRY[name]


def _validate(adapter: TypeAdapter, value: Any) -> Any:
    """Strict validation; a TOML array also fills a tuple or (frozen)set field."""
    try:
        return adapter.validate_python(value)
    except ValidationError:
        if not isinstance(value, list):
            raise
        for container in (tuple, frozenset, set):
            try:
                return adapter.validate_python(container(value))
            except (ValidationError, TypeError):
                continue
        raise


def create(name: str, **hyperparameters: Any) -> Algorithm:
    cls = _get(name)
    fields = {h.name: (h, adapter) for h, adapter in _fields(name)}
    problems: list[str] = []
    values: dict[str, Any] = {}
    for key, value in hyperparameters.items():
        if key not in fields:
            problems.append(
                f"algorithm.{key}: unknown hyperparameter for {name} "
                f"(known: {', '.join(sorted(fields)) or 'none'})"
            )
            continue
        hp, adapter = fields[key]
        if adapter is None:
            values[key] = value
            continue
        try:
            values[key] = _validate(adapter, value)
        except ValidationError as err:
            kind = expected(err, hp.expected)
            problems.append(f"algorithm.{key}: expected {kind} for {name} (got {value!r})")
    if problems:
        raise AlgorithmError("; ".join(problems))
    try:
        return cls(**values)
    except (TypeError, ValueError) as err:
        message = str(err)
        if not message.startswith("algorithm."):
            message = f"algorithm ({name}): {message}"
        raise AlgorithmError(message) from None
