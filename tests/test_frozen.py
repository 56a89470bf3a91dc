"""``_frozen.maker``: the quick constructor of the frozen records every run makes gives the
very object the class's own ``__init__`` does, still frozen."""

from __future__ import annotations

import dataclasses
from datetime import UTC, datetime
from typing import Any

import pytest

from fastapi_singletonjob import Checkpoint, JobContext
from fastapi_singletonjob._frozen import maker

AT = datetime(2026, 12, 4, 1, 2, 3, 456789, tzinfo=UTC)


def test_made_records_are_the_ones_the_class_makes_and_stay_frozen() -> None:
    args: tuple[Any, ...] = (3, AT, AT, "success", None, "n1", 42, {"cursor": 7})
    made, built = maker(Checkpoint)(*args), Checkpoint(*args)

    assert type(made) is Checkpoint
    assert made == built and repr(made) == repr(built)
    assert dataclasses.astuple(made) == dataclasses.astuple(built)
    with pytest.raises(dataclasses.FrozenInstanceError):
        made.iteration = 4  # type: ignore[misc]
    assert maker(Checkpoint)(4, *args[1:]) != built


def test_a_context_made_quickly_has_every_field_even_those_init_leaves_out() -> None:
    """``JobContext``'s event loop is no ``__init__`` argument (its ``__post_init__`` looks
    it up): the maker takes every field, so the runner gives the run's loop itself."""
    names = [field.name for field in dataclasses.fields(JobContext)]
    values = ["job-1", "n1", 9, AT, AT, 2, None, object(), None]
    assert len(values) == len(names)

    ctx = maker(JobContext)(*values)

    assert [getattr(ctx, name) for name in names] == values
    with pytest.raises(dataclasses.FrozenInstanceError):
        ctx.iteration = 3  # type: ignore[misc]


def test_only_slotted_dataclasses_have_a_maker() -> None:
    @dataclasses.dataclass(frozen=True)
    class Plain:
        a: int

    with pytest.raises(TypeError, match="Plain is not a slotted dataclass"):
        maker(Plain)
