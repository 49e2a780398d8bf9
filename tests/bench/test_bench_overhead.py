"""The overhead bench's statistics (the runs themselves are `nemo-dcr bench overhead`)."""

from nemo_dcr_callback.bench.overhead import _blocks, _bootstrap


def test_blocks_pair_each_off_block_with_the_on_block_after_it():
    # row s times batch s - 1; batches in even blocks of 4 publish (10 ms dearer)
    by_step = {s: 100.0 + (10.0 if ((s - 1) // 4) % 2 == 0 else 0.0) + (s - 1) % 4 for s in range(1, 33)}
    pairs = _blocks(by_step, 4, skip=2)
    assert len(pairs) == 3  # blocks (1, 2), (3, 4), (5, 6); block 0 is start-up, block 7 has no "on" after it
    for p in pairs:  # the first two batches of every block are left out
        assert p[True] == [112.0, 113.0] and p[False] == [102.0, 103.0]


def test_bootstrap_interval_holds_the_true_overhead_and_narrows_with_data():
    import random

    rng = random.Random(3)

    def pairs(n):
        return [{True: [105 + rng.gauss(0, 5) for _ in range(20)], False: [100 + rng.gauss(0, 5) for _ in range(20)]}
                for _ in range(n)]

    lo4, hi4 = _bootstrap(pairs(4))
    lo40, hi40 = _bootstrap(pairs(40))
    assert lo4 < 0.05 < hi4 and lo40 < 0.05 < hi40
    assert hi40 - lo40 < hi4 - lo4


def test_alternate_refuses_blocks_and_runs_too_short_before_training():
    import pytest

    from nemo_dcr_callback.bench.overhead import run

    for kw, msg in (({"alternate": 2}, "at least 3 steps"), ({"alternate": -1}, "block length"),
                    ({"alternate": 6, "steps": 12}, "at least 18 steps")):
        with pytest.raises(ValueError, match=msg):
            run(**kw)
