"""The staged lookup as `kvgate eval semantic` runs it, and where its cheap stage loses paraphrases.

`StagedCache` holds the stored questions as a gateway does: every one sketched; an embedding enters
the judge's index only once some lookup's cheap stage named its question, or a lookup about to hit
needed its sketch neighbourhood (`SemanticStage`). A question of a stored one's normalized form is
served that one, as a trivial variant, before any of it.

Each lookup also records where the asked question's own stored partner (its pair's `a`) left the
cheap stage (`Trace.stage`), checked in the order the cheap stage runs:

    variant              served as a trivial variant, before the cheap stage
    language             no floor for the question's language: never judged
    below the floor      the partner's sketch cosine is under the language's floor
    beyond the k nearest within the floor, but `PLAUSIBLE_CANDIDATES` closer sketches come first
    veto: <rule>         a veto (`vetoes.hard_negative`) rules the partner out; the judge applies
                         the same vetoes, so no judge serves it
    prejudge             the prejudge found no candidate worth embedding: the lookup ended
    judged               the partner was named to be embedded and judged

`loss_rows` turns the label-1 lookups' traces into one row per stage: how many partners it ruled
out, how many of those were served right anyway (the partner was already embedded for an earlier
lookup, or a copy of the question was served), and how many the judge alone (every stored question
embedded) serves right: the recall that stage costs, and the most that loosening it could recover.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from gateway.responsecache.keys import PartitionKey
from gateway.responsecache.lookup import RULED_OUT_PREJUDGE
from gateway.responsecache.semantic.index import embeddings_index, sketches_index
from gateway.responsecache.semantic.judge import Verifier, hard_negative
from gateway.responsecache.semantic.match import (
    PLAUSIBLE_CANDIDATES,
    Match,
    Plausible,
    best_match,
    plausible_with_chance,
    sketch_neighbourhood,
)
from gateway.responsecache.semantic.sketch import NEVER, Sketcher
from gateway.responsecache.semantic.variants import normalized_question
from gateway.responsecache.store import EntryMeta

PARTITION = PartitionKey("eval")
VARIANT, LANGUAGE, BELOW_FLOOR, BEYOND_K = "variant", "language", "below the floor", "beyond the k nearest"
PREJUDGE, JUDGED, VETO = "prejudge", "judged", "veto: "
STAGE_ORDER = (VARIANT, LANGUAGE, BELOW_FLOOR, BEYOND_K, VETO, PREJUDGE, JUDGED)


def variant_forms(metas: list[EntryMeta]) -> dict[str, EntryMeta]:
    """The stored questions by their normalized form (`variants.normalized_question`), the first
    stored of each: what the gateway serves, before the judge, to a question of the same form."""
    forms: dict[str, EntryMeta] = {}
    for meta in metas:
        forms.setdefault(normalized_question(meta.query or ""), meta)
    return forms


@dataclass(slots=True, frozen=True)
class Trace:
    """One lookup: where its own partner left the cheap stage (`STAGE_ORDER`; None when the caller
    named no partner), and why the cheap stage ended the whole lookup (`RULED_OUT_*`; None when it
    was judged or a variant)."""

    stage: str | None
    ended: str | None


class StagedCache:
    """The stored questions as a gateway holds them (module docstring)."""

    def __init__(self, metas: list[EntryMeta], sketcher: Sketcher) -> None:
        self.variants = variant_forms(metas)
        self.sketcher = sketcher
        self.sketches = sketches_index(sketcher.dimensions)
        self.sketches.add(metas)
        self.embedded = embeddings_index()
        self._sketch_of = {m.query: m.sketch for m in metas if m.query is not None and m.sketch is not None}
        self.num_ruled_out = 0
        self.num_judged = 0
        self.last = Trace(None, None)

    def match(self, text: str, vector: np.ndarray, verifier: Verifier, own: str | None = None) -> Match | None:
        """What the gateway serves for `text`; `own`: its partner's text, traced in `last`."""
        variant = self.variants.get(normalized_question(text))
        if variant is not None:
            self.last = Trace(VARIANT if own is not None else None, None)
            return Match(variant, 1.0, 1.0)
        sketch = self.sketcher.sketch(text)
        floor = self.sketcher.floor(text)
        found = plausible_with_chance(self.sketches, PARTITION, sketch, text, floor, self.sketcher.prejudge, 0.0)
        self.last = Trace(self._own_stage(text, sketch, floor, found, own) if own is not None else None,
                          found.ruled_out if not found.metas else None)
        if not found.metas:
            self.num_ruled_out += 1
            return None
        self.num_judged += 1
        self.embedded.add(found.metas)
        match = best_match(self.embedded, PARTITION, vector, text, verifier, 0.0)
        if match is not None:
            missing = [m for m in sketch_neighbourhood(self.sketches, PARTITION, sketch, 0.0)
                       if m.id not in self.embedded]
            if missing:
                self.embedded.add(missing)
                match = best_match(self.embedded, PARTITION, vector, text, verifier, 0.0)
        return match

    def _own_stage(self, text: str, sketch: np.ndarray, floor: float, found: Plausible, own: str) -> str:
        if any(m.query == own for m in found.metas):
            return JUDGED
        if floor >= NEVER:
            return LANGUAGE
        own_sketch = self._sketch_of.get(own)
        if own_sketch is None or float(sketch @ own_sketch) < floor:
            return BELOW_FLOOR
        nearest = self.sketches.search(PARTITION, sketch, PLAUSIBLE_CANDIDATES)
        if all(c.meta.query != own for c in nearest):
            return BEYOND_K
        reason = hard_negative(text, own)
        if reason is not None:
            return VETO + reason
        return PREJUDGE if found.ruled_out == RULED_OUT_PREJUDGE else JUDGED


class Outcomes(Protocol):
    """What `loss_rows` reads of a lookup's outcome (`semantic_eval.Outcome`)."""

    @property
    def score(self) -> float | None: ...

    @property
    def right_copy(self) -> bool: ...


def _order(stage: str) -> tuple[int, str]:
    prefix = VETO if stage.startswith(VETO) else stage
    return STAGE_ORDER.index(prefix) if prefix in STAGE_ORDER else len(STAGE_ORDER), stage


def loss_rows(stages: Sequence[str | None], labels: Sequence[int], staged: Sequence[Outcomes],
              alone: Sequence[Outcomes]) -> list[dict[str, Any]]:
    """Per stage, over the label-1 lookups (copies counted right, as the headline reading):
    `pairs` whose partner that stage ruled out (`share` of all label-1 lookups), `served_right` as
    staged, `judge_alone_right` with every question embedded, `lost`: right for the judge alone,
    not as staged."""
    positives = [i for i, label in enumerate(labels) if label == 1 and stages[i] is not None]
    counts = Counter(stages[i] for i in positives)
    rows = []
    for stage in sorted(counts, key=lambda s: _order(s or "")):
        mine = [i for i in positives if stages[i] == stage]
        right = [staged[i].score is not None and staged[i].right_copy for i in mine]
        alone_right = [alone[i].score is not None and alone[i].right_copy for i in mine]
        rows.append({"stage": stage, "pairs": len(mine), "share": round(len(mine) / len(positives), 4),
                     "served_right": sum(right), "judge_alone_right": sum(alone_right),
                     "lost": sum(a and not r for a, r in zip(alone_right, right, strict=True))})
    return rows


def ended_shares(ended: Sequence[str | None]) -> dict[str, float]:
    """The share of all lookups the cheap stage ended, by reason (`RULED_OUT_*`)."""
    counts = Counter(reason for reason in ended if reason is not None)
    return {reason: round(n / len(ended), 4) for reason, n in sorted(counts.items())} if ended else {}


def print_losses(name: str, losses: dict[str, Any]) -> None:
    rows, ended = losses["rows"], losses["ended"]
    total = sum(r["pairs"] for r in rows)
    print(f"  cheap stage's losses, {name}: where each of the {total} label-1 lookups' own partner left it "
          "(copies counted right)")
    print(f"    {'stage':28} {'pairs':>6} {'share':>7} {'served right':>13} {'judge alone right':>18} {'lost':>5}")
    for r in rows:
        print(f"    {r['stage']:28} {r['pairs']:6d} {r['share']:7.1%} {r['served_right']:13d} "
              f"{r['judge_alone_right']:18d} {r['lost']:5d}")
    print("    lookups (any label) the cheap stage ended: " +
          (", ".join(f"{reason} {share:.1%}" for reason, share in ended.items()) or "none"))
