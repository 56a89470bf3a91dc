"""Quick construction of the frozen records that every run makes (its ``JobContext``, the
``Checkpoint`` it shows): hundreds of runs may end on one instant.

A frozen dataclass's own ``__init__`` sets each field with ``object.__setattr__`` by name,
which costs about as much as the rest of a no-op run's bookkeeping. ``maker`` writes, once per
class, a constructor that sets each field through its slot's descriptor instead: the same
object (equal, hashed and shown alike, still frozen), in about half the time. Generated code,
as ``dataclasses`` itself makes its ``__init__``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, TypeVar

__all__ = ["maker"]

T = TypeVar("T")


def maker(cls: type[T]) -> Callable[..., T]:
    """A constructor of the frozen, slotted dataclass ``cls`` that takes every field, in
    order, positionally (those its ``__init__`` leaves out too), and runs no
    ``__post_init__``: the caller gives what it would set."""
    params = dataclasses.fields(cls)  # type: ignore[arg-type]
    names = [field.name for field in params]
    if not names or getattr(cls, "__slots__", None) is None:
        raise TypeError(f"{cls.__name__} is not a slotted dataclass")
    space: dict[str, Any] = {"_new": object.__new__, "_cls": cls}
    lines = [f"def make({', '.join(f'_{name}' for name in names)}):", "    made = _new(_cls)"]
    for name in names:
        space[f"_set{name}"] = getattr(cls, name).__set__  # the slot's member descriptor
        lines.append(f"    _set{name}(made, _{name})")
    lines.append("    return made")
    exec("\n".join(lines), space)  # the source above, from the fields' names
    make: Callable[..., T] = space["make"]
    make.__qualname__ = make.__name__ = f"make_{cls.__name__}"
    return make
