"""Running a shared prefix once: the decision (`worth_sharing`, from a model's measured costs),
the plan (`plan_sharing`, pure) and the run (`shared_prefix_logits`: each group's prefix prefilled
once, every row continued from a copy of its KV cache by decode steps). Below scoring.py, which
uses it for lm-eval's multiple-choice contexts and for score's shared queries.
"""

from __future__ import annotations

import bisect
from collections import Counter
from typing import NamedTuple

import torch

from . import extend
from .costs import Costs
from .inputs import Rows, common_prefix, flat_index, pad_right, reusable_prefix, to_device
from .modeling import OrtModelForCausalLM

Ids = list[int]


def worth_sharing(rows: list[Ids], starts: list[int], costs: Costs | None = None, batch_rows: int = 0,
                  packed: bool = False) -> bool:
    """Whether rows that start alike are cheaper with their prefix run once (the prefix ending no
    later than the first position scored), then the rest of every row over copies of its KV cache
    (in one extend run where the decoder has one, else one decode step at a time), than in one
    padded prefill.

    With `costs` (`model.measured_costs()`), the two are compared in time: the prefix's prefill + the
    rows' remaining tokens in an extend with its attention over the prefix and the remainder (or
    steps x one step over the rows), against a prefill of rows x width tokens (`Costs.prefill`, with
    the attention the width adds); when groups run together in
    batches of `batch_rows` rows (lm-eval's batch size), a run's fixed cost is shared among them;
    `packed` (`packs(model)`): the remainders run several to a row of the extend (`choose_lanes`).
    Without costs, a prefix at least twice the longest remainder. Rows that do not begin with the
    same token share nothing: never (costs that make an extend cheaper than a prefill token for
    token would otherwise choose to run their "prefix" of no tokens once, which no plan can)."""
    if len(rows) < 2:
        return False
    prefix = min(common_prefix(rows), min(starts) + 1)
    if prefix < 1:
        return False
    if costs is None:
        return prefix >= 2 * max(len(row) - prefix for row in rows)
    shared, whole = _prices(rows, prefix, costs, batch_rows, packed)
    return shared < whole


def sharing_prices(rows: list[Ids], starts: list[int], costs: Costs, batch_rows: int = 0,
                   packed: bool = False) -> tuple[float, float]:
    """`worth_sharing`'s two prices, in seconds: the rows' common prefix (ending no later than the
    first position scored) run once and the rest of every row over copies of its cache, and the rows
    in one padded prefill."""
    return _prices(rows, min(common_prefix(rows), min(starts) + 1), costs, batch_rows, packed)


def packs(model: OrtModelForCausalLM) -> bool:
    """Whether `shared_prefix_logits` runs the rows' remainders several to a row of the model's extend
    run (`Extender.packs`), which `worth_sharing` prices with `packed=True`: read from the package,
    without making the extend graph where nothing may be shared."""
    return extend.takes_segments(model.decoder, extend.EXTEND_LAYOUT.get(model.device.type, "mask"))


def _prices(rows: list[Ids], prefix: int, costs: Costs, batch_rows: int, packed: bool) -> tuple[float, float]:
    steps = max(len(row) - prefix for row in rows)
    share = len(rows) / max(batch_rows, len(rows))  # of a run's fixed cost
    if costs.extend_per_token is not None:  # the rest of every row in one extend run
        lanes, width = len(rows), steps
        if packed:
            chosen = choose_lanes([len(row) - prefix for row in rows], [0] * len(rows), prefix, costs)
            lanes, width = len(chosen.owner), chosen.width
        attention = costs.extend_per_score * lanes * width * (prefix + width)  # unfused: quadratic
        run = (costs.extend_fixed or costs.step) * share
        shared = costs.prefill(1, prefix) + costs.extend_per_token * lanes * width + attention + run
    else:
        shared = costs.prefill(1, prefix) + steps * (costs.step * share + costs.step_per_row * len(rows))
    return shared, costs.prefill(len(rows), max(len(row) for row in rows))


class SharingPlan(NamedTuple):
    """How `shared_prefix_logits` runs rows whose groups share a prefix (`plan_sharing`)."""

    prefixes: list[Ids]  # each group's prefix, groups in the order of their ids
    owner: list[int]  # per row: the index of its group's prefix
    at_prefix: list[tuple[int, int]]  # (pair, prefix index): pairs answered by a prefix's last logits
    tokens: list[Ids]  # per row: the tokens after its prefix, one decode step each
    steps: list[tuple[list[int], list[int]]]  # per step: the rows asking for logits there, and their pairs


def plan_sharing(rows: list[Ids], groups: list[int], needed: list[list[int]],
                 caps: list[int] | None = None) -> SharingPlan:
    """The plan of `shared_prefix_logits`, without a model: each group's prefix is as long as its
    rows share (ending no later than the first position a row asks for, and no longer than `caps`,
    per group in the order of their ids, where given); every row continues from it one token per
    step. Pairs are numbered row by row in the order of `needed`."""
    ids_of = sorted(set(groups))
    members = {g: [r for r, h in enumerate(groups) if h == g] for g in ids_of}
    length = {}
    for k, (g, rs) in enumerate(members.items()):
        shared = common_prefix([rows[r] for r in rs])
        if shared == 0:
            raise ValueError(f"the rows of group {g} do not start with the same token")
        length[g] = min(shared, min(min(needed[r]) for r in rs) + 1, caps[k] if caps else shared)
    pair, k = {}, 0
    for r, positions in enumerate(needed):
        for position in positions:
            pair[r, position] = k
            k += 1
    index = {g: i for i, g in enumerate(ids_of)}
    starts = [length[g] for g in groups]
    at_prefix = [(pair[r, starts[r] - 1], index[groups[r]]) for r in range(len(rows)) if starts[r] - 1 in needed[r]]
    tokens = [row[start:] for row, start in zip(rows, starts)]
    steps: list[tuple[list[int], list[int]]] = [([], []) for _ in range(max(len(t) for t in tokens))]
    for r, positions in enumerate(needed):  # rows in order, so each step's rows are in order
        for position in positions:
            if position >= starts[r]:
                asking, pairs = steps[position - starts[r]]
                asking.append(r)
                pairs.append(pair[r, position])
    return SharingPlan([rows[members[g][0]][: length[g]] for g in ids_of], [index[g] for g in groups],
                       at_prefix, tokens, steps)


def shared_prefix_logits(model: OrtModelForCausalLM, rows: list[Ids], groups: list[int], needed: list[list[int]],
                         kept: KeptPrefixes | None = None):
    """Logits at chosen positions of rows whose groups share a prefix, each prefix run once.

    Rows with the same group id start with the same tokens. The groups' prefixes are prefilled in
    one batch; every row then continues from a copy of its group's KV cache: all of its remaining
    tokens in one run where the decoder has an extend graph (extend.py), else one decode step per
    remaining token, the LM head only at the rows that ask for that position (`plan_sharing`).
    Yields `(pairs, logits)` per run: `logits[k]` belongs to pair `pairs[k]` (a list on the host),
    the index of (row, position) in the row-major order of `needed`. Where the extend graph takes
    segments (`Extender.packs`), the remainders run several to a row of the run (`choose_lanes`, by
    the model's measured costs where it has them). With `kept`, prefixes that begin with those of an
    earlier call (lm-eval's few-shot examples, batch after batch) start from that call's KV instead.
    """
    plan = plan_sharing(rows, groups, needed)
    decoder, device = model.decoder, model.device
    reused = kept.match(rows, groups, needed, plan) if kept is not None else None
    if reused is not None:  # the prefixes' KV from an earlier call
        plan, picks, prefix_lengths = reused  # each prefix's part of its kept one
        source, last, width = kept.source, kept.last, kept.source.span
        picked, lengths = to_device(picks, device), to_device(prefix_lengths, device)
    else:
        ids, _ = pad_right(plan.prefixes)
        prefix_lengths = [len(prefix) for prefix in plan.prefixes]
        lengths = to_device(prefix_lengths, device)
        width = ids.shape[1]
        source = decoder.new_cache(len(plan.prefixes), width)
        picked = torch.arange(len(plan.prefixes), device=device)
        last = decoder.prefill(Rows(to_device(ids, device), None, lengths, width),
                               flat_index(width, picked, lengths - 1), source)
        if kept is not None:
            kept.keep(plan.prefixes, source, last)
    if plan.at_prefix:
        at = picked[to_device([i for _, i in plan.at_prefix], device)]
        yield [p for p, _ in plan.at_prefix], last.index_select(0, at)
    if not plan.steps:
        return
    extender = decoder.extender()
    if extender is not None:  # every row's rest in one run
        yield from _extend_run(decoder, extender, plan, (source, picked, lengths), width,
                               model.measured_costs(measure=False))
        return
    yield from _decode_steps(decoder, plan, (source, picked, lengths), prefix_lengths)


def _decode_steps(decoder, plan: SharingPlan, prefixes: tuple, prefix_lengths: list[int]):
    """`shared_prefix_logits` without an extend graph: every row's rest one decode step at a time over a
    copy of its prefix's KV (`prefixes`: the cache that holds them, per prefix its row there and its
    length; `prefix_lengths`: those lengths on the host). A step runs every row of its batch, so a row
    whose rest is shorter than the batch's longest runs padding after it: the rows go in passes
    (`decode_passes`) in which no row's positions, its padding's included, pass the context."""
    source, picked, lengths = prefixes
    device = decoder.device
    starts = [prefix_lengths[k] for k in plan.owner]
    for part in decode_passes(starts, [len(t) for t in plan.tokens], decoder.package.context_length):
        at = {row: i for i, row in enumerate(part)}
        owner = to_device([plan.owner[row] for row in part], device)
        longest, count = max(starts[row] for row in part), max(len(plan.tokens[row]) for row in part)
        cache = decoder.new_cache(len(part), max(source.span, longest + count))
        cache.start_from(source, picked[owner], lengths[owner], longest)
        tokens = to_device(pad_right([plan.tokens[row] for row in part])[0], device)
        for step, (asking, pairs) in enumerate(plan.steps[:count]):
            mine = [(at[row], pair) for row, pair in zip(asking, pairs) if row in at]
            logits = decoder.step(tokens[:, step : step + 1], cache, to_device([i for i, _ in mine] or [0], device))
            if mine:
                yield [pair for _, pair in mine], logits


def decode_passes(starts: list[int], counts: list[int], context: int) -> list[list[int]]:
    """The rows with tokens after their prefix (`counts`; `starts`: their prefixes' lengths) in passes of
    decode steps, each in row order: one pass where the longest prefix and the longest rest fit the
    `context` together, else rows by their prefixes' lengths, longest first, as many to a pass as fit
    (a row fits alone where its own prefix and rest do)."""
    rows = [row for row, count in enumerate(counts) if count]
    if not rows:
        return []
    if max(starts[row] for row in rows) + max(counts[row] for row in rows) <= context:
        return [rows]
    passes: list[list[int]] = []
    for row in sorted(rows, key=lambda row: -starts[row]):
        if passes and starts[passes[-1][0]] + max(counts[r] for r in [*passes[-1], row]) <= context:
            passes[-1].append(row)
        else:
            passes.append([row])
    return [sorted(part) for part in passes]


def _extend_run(decoder, extender, plan: SharingPlan, prefixes: tuple, width: int, costs: Costs | None):
    """`shared_prefix_logits`' extend run: the rows' remainders packed into lanes (`choose_lanes`)
    where the graph takes segments (`Extender.packs`), else one to a lane. `prefixes`: the cache that
    holds them, and per prefix its row there and its length."""
    source, picked, lengths = prefixes
    device, remainders, segments = decoder.device, [len(t) for t in plan.tokens], extender.packs
    lanes = choose_lanes(remainders, plan.owner, width, costs) if segments else pack_lanes(remainders, plan.owner, 0)
    ids = torch.zeros(len(lanes.owner), lanes.width, dtype=torch.int64)
    starts = torch.arange(lanes.width).repeat(len(lanes.owner), 1)  # padding: a segment of its own per token
    for row, tokens in enumerate(plan.tokens):
        if tokens:
            lane, at = lanes.place[row]
            ids[lane, at : at + len(tokens)] = torch.tensor(tokens, dtype=torch.int64)
            starts[lane, at : at + len(tokens)] = at
    owner = to_device(lanes.owner, device)
    cache = decoder.new_cache(len(lanes.owner), width + extender.room(lanes.width))
    cache.start_from(source, picked[owner], lengths[owner], width)
    flat = [lanes.place[row][0] * lanes.width + lanes.place[row][1] + step
            for step, (asking, _) in enumerate(plan.steps) for row in asking]
    if flat:
        pairs = [pair for _, step_pairs in plan.steps for pair in step_pairs]
        yield pairs, extender.run(to_device(ids, device), cache, to_device(flat, device),
                                  to_device(starts, device) if segments else None)


class KeptPrefixes:
    """The prefixes of `shared_prefix_logits`' last prefill, with their KV cache and last logits, kept
    for its next calls: lm-eval's 5-shot questions of one subject run in batches that all begin with
    the subject's examples, which then run once for the subject instead of once a batch."""

    def __init__(self):
        self.prefixes: list[Ids] = []
        self.source = None  # the KVCache holding them, a row each
        self.last: torch.Tensor | None = None  # their logits at their last tokens
        self.reused = 0  # calls that started from them

    def keep(self, prefixes: list[Ids], source, last: torch.Tensor) -> None:
        self.prefixes, self.source, self.last = prefixes, source, last  # a prefill's own logits: not written again

    def match(self, rows: list[Ids], groups: list[int], needed: list[list[int]], plan: SharingPlan):
        """For a call's `plan` (of `rows`, `groups`, `needed`), where every prefix starts with enough of a
        kept one (`inputs.reusable_prefix`; a hybrid's states: only a kept prefix whole): the plan with each
        prefix cut to what it shares with its kept one, per prefix the row it starts from and its length;
        else None."""
        if self.source is None:
            return None
        members = Counter(plan.owner)
        picks, caps = [], []
        for k, prefix in enumerate(plan.prefixes):
            shared = [reusable_prefix(kept, prefix, members[k]) for kept in self.prefixes]
            pick = max(range(len(shared)), key=shared.__getitem__)
            if not shared[pick] or (self.source.states and shared[pick] != len(self.prefixes[pick])):
                return None
            picks.append(pick)
            caps.append(shared[pick])
        cut = plan_sharing(rows, groups, needed, caps)
        # A prefix cut inside its kept one has no kept logits at its last token: one token shorter.
        short = {i for _, i in cut.at_prefix if caps[i] != len(self.prefixes[picks[i]])}
        if short:
            if any(caps[i] < 2 for i in short):
                return None
            caps = [cap - (i in short) for i, cap in enumerate(caps)]
            cut = plan_sharing(rows, groups, needed, caps)
        self.reused += 1
        return cut, picks, caps


class Lanes(NamedTuple):
    """Rows' remainders packed into the rows of one extend run (`pack_lanes`): each lane continues one
    prefix with several remainders one after another."""

    owner: list[int]  # per lane: the prefix it continues
    place: list[tuple[int, int]]  # per row: its lane and where its remainder begins there ((0, 0): none)
    width: int  # the fullest lane's tokens


def pack_lanes(lengths: list[int], owner: list[int], capacity: int) -> Lanes:
    """Remainders of `lengths` tokens (per row; `owner`: its prefix) in lanes of at most `capacity`
    tokens, best fit, longest first, each lane holding one prefix's rows (a remainder longer than
    `capacity` in a lane of its own, so every one at capacity 0; empty ones in none)."""
    fill: list[int] = []
    lane_owner: list[int] = []
    rooms: dict[int, list[tuple[int, int]]] = {}  # per prefix: (tokens left, lane) of its lanes with room, sorted
    place = [(0, 0)] * len(lengths)
    for row in sorted(range(len(lengths)), key=lambda r: -lengths[r]):
        need = lengths[row]
        if not need:
            continue
        mine = rooms.setdefault(owner[row], [])
        fits = bisect.bisect_left(mine, (need, -1))
        if fits < len(mine):
            room, lane = mine.pop(fits)
        else:
            room, lane = max(capacity, need), len(fill)
            fill.append(0)
            lane_owner.append(owner[row])
        place[row] = (lane, fill[lane])
        fill[lane] += need
        if room > need:
            bisect.insort(mine, (room - need, lane))
    return Lanes(lane_owner, place, max(fill, default=0))


# `choose_lanes`' capacities, as multiples of the longest remainder.
CAPACITIES = (1.25, 1.5, 2, 2.5, 3, 4, 6, 8, 12, 16)


def choose_lanes(lengths: list[int], owner: list[int], past: int, costs: Costs | None = None) -> Lanes:
    """The packing (`pack_lanes`) of the rows' remainders for one extend run over a cache of `past`
    columns, among capacities of the longest remainder and `CAPACITIES` times it. With `costs` (the
    extend's, measured), the fastest by them: lanes x width tokens and lanes x width x (`past` +
    width) attention scores. Without, the fewest tokens (fewest lanes among those) whose scores are
    no more than with a row per remainder, so that no part of the run costs more than it did: a
    question's short answers no longer each run padded to the longest."""
    longest = max(lengths)
    rows = sum(1 for n in lengths if n)
    limit = rows * longest * (past + longest)

    def price(lanes: Lanes) -> tuple:
        count, width = len(lanes.owner), lanes.width
        scores = count * width * (past + width)
        if costs is not None and costs.extend_per_token is not None:
            return (costs.extend_per_token * count * width + costs.extend_per_score * scores, count)
        return (scores > limit, count * width, count)

    best, total = pack_lanes(lengths, owner, longest), sum(lengths)
    for capacity in sorted({int(longest * factor) for factor in CAPACITIES} - {longest}):
        if capacity > total:
            break
        lanes = pack_lanes(lengths, owner, capacity)
        if price(lanes) < price(best):
            best = lanes
    return best


# The fewest tokens rows must share for `prefix_groups` to group them: a floor that keeps a few
# common tokens (a chat template's start, a BOS) from making groups; whether a group is worth
# running its prefix once is still decided per group (lm-eval's `auto`: the measured costs).
MIN_SHARED_PREFIX = 32


def prefix_groups(rows: list[Ids], limits: list[int], least: int = MIN_SHARED_PREFIX) -> list[list[int]]:
    """Indices of rows that begin with the same `least` or more tokens (a row counting only its
    first `limits[i]` tokens: the prefix ends no later than its first scored position), such as
    the five examples that every question of a 5-shot MMLU subject starts with. The rows are
    sorted, so rows that start alike are neighbours; a row joins its neighbour's group while the
    group's common prefix stays `least` tokens or more and at least half of what it was, and a
    group's first link is not much shorter than the next (a long shared part is not given up for
    a short one). Groups of one row are left out."""
    order = sorted(range(len(rows)), key=rows.__getitem__)
    links = [min(common_prefix([rows[a], rows[b]]), limits[a], limits[b]) for a, b in zip(order, order[1:])]
    groups, current, shared = [], order[:1], 0
    for k, link in enumerate(links):
        if len(current) == 1:
            joins = link >= least and (k + 1 == len(links) or 2 * link >= links[k + 1])
        else:
            joins = link >= least and 2 * link >= shared
        if joins:
            current.append(order[k + 1])
            shared = link if len(current) == 2 else min(shared, link)
            continue
        if len(current) > 1:
            groups.append(current)
        current = [order[k + 1]]
    if len(current) > 1:
        groups.append(current)
    return groups
