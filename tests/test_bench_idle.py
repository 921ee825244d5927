"""The training benchmark's device-idle attribution (lm.benchmarks.train.idle_gaps / attribute_gaps): which host
code runs while the device waits, from a profiler timeline."""
from lm.benchmarks.train import attribute_gaps, idle_gaps


def test_idle_gaps_merge_streams_and_skip_launch_spacing():
    # two streams overlap (0-10, 5-30); 30->31 is launch spacing; 40->100 and 120->200 are idle
    dev = [(5, 30), (0, 10), (31, 40), (100, 120), (200, 210)]
    assert idle_gaps(dev, min_gap_us=5) == [(40, 100), (120, 200)]
    assert idle_gaps([], min_gap_us=5) == []


def test_attribute_gaps_charges_self_time_inside_gaps():
    gaps = [(40, 100), (120, 200)]
    host = [
        ("step", 0, 300, [(45, 95), (130, 190)]),  # parent: its children cover most of the gaps
        ("optimizer", 45, 95, [(50, 60)]),
        ("item", 50, 60, []),                       # a device read inside the optimizer
        ("hooks", 130, 190, []),
        ("forward", 0, 40, []),                     # before the first gap: not charged
    ]
    by = attribute_gaps(gaps, host)
    assert by == {"step": (60 + 80) - (50 + 60), "optimizer": 50 - 10, "item": 10, "hooks": 60}
    # the charged self times add up to the idle time the host events cover
    assert sum(by.values()) == sum(e - s for s, e in gaps)
