"""Covering arrays: every pair of levels of two factors in at least one row, found by a deterministic greedy.

A *factor* is a named feature with its levels, the first being the baseline
(the feature off, or its plainest value). A *row* gives every factor one level.
``pairwise`` returns rows such that every pair ``(factor i = a, factor j = b)``
that the constraint allows appears in at least one row (strength 2), with the
all-baseline row first; every level appears in some row (a single factor's
levels each get one). The greedy is AETG's without the randomness: while a
pair is uncovered, a new row starts from the first uncovered pair (in factor
and level order) and fills the other factors one at a time with the level that
covers the most pairs still uncovered against the levels already chosen (ties:
the earlier level); a level the constraint refuses is never chosen. Equal
inputs give equal rows. ``full_product`` is every allowed row.

No torch, no vLLM: this module knows nothing of attention.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Callable, Iterable, Mapping

Row = dict  # factor name -> level
Allowed = Callable[[Mapping[str, str]], bool]  # False when a (partial) row can never be valid


@dataclass(frozen=True)
class Factor:
    name: str
    levels: tuple[str, ...]  # the first is the baseline

    def __post_init__(self):
        if not self.levels or len(set(self.levels)) != len(self.levels):
            raise ValueError(f"factor {self.name}: levels must be distinct and at least one, got {self.levels}")

    @property
    def baseline(self) -> str:
        return self.levels[0]


def _always(_row: Mapping[str, str]) -> bool:
    return True


def baseline_row(factors: Iterable[Factor]) -> Row:
    return {f.name: f.baseline for f in factors}


def required_pairs(factors: list[Factor], allowed: Allowed = _always) -> set[tuple[int, str, int, str]]:
    """Every pair of levels of two factors the constraint allows, as (i, level of i, j, level of j), i < j."""
    pairs = set()
    for (i, fi), (j, fj) in itertools.combinations(enumerate(factors), 2):
        for a in fi.levels:
            for b in fj.levels:
                if allowed({fi.name: a, fj.name: b}):
                    pairs.add((i, a, j, b))
    return pairs


def pairs_of(factors: list[Factor], row: Mapping[str, str]) -> set[tuple[int, str, int, str]]:
    return {(i, row[fi.name], j, row[fj.name]) for (i, fi), (j, fj) in itertools.combinations(enumerate(factors), 2)}


def uncovered(factors: list[Factor], rows: Iterable[Mapping[str, str]], allowed: Allowed = _always) -> list[tuple]:
    """The allowed pairs no row covers, sorted (empty for a covering array); the property the tests hold."""
    seen = set()
    for row in rows:
        seen |= pairs_of(factors, row)
    return sorted(required_pairs(factors, allowed) - seen)


def pairwise(factors: Iterable[Factor], allowed: Allowed = _always) -> list[Row]:
    """A strength-2 covering array of ``factors`` under ``allowed``, all-baseline row first (see the module doc)."""
    factors = list(factors)
    names = [f.name for f in factors]
    if len(set(names)) != len(names):
        raise ValueError(f"factor names must be distinct, got {names}")
    rows: list[Row] = []
    todo = required_pairs(factors, allowed)
    base = baseline_row(factors)
    if allowed(base):
        rows.append(base)
        todo -= pairs_of(factors, base)
    order = {f.name: {level: k for k, level in enumerate(f.levels)} for f in factors}

    def key(pair):
        i, a, j, b = pair
        return (i, order[factors[i].name][a], j, order[factors[j].name][b])

    while todo:
        i, a, j, b = min(todo, key=key)
        row = {factors[i].name: a, factors[j].name: b}
        for k, factor in enumerate(factors):
            if factor.name in row:
                continue
            best, best_gain = None, -1
            for level in factor.levels:
                trial = {**row, factor.name: level}
                if not allowed(trial):
                    continue
                gain = sum(1 for m, other in enumerate(factors) if other.name in row and
                           ((m, row[other.name], k, level) if m < k else (k, level, m, row[other.name])) in todo)
                if gain > best_gain:
                    best, best_gain = level, gain
            if best is None:
                raise ValueError(f"no level of factor {factor.name} is allowed with {row}")
            row[factor.name] = best
        ordered = {f.name: row[f.name] for f in factors}
        if not allowed(ordered):
            raise ValueError(f"the greedy built a row the constraint refuses: {ordered}")
        rows.append(ordered)
        todo -= pairs_of(factors, ordered)
    # A level no allowed pair holds (the only factor, or one whose every pair the constraint refuses) still
    # gets a row of its own, when the constraint allows it beside the baselines.
    for factor in factors:
        for level in factor.levels:
            if not any(row[factor.name] == level for row in rows):
                single = {**base, factor.name: level}
                if allowed(single):
                    rows.append(single)
    return rows


def full_product(factors: Iterable[Factor], allowed: Allowed = _always) -> list[Row]:
    """Every row the constraint allows, the all-baseline row first (levels vary fastest in the last factor)."""
    factors = list(factors)
    return [row for row in (dict(zip([f.name for f in factors], levels))
                            for levels in itertools.product(*(f.levels for f in factors))) if allowed(row)]


def product_size(factors: Iterable[Factor]) -> int:
    size = 1
    for f in factors:
        size *= len(f.levels)
    return size


__all__ = ["Factor", "Row", "baseline_row", "full_product", "pairs_of", "pairwise", "product_size",
           "required_pairs", "uncovered"]
