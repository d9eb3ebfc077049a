"""The progress bar of a command that makes env steps (``edgerl rollout``, ``sim``, ``train``) or
reads a bag's messages (``edgerl bag``)."""

from __future__ import annotations

from tqdm import tqdm


def step_bar(
    desc: str, total: int | None, initial: int = 0, *, disable: bool = False, unit: str = "step"
) -> tqdm:
    """A bar that counts env steps (or another ``unit``) from ``initial`` (a resumed run's, or
    those the workers made before the bar was shown) to ``total`` (``None``: without end),
    redrawn to the terminal's width; ``disable`` hides it."""
    return tqdm(
        total=total,
        initial=initial,
        desc=desc,
        unit=unit,
        unit_scale=True,
        dynamic_ncols=True,
        disable=disable,
    )


def advance(bar: tqdm, steps: int) -> None:
    """Move ``bar`` to ``steps``, no further than its total: a run that ends a batch or an env
    group past its budget ends its bar full, where tqdm would drop the bar for a bare count."""
    bar.update((steps if bar.total is None else min(steps, bar.total)) - bar.n)
