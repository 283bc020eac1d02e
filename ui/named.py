"""Handlers wired by name. A handler takes named values and objects and returns a named object; ``wire`` connects
it to the components of the same names, so no list of components mirrors a parameter list by position.

- **Inputs** are the handler's parameters: a parameter is the component of its name, or, when it is typed as a
  dataclass (``Controls``, the Generate form; ``Shown``, a view's pickers), the group of components named as its
  fields, rebuilt into that object for the call. ``gr.Request`` and ``gr.SelectData`` parameters are Gradio's, as
  usual.
- **Outputs** are the fields of the ``Outputs`` dataclass the handler returns (or yields): each the component of its
  name, a nested ``Outputs`` (a view panel) a group. A field the handler leaves unset keeps its component as it is.
- Gradio calls a positional function: ``wire`` makes one whose parameters are the inputs' names (what the API
  advertises) and hands the handler's named object back as a tuple in the outputs' order.
"""

from __future__ import annotations

import collections.abc
import dataclasses
import inspect
import typing
from typing import Any, Callable

import gradio as gr

GRADIO_TYPES = (gr.Request, gr.SelectData)


def keep() -> Any:
    """An output left as it is on the page (``gr.skip()``); the default of every ``Outputs`` field."""
    return dataclasses.field(default_factory=gr.skip)


@dataclasses.dataclass
class Outputs:
    """Base of a handler's named outputs."""

    @classmethod
    def names(cls) -> list[tuple[str, ...]]:
        """Each output's path, in the order the components are wired: ('status',), ('view', 'tier'), ..."""
        out = []
        for f in dataclasses.fields(cls):
            kind = _hints(cls)[f.name]
            out += [(f.name, *sub) for sub in kind.names()] if _is_outputs(kind) else [(f.name,)]
        return out

    def values(self) -> tuple:
        out = []
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            out += value.values() if isinstance(value, Outputs) else [value]
        return tuple(out)


def wire(listener: Callable, handler: Callable, on: dict[str, Any], outputs: Any = None, **kwargs) -> Any:
    """``listener(fn, inputs, outputs, **kwargs)`` with the components ``on`` names for ``handler``'s parameters and
    returned fields. ``on`` maps a name to a component, or a group (a dataclass parameter, a nested ``Outputs``) to an
    object whose attributes are its fields' components. A handler that returns no ``Outputs`` (one value, or a
    tuple of like values) is given its ``outputs``."""
    hints = _hints(handler)
    params = [p for p in inspect.signature(handler).parameters.values() if p.name != "self"]
    inputs, names, defaults, builders = [], [], [], []
    for param in params:
        kind = hints.get(param.name)
        if kind in GRADIO_TYPES:
            continue
        if dataclasses.is_dataclass(kind):
            fields = [f.name for f in dataclasses.fields(kind)]
            inputs += [_component(on, param.name, field) for field in fields]
            names += fields
            defaults += [f.default for f in dataclasses.fields(kind)]
            builders.append((param.name, kind, fields))
        else:
            inputs.append(_component(on, param.name))
            names.append(param.name)
            defaults.append(param.default)
            builders.append((param.name, None, [param.name]))
    returned = hints.get("return")
    if typing.get_origin(returned) in (collections.abc.Iterator, collections.abc.Generator):
        returned = typing.get_args(returned)[0]  # a streaming handler yields its Outputs
    if _is_outputs(returned):
        outputs = [_component(on, *path) for path in returned.names()]
    specials = [p for p in params if hints.get(p.name) in GRADIO_TYPES]

    def arguments(values: tuple) -> dict:
        # Gradio passes the inputs, then what the special parameters ask for (its request, the event's data)
        given = {p.name: value for p, value in zip(specials, values[len(names):])}
        at = 0
        for name, kind, fields in builders:
            chunk = values[at:at + len(fields)]
            at += len(fields)
            given[name] = kind(**dict(zip(fields, chunk))) if kind is not None else chunk[0]
        return given

    def flat(result):
        return result.values() if isinstance(result, Outputs) else result

    if inspect.isgeneratorfunction(handler):
        def call(*values):
            for result in handler(**arguments(values)):
                yield flat(result)
    else:
        def call(*values):
            return flat(handler(**arguments(values)))

    # What the API advertises: each input's default (a field's, a parameter's), from the first one that has one on
    missing = (dataclasses.MISSING, inspect.Parameter.empty)
    first = max((i + 1 for i, d in enumerate(defaults) if d in missing), default=0)
    positional = [inspect.Parameter(name, inspect.Parameter.POSITIONAL_OR_KEYWORD,
                                    default=inspect.Parameter.empty if i < first else defaults[i])
                  for i, name in enumerate(names)]
    special = [inspect.Parameter(p.name, inspect.Parameter.POSITIONAL_OR_KEYWORD, default=None,
                                 annotation=hints[p.name]) for p in specials]
    call.__signature__ = inspect.Signature(positional + special)
    call.__annotations__ = {p.name: hints[p.name] for p in specials}
    call.__name__, call.__doc__ = handler.__name__, handler.__doc__
    return listener(call, inputs, outputs, **kwargs)


def _component(on: dict[str, Any], name: str, *fields: str) -> Any:
    if name not in on:
        raise KeyError(f"no component named {name!r} for this handler (named: {sorted(on)})")
    target = on[name]
    for field in fields:
        target = getattr(target, field)
    return target


def _is_outputs(kind: Any) -> bool:
    return isinstance(kind, type) and issubclass(kind, Outputs)


def _hints(obj: Any) -> dict[str, Any]:
    return typing.get_type_hints(obj.__func__ if inspect.ismethod(obj) else obj)
