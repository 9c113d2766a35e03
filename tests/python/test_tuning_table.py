"""The tuning table and its verdict (CPU tier: pure formatting and comparison of report rows)."""

import math

from kfuse.tuning_table import format_tuning_table, tuning_verdict


def row(default, cudnn, tuned, spread, choice="sm90_128x64", cached=False):
    return {"op": "conv2d_fprop_fixup", "shape": "n128_h16_w16_c64_k64_r3_s3_p1_u1", "default_ms": default,
            "cudnn_ms": cudnn, "tuned_ms": tuned, "spread_ms": spread, "choice": choice, "from_cache": cached}


def test_table_shows_cudnn_column_and_dashes_for_unknown():
    # The binding reports unknown times as None (cuDNN absent, cached rows); NaN is accepted too.
    text = format_tuning_table([row(0.020, 0.030, 0.015, 0.001), row(0.020, None, 0.020, None, cached=True),
                                row(0.020, math.nan, 0.020, 0.0)])
    lines = text.splitlines()
    assert "cudnn us" in lines[0]
    assert "30.0" in lines[1] and "15.0" in lines[1]
    assert " - " in lines[2] and "(cached)" in lines[2]
    assert " - " in lines[3]


def test_verdict_accepts_choices_within_spread_and_names_the_slow_ones():
    ok = [row(0.020, 0.030, 0.015, 0.001), row(0.020, 0.0199, 0.0200, 0.0005), row(0.02, None, 0.02, None)]
    verdict = tuning_verdict(ok)
    assert "never slower than either" in verdict
    assert "3 ops timed (2 with cuDNN" in verdict
    assert "vs default 1.00-1.33x" in verdict and "vs cuDNN's best 0.99-2.00x" in verdict
    bad = ok + [row(0.020, 0.010, 0.015, 0.001, choice="sm80_64x64_k1")]
    verdict = tuning_verdict(bad)
    assert "1 slower" in verdict and "cudnn 10.0 us" in verdict
    # cached rows were not timed in this run: they are not judged
    assert "0 ops timed" in tuning_verdict([row(0.02, 0.01, 0.03, 0.0, cached=True)])
