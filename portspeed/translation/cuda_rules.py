"""The kinds of rule the torch.cuda view is written in, and how a table of them becomes the view's attributes.

Why a table: the view answers ~60 torch.cuda names, most of them "call the adapter's method
of the same name with the device argument turned into an index". Written out, that is
sixty near-copies; as a table (``cuda_view.CUDA_API``: name -> rule) each name is one line
that says what it does, and the rules below are the only code.

Contract: ``build(table, namespace)`` turns a table into ``(attributes, unsupported,
named_only)`` *once*, when ``portspeed.translation.cuda_view`` is imported:

- ``Delegate`` becomes a plain function compiled from source with the caller's module
  globals, so ``torch.cuda.current_device()`` runs exactly the bytecode the hand-written
  ``return int(get_accelerator().current_device())`` ran: no table lookup, no extra frame,
  no ``getattr`` by name at call time (the hot names, ``current_device`` and
  ``get_rng_state`` / ``set_rng_state``, are called dozens of times per training step);
- ``Returns`` becomes a function returning a literal; ``Use`` and ``Forward`` are objects
  used as they are; ``Alias`` is the same object as another name; ``Namespace`` is a
  module-like object built from its own table;
- ``Unsupported`` and ``NamedOnly`` are not attributes: the view's ``__getattr__`` raises
  for them with the hint (``NamedOnly`` types may be named, constructing one raises).

Limits: ``Signature`` fragments are Python source (parameters, and the call's arguments),
compiled once; they come from this package's own table, never from user input.
"""

from __future__ import annotations

import ast
import dataclasses
import types
from typing import Any, Callable, Mapping

__all__ = ["Alias", "Delegate", "Forward", "NamedOnly", "Namespace", "Returns", "Signature", "Unsupported",
           "Use", "build", "BOOL", "DISCARD", "INT", "RETURN"]


@dataclasses.dataclass(frozen=True, slots=True)
class Signature:
    """A torch.cuda signature (``params``) and what it passes to the adapter (``args``), as source."""

    params: str = ""
    args: str = ""


#: How a Delegate hands back the adapter's answer (a format with one slot: the adapter call).
RETURN = "return {}"
INT = "return int({})"
BOOL = "return bool({})"
DISCARD = "{}"


@dataclasses.dataclass(frozen=True, slots=True)
class Delegate:
    """torch.cuda.<name>(<takes.params>) -> get_accelerator().<method>(<takes.args>), result as ``result`` says."""

    method: str
    takes: Signature = Signature()
    result: str = RETURN


@dataclasses.dataclass(frozen=True, slots=True)
class Returns:
    """torch.cuda.<name>(<params>) -> a constant (a literal: True, None, (0, 0)...)."""

    value: Any
    params: str = ""


@dataclasses.dataclass(frozen=True, slots=True)
class Use:
    """The name is this object (a hand-written function, a class, a value)."""

    obj: Any


@dataclasses.dataclass(frozen=True, slots=True)
class Alias:
    """The name is the same object as another name of the same table."""

    name: str


@dataclasses.dataclass(frozen=True, slots=True)
class Forward:
    """The name is torch.cuda's own object (device-neutral types); absent if this torch lacks it."""


@dataclasses.dataclass(frozen=True, slots=True)
class Unsupported:
    """No translation: touching the name raises UnsupportedCudaCallError with ``hint``."""

    hint: str = ""


@dataclasses.dataclass(frozen=True, slots=True)
class NamedOnly:
    """A CUDA-only type that framework code names at import (annotations): naming works, constructing raises."""

    hint: str


@dataclasses.dataclass(frozen=True, slots=True)
class Namespace:
    """A torch.cuda sub-namespace (``nvtx``, ``amp``...) built from its own table; unknown names raise."""

    members: Mapping[str, Any]


def _compile(name: str, source: str, namespace: dict[str, Any], doc: str) -> Callable[..., Any]:
    """Compile ``source`` (one ``def``) with ``namespace`` as its globals: it runs as if written in that module."""
    code = compile(source, f"<portspeed torch.cuda view: {name}>", "exec")
    local: dict[str, Any] = {}
    exec(code, namespace, local)  # noqa: S102 - source built from this package's table only
    fn = local[name]
    fn.__module__ = namespace.get("__name__", fn.__module__)
    fn.__qualname__ = f"CudaView.{name}"
    fn.__doc__ = doc
    return fn


def _function(name: str, rule: Delegate | Returns, namespace: dict[str, Any]) -> Callable[..., Any]:
    if isinstance(rule, Delegate):
        call = f"get_accelerator().{rule.method}({rule.takes.args})"
        body = rule.result.format(call)
        doc = f"torch.cuda.{name}({rule.takes.params}) answered by the adapter's {rule.method}()."
        return _compile(name, f"def {name}({rule.takes.params}):\n    {body}\n", namespace, doc)
    try:
        literal = ast.literal_eval(repr(rule.value)) == rule.value
    except (ValueError, SyntaxError):
        literal = False
    if not literal:
        raise ValueError(f"Returns({rule.value!r}) for {name!r} is not a literal")
    doc = f"torch.cuda.{name}({rule.params}): always {rule.value!r} here."
    return _compile(name, f"def {name}({rule.params}):\n    return {rule.value!r}\n", namespace, doc)


def _entries(table: Mapping[str, Any], namespace: dict[str, Any], real: Any,
             prefix: str) -> tuple[dict[str, Any], dict[str, str], dict[str, str]]:
    """One table's attributes (aliases left as Alias, namespaces left out), unsupported and named-only hints."""
    attrs: dict[str, Any] = {}
    unsupported: dict[str, str] = {}
    named_only: dict[str, str] = {}
    for name, rule in table.items():
        if isinstance(rule, (Delegate, Returns)):
            attrs[name] = _function(name, rule, namespace)
        elif isinstance(rule, (Use, Alias)):
            attrs[name] = rule.obj if isinstance(rule, Use) else rule
        elif isinstance(rule, Forward):
            if real is not None and hasattr(real, name):
                attrs[name] = getattr(real, name)
        elif isinstance(rule, Unsupported):
            unsupported[name] = rule.hint
        elif isinstance(rule, NamedOnly):
            unsupported[name] = named_only[name] = rule.hint
        elif not (isinstance(rule, Namespace) and prefix == "torch.cuda"):
            raise TypeError(f"{prefix}.{name}: unknown rule {rule!r} (namespaces nest one level only)")
    return attrs, unsupported, named_only


def build(table: Mapping[str, Any], namespace: dict[str, Any], real: Any,
          namespace_type: Callable[[str, dict[str, Any], dict[str, str]], types.ModuleType],
          ) -> tuple[dict[str, Any], dict[str, str], dict[str, str]]:
    """(attributes, unsupported name -> hint, named-only name -> hint) for the torch.cuda ``table``.

    ``namespace`` is the globals the compiled functions run with (``get_accelerator``,
    ``_device_index``); ``real`` the module ``Forward`` names come from; ``namespace_type``
    makes a ``Namespace`` rule's object from (name, attributes, unsupported hints). An
    ``Alias``, at the top or inside a namespace, names a top-level entry.
    """
    attrs, unsupported, named_only = _entries(table, namespace, real, "torch.cuda")

    def resolve(value: Any) -> Any:
        return attrs[value.name] if isinstance(value, Alias) else value

    for name, value in list(attrs.items()):
        attrs[name] = resolve(value)
    for name, rule in table.items():
        if isinstance(rule, Namespace):
            full = f"torch.cuda.{name}"
            sub, sub_unsupported, _ = _entries(rule.members, namespace, real, full)
            attrs[name] = namespace_type(full, {k: resolve(v) for k, v in sub.items()}, sub_unsupported)
    return attrs, unsupported, named_only
