"""scripts/paired_stats.py against closed forms, published t quantiles and enumerations done by hand."""

import math

import pytest

from tests.helpers import load_script

stats = load_script("paired_stats")


def test_t_cdf_matches_the_closed_forms_of_one_and_two_degrees_of_freedom():
    for t in (-3.0, -0.4, 0.0, 1.0, 2.5):
        assert stats.t_cdf(t, 1) == pytest.approx(0.5 + math.atan(t) / math.pi, abs=1e-10)  # Cauchy
        assert stats.t_cdf(t, 2) == pytest.approx(0.5 + t / (2 * math.sqrt(2 + t * t)), abs=1e-10)


def test_t_quantiles_match_the_published_table():
    table = load_script("replication_report").T95  # two-sided 95%, df 1..9, from printed tables
    for df, value in table.items():
        assert stats.t_ppf(0.975, df) == pytest.approx(value, abs=1e-3)
    assert stats.t_ppf(0.8, 9) == pytest.approx(0.8834, abs=1e-4)
    assert stats.t_ppf(1 - 0.05 / 6, 9) == pytest.approx(2.933, abs=1e-3)  # Holm's strictest of 3, two-sided


def test_the_paired_t_interval_of_1_2_3_by_hand():
    out = stats.paired_t([1.0, 2.0, 3.0])
    half = 4.3027 / math.sqrt(3)  # sd 1, t_{0.975, 2}
    assert out["mean"] == 2.0 and out["sd"] == 1.0
    assert out["low"] == pytest.approx(2 - half, abs=1e-3) and out["high"] == pytest.approx(2 + half, abs=1e-3)
    # t = 2 / (1 / sqrt 3) = 2 sqrt 3; df 2: p = 1 - 2 sqrt3 / sqrt(2 + 12) (closed form)
    assert out["p"] == pytest.approx(1 - 2 * math.sqrt(3) / math.sqrt(14), abs=1e-9)


def test_holm_adjusts_and_levels_by_rank():
    adjusted, levels = stats.holm([0.01, 0.04, 0.03])
    assert adjusted == pytest.approx([0.03, 0.06, 0.06])  # 3 x 0.01; 2 x 0.03; max(0.06, 1 x 0.04)
    assert levels == pytest.approx([0.05 / 3, 0.05, 0.025])


def test_the_exact_signed_rank_test_by_enumeration():
    assert stats.wilcoxon_exact([1.0, 2.0, 3.0]) == 0.25  # all 3 positive: 2 of 8 sign patterns as extreme
    assert stats.wilcoxon_exact([1.0, 2.0, 3.0, 4.0, 5.0]) == 2 / 32
    assert stats.wilcoxon_exact([1.0, -2.0, 3.0]) == 0.75  # W+ 4: subsets of {1,2,3} summing 0,1,2,4,5,6
    assert stats.wilcoxon_exact([1.0, -1.0, 2.0]) == 0.75  # ranks 1.5, 1.5, 3
    assert stats.wilcoxon_exact([0.0, 2.0, 3.0, 0.0]) == 0.5  # zeros dropped: 2 of 4
    assert stats.wilcoxon_exact([0.0]) is None


def test_the_detectable_effect_at_80_percent_power():
    # (t_{0.975,9} + t_{0.8,9}) / sqrt(10) = (2.2622 + 0.8834) / 3.1623
    assert stats.detectable_effect(1.0, 10, 0.05) == pytest.approx(0.9947, abs=1e-3)
    assert stats.detectable_effect(0.03, 10, 0.05 / 3) == pytest.approx((2.933 + 0.8834) * 0.03 / math.sqrt(10),
                                                                        abs=1e-4)
