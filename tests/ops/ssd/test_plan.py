"""The host plan of an advance (``ops/ssd/plan.py``): the tables the Triton kernels trust.

The scan reads a chunk's x and B where they lie (the packed new rows) unless the chunk starts in
a slot's buffer, in which case it reads the chunk's whole copy (``plan.part``). These properties
are what makes that safe: a chunk read in place covers only its own sequence's new rows, and the
copies are exactly the chunks with buffered rows, numbered in order.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from aligned_mamba.ops.ssd.plan import plan_advance, to_device

L, R = 32, 16


@st.composite
def batches(draw):
    S = draw(st.integers(1, 6))
    lens = draw(st.lists(st.integers(1, 3 * L + 5), min_size=S, max_size=S))
    offs = draw(st.lists(st.integers(0, L - 1), min_size=S, max_size=S))
    final = draw(st.sampled_from(["boundary", "end"]))
    return np.array(lens), np.array(offs), final


@settings(max_examples=80, deadline=None)
@given(batches())
def test_chunks_read_in_place_stay_inside_their_sequence(batch) -> None:
    lens, offs, final = batch
    plan = plan_advance(lens, offs, L, R, final=final)
    cu = np.concatenate([[0], np.cumsum(lens)])
    copied = plan.pre > 0
    assert plan.num_parts == int(copied.sum())
    assert (plan.part[copied] == np.arange(plan.num_parts)).all()  # numbered in chunk order
    assert (plan.part[~copied] == -1).all()
    for c in np.flatnonzero(~copied):  # read in place: positions 0 .. length-1 are rows row0 + s
        q = plan.seq[c]
        first, last = plan.row0[c], plan.row0[c] + plan.length[c] - 1
        assert cu[q] <= first and last < cu[q + 1], (c, q, first, last, cu)
    for c in np.flatnonzero(copied):  # only a sequence's first chunk starts in its buffer
        assert plan.index[c] == 0 and plan.pre[c] == offs[plan.seq[c]]


def test_the_device_plan_keeps_the_copies() -> None:
    plan = plan_advance(np.array([5, 40, 7]), np.array([3, 0, 31]), L, R)
    dev = to_device(plan, "cpu")
    assert dev.num_parts == plan.num_parts == 2
    assert dev.part.tolist() == plan.part.tolist() == [0, -1, -1, 1, -1]


@settings(max_examples=80, deadline=None)
@given(batches())
def test_buffer_rewrite_keeps_rows_past_the_fill_level_zero(batch) -> None:
    """Apply the plan's buffer writes to a model of each slot's buffer (old rows 1, rows past the
    old fill level 0): afterwards exactly the new fill level's rows hold data, every row past it
    is zero, and a buffer whose chunk completed keeps none of its old rows (leaving its old rows
    past keep_hi in place fails)."""
    lens, offs, _ = batch
    plan = plan_advance(lens, offs, L, R)
    for q in range(lens.shape[0]):
        buf = np.where(np.arange(L) < offs[q], 1, 0)
        lo, hi, clear = plan.keep_lo[q], plan.keep_hi[q], plan.clear_hi[q]
        assert 0 <= lo <= hi <= clear <= L
        buf[lo:hi] = 2
        buf[hi:clear] = 0
        fill = (offs[q] + lens[q]) % L
        assert (buf[:fill] != 0).all() and (buf[fill:] == 0).all(), (q, buf, fill)
        if offs[q] + lens[q] >= L:
            assert (buf != 1).all()


@pytest.mark.parametrize(("lens", "offs", "slots", "match"), [
    ([-1, 3], [0, 0], None, "lens >= 0"),
    ([3], [L], None, "off < chunk_size"),
    ([3], [-1], None, "off < chunk_size"),
    ([2, 3], [0], None, r"\[S\] each"),
    ([2, 3], [0, 1], [0], "slots must be"),
])
def test_a_bad_batch_is_refused(lens, offs, slots, match) -> None:
    """The kernels index memory with these tables unchecked: a batch they cannot describe is refused."""
    with pytest.raises(ValueError, match=match):
        plan_advance(np.array(lens), np.array(offs), L, R, slots=None if slots is None else np.array(slots))
