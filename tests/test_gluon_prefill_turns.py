"""The Gluon prefill's barrier protocol as a model: no deadlock, no wrong phase, turns in alternation.

prefill_gluon.py.jinja's program (the producer warp and the two consumer warpgroups) transcribed into the
mbarrier waits and arrivals each partition makes, in its order, for a drawn (seqlen_q, seqlen_k, m0, causal,
BLOCK_N, STAGES, PINGPONG); a scheduler runs them in many interleavings (random, and each partition run as far
as it can before the others), TMA landings arriving at any later time. Checked: every interleaving ends (a state
where no partition can move before all are done is a deadlock); each wait passes on the phase it means (a ready
barrier has completed exactly the phases of the blocks up to the one waited for: a stage never holds a later
block than the one a consumer reads; a turn barrier exactly the other warpgroup's hand-overs so far); and where
the warpgroups take turns, their MMA issues alternate 0, 1, 0, 1, ... A change to the kernel's protocol must be
made here too (the model is the kernel's order of waits and arrivals, nothing more: MMAs complete when waited
for, as nothing else gates them).
"""

import random

import pytest

from mlagen_compiler.plan import GLUON_PREFILL_BLOCK_NS, GLUON_PREFILL_MAX_STAGES, GLUON_PREFILL_WARPGROUP_ROWS

ROWS = GLUON_PREFILL_WARPGROUP_ROWS


class Barrier:
    """An mbarrier: `count` arrivals complete a phase; a wait on parity p passes once the phase of parity p has
    completed, i.e. while the completed phases' count has the other parity (a fresh one passes parity 1)."""

    def __init__(self, count):
        self.count, self.pending, self.completed = count, 0, 0

    def arrive(self):
        self.pending += 1
        if self.pending == self.count:
            self.pending, self.completed = 0, self.completed + 1

    def passes(self, parity):
        return self.completed % 2 != parity


def blocks(row0, seqlen_q, seqlen_k, block_n, causal):
    """_gluon_prefill_blocks: (n_full, n_mine) of the warpgroup whose rows start at row0."""
    if causal:
        n_full = min(row0 // block_n, seqlen_k // block_n)
        n_mine = -(-min(row0 + ROWS, seqlen_k) // block_n)
    else:
        n_full, n_mine = seqlen_k // block_n, -(-seqlen_k // block_n)
    n_mine = n_mine if row0 < seqlen_q else 0
    return min(n_full, n_mine), n_mine


def consumer_ops(wg, m0, seqlen_q, seqlen_k, n_blocks, block_n, stages, causal, pingpong):
    """_gluon_prefill_consumer's waits and arrivals in order: ("wait", barrier, parity, expected completions) and
    ("arrive", barrier), ("issue", turn) where it issues a turn's MMAs."""
    n_mine = blocks(m0 + wg * ROWS, seqlen_q, seqlen_k, block_n, causal)[1]
    taking = pingpong and n_mine == blocks(m0 + (1 - wg) * ROWS, seqlen_q, seqlen_k, block_n, causal)[1]
    ops = [("wait", "q_ready", 0, 1)]

    def ready(name, blk):  # the stage's ready barrier has completed block blk's landing, no later one
        return ("wait", (name, blk % stages), (blk // stages) & 1, blk // stages + 1)

    def turn(t):  # warpgroup wg's turn t: the other has handed over t (wg 0) or t + 1 (wg 1) times
        return [("wait", ("turns", wg), (t + 1 - wg) & 1, t + wg)] if taking else []

    hand_over = [("arrive", ("turns", 1 - wg))] if taking else []
    if n_mine > 0:
        ops += [ready("k_ready", 0), *turn(0), ("issue", 0), *hand_over, ("arrive", ("k_free", 0))]
    for blk in range(1, n_mine):
        ops += [ready("k_ready", blk), *turn(blk), ("issue", blk), ready("v_ready", blk - 1), *hand_over]
        ops += [("arrive", ("k_free", blk % stages)), ("arrive", ("v_free", (blk - 1) % stages))]
    if n_mine > 0:
        last = n_mine - 1
        ops += [ready("v_ready", last), *turn(n_mine), ("issue", n_mine), *hand_over]
        ops += [("arrive", ("v_free", last % stages))]
    for blk in range(n_mine, n_blocks):
        ops += [ready("k_ready", blk), ("arrive", ("k_free", blk % stages))]
        ops += [ready("v_ready", blk), ("arrive", ("v_free", blk % stages))]
    return ops, taking, n_mine


def producer_ops(n_blocks, stages):
    """_gluon_prefill_producer's: ("land", barrier) is a TMA copy whose completion arrives later."""
    ops = [("land", "q_ready")]
    for blk in range(n_blocks):
        stage, free_phase = blk % stages, ((blk // stages) & 1) ^ 1
        ops += [("wait", ("k_free", stage), free_phase, None), ("land", ("k_ready", stage))]
        ops += [("wait", ("v_free", stage), free_phase, None), ("land", ("v_ready", stage))]
    return ops


def run(case, rng=None, first=None):
    """Run the program's partitions to their end under one interleaving (rng: random choices; first: the
    partition that moves whenever it can); returns the warpgroups' issued turns in order. A deadlock or a wait
    passing on the wrong phase fails."""
    seqlen_q, seqlen_k, m0, causal, block_n, stages, pingpong = case
    n_blocks = -(-(min(m0 + 2 * ROWS, seqlen_k) if causal else seqlen_k) // block_n)
    barriers = {"q_ready": Barrier(1), ("turns", 0): Barrier(1), ("turns", 1): Barrier(1)}
    for s in range(stages):
        barriers.update({("k_ready", s): Barrier(1), ("v_ready", s): Barrier(1)})
        barriers.update({("k_free", s): Barrier(2), ("v_free", s): Barrier(2)})
    programs = {"producer": producer_ops(n_blocks, stages)}
    taking = []
    for wg in (0, 1):
        programs[wg], takes, _ = consumer_ops(wg, m0, seqlen_q, seqlen_k, n_blocks, block_n, stages, causal, pingpong)
        taking.append(takes)
    assert taking[0] == taking[1], "the warpgroups disagree on taking turns"
    at = dict.fromkeys(programs, 0)
    landing = []  # TMA copies issued, not yet arrived
    issued = []
    while True:
        movable = [p for p in programs if at[p] < len(programs[p]) and _can_move(programs[p][at[p]], barriers)]
        choices = movable + [("landing", i) for i in range(len(landing))]
        if not choices:
            stuck = {p: programs[p][at[p]] for p in programs if at[p] < len(programs[p])}
            assert not stuck, f"deadlock in {case}: {stuck}"
            return issued, taking[0]
        pick = first if first in movable else (rng.choice(choices) if rng else choices[0])
        if isinstance(pick, tuple):
            barriers[landing.pop(pick[1])].arrive()
            continue
        op = programs[pick][at[pick]]
        at[pick] += 1
        if op[0] == "wait" and op[3] is not None:
            assert barriers[op[1]].completed == op[3], f"{pick} passed {op} on the wrong phase in {case}"
        elif op[0] == "arrive":
            barriers[op[1]].arrive()
        elif op[0] == "land":
            landing.append(op[1])
        elif op[0] == "issue":
            issued.append((pick, op[1]))


def _can_move(op, barriers):
    return op[0] != "wait" or barriers[op[1]].passes(op[2])


def cases():
    """(seqlen_q, seqlen_k, m0, causal, block_n, stages, pingpong): ragged and whole row blocks, both halves or
    only the first holding rows, key counts about the block sizes, empty prefixes, every block size and depth."""
    lengths = (1, 63, 64, 65, 127, 128, 129, 191, 192, 200, 256, 300, 385)
    prefixes = (0, 1, 63, 64, 100, 128, 129, 256, 300)
    for block_n in GLUON_PREFILL_BLOCK_NS:
        for stages in range(2, GLUON_PREFILL_MAX_STAGES + 1):
            for pingpong in (False, True):
                for seqlen_q in lengths:
                    for m0 in range(0, seqlen_q, 2 * ROWS):
                        yield (seqlen_q, seqlen_q, m0, True, block_n, stages, pingpong)
                        for seqlen_k in prefixes:
                            yield (seqlen_q, seqlen_k, m0, False, block_n, stages, pingpong)


CASES = list(cases())


@pytest.mark.parametrize("block_n", GLUON_PREFILL_BLOCK_NS)
def test_no_interleaving_deadlocks_or_reads_a_wrong_phase(block_n):
    rng = random.Random(43)
    for case in (c for c in CASES if c[4] == block_n):
        for first in ("producer", 0, 1):
            run(case, first=first)
        run(case)
        for _ in range(6):
            run(case, rng=rng)


def test_the_warpgroups_alternate_where_they_take_turns():
    rng = random.Random(7)
    took = 0
    for case in (c for c in CASES if c[6]):
        for schedule in ({"first": 0}, {"first": 1}, {"first": "producer"}, {"rng": rng}):
            issued, taking = run(case, **schedule)
            if not taking:
                continue
            took += 1
            # turns 0 .. n_mine of each, warpgroup 0's turn t before warpgroup 1's turn t before 0's turn t + 1
            n_turns = len(issued) // 2
            assert issued == [(wg, t) for t in range(n_turns) for wg in (0, 1)], case
    assert took > 0


def test_turns_are_taken_exactly_where_both_warpgroups_have_the_same_blocks():
    # 128-key blocks of a whole causal row block: both warpgroups' last block is the diagonal one
    assert consumer_ops(0, 128, 256, 256, 2, 128, 2, True, True)[1:] == (True, 2)
    # 64-key blocks: warpgroup 0 stops a block before warpgroup 1 (free running)
    assert consumer_ops(0, 128, 256, 256, 4, 64, 2, True, True)[1:] == (False, 3)
    # the second half past the sequence's end: free running; non-causal, both halves: turns
    assert not consumer_ops(0, 0, 64, 64, 1, 128, 2, True, True)[1]
    assert consumer_ops(1, 0, 65, 300, 3, 64, 3, False, True)[1:] == (True, 5)
    # PINGPONG off: never
    assert not consumer_ops(0, 128, 256, 256, 2, 128, 2, True, False)[1]
