"""What differs between the tensors a model expects and those a checkpoint holds, by name and shape: one phrase each
for the missing, unexpected and wrongly shaped tensors, so a loader can name every problem in one error."""

from __future__ import annotations

from collections.abc import Callable, Mapping

Shape = tuple[int, ...]


def _listed(label: str, names: list[str], most: int) -> str:
    more = " ..." if len(names) > most else ""
    return f"{label} {len(names)}: {names[:most]}{more}"


def key_mismatches(expected: Mapping[str, Shape], got: Mapping[str, Shape],
                   ignored: Callable[[str], bool] | None = None, most: int = 20) -> list[str]:
    """Phrases ("missing N: [...]", "unexpected N: [...]", "wrong shape N: ['k: (a, b) != expected (c, d)']"), at
    most `most` names in each; [] when the names and shapes agree. `ignored`: extra names that are not an error."""
    missing = sorted(set(expected) - set(got))
    unexpected = sorted(k for k in set(got) - set(expected) if ignored is None or not ignored(k))
    wrong = sorted(f"{k}: {tuple(got[k])} != expected {tuple(expected[k])}" for k in set(expected) & set(got)
                   if tuple(got[k]) != tuple(expected[k]))
    return [_listed(label, names, most) for label, names in
            (("missing", missing), ("unexpected", unexpected), ("wrong shape", wrong)) if names]
