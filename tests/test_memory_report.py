"""``benchmarks/memory_report.py``'s reading of XLA's buffer-assignment and live-range dumps: the temp
allocation laid out by offset, and the most of it live at one position (aliased values counted once)."""

from benchmarks.memory_report import live_temp_peak, temp_layout


def _dumps(rng):
    """A random temp allocation of four values (one pair aliasing a buffer), in XLA's dump formats."""
    sizes = [int(s) for s in rng.integers(1, 1000, size=3)]
    offsets = [0, sizes[0], sizes[0] + sizes[1]]
    assignment = (
        "allocation 0: size 64, page 0, maybe-live-out:\n"
        " value: <1 out @0> (size=64,offset=0): f32[16]{0}\n"
        f"allocation 7: size {sum(sizes)}, page 0, preallocated-temp:\n"
        f" value: <2 walk{{1}} @0> (size={sizes[0]},offset={offsets[0]}): bf16[8]\n"
        f" value: <3 prep @0> (size={sizes[1]},offset={offsets[1]}): bf16[8]\n"
        f" value: <4 walk{{0}} @0> (size={sizes[1]},offset={offsets[1]}): bf16[8]\n"
        f" value: <5 grads @0> (size={sizes[2]},offset={offsets[2]}): bf16[8]\n")
    live_range = ("HloLiveRange (max 9):\n  BufferLiveRange:\n    walk{1}:2-6\n    prep{}:1-2\n    walk{0}:2-6\n"
                  "    grads{}:6-9\n    out{}:0-9\n")
    return assignment, live_range, sizes, offsets


def test_temp_layout_and_its_live_peak(rng):
    assignment, live_range, sizes, offsets = _dumps(rng)
    size, rows = temp_layout(assignment, live_range)
    assert size == sum(sizes)
    assert [r[4] for r in rows] == ["walk{1}", "prep{}", "walk{0}", "grads{}"]
    assert [(r[0], r[1], r[2], r[3]) for r in rows] == [
        (offsets[0], sizes[0], 2, 6), (offsets[1], sizes[1], 1, 2), (offsets[1], sizes[1], 2, 6),
        (offsets[2], sizes[2], 6, 9)]
    # position 6 holds all three buffers (ends included); at 2 the aliased pair counts once
    assert live_temp_peak(rows) == (sum(sizes), 6)
    rows_without_grads = [r for r in rows if r[4] != "grads{}"]
    assert live_temp_peak(rows_without_grads) == (sizes[0] + sizes[1], 2)
