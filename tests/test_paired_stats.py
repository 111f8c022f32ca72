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


def test_holm_adjusts_and_levels_by_rank_and_stops_at_the_first_test_it_keeps():
    adjusted, levels = stats.holm([0.01, 0.04, 0.03])
    assert adjusted == pytest.approx([0.03, 0.06, 0.06])  # 3 x 0.01; 2 x 0.03; max(0.06, 1 x 0.04)
    # 0.01 <= 0.05/3: rejected; 0.03 > 0.05/2: kept, so 0.04 stays at 0.025 (not 0.05)
    assert levels == pytest.approx([0.05 / 3, 0.025, 0.025])
    _, levels = stats.holm([0.001, 0.004, 0.03])  # all rejected in turn: 0.05/3, 0.05/2, 0.05
    assert levels == pytest.approx([0.05 / 3, 0.025, 0.05])
    _, levels = stats.holm([0.3, 0.3, 0.3])  # the first kept: every test at 0.05/3, whatever the order
    assert levels == pytest.approx([0.05 / 3] * 3)


def test_the_exact_signed_rank_test_by_enumeration():
    assert stats.wilcoxon_exact([1.0, 2.0, 3.0]) == 0.25  # all 3 positive: 2 of 8 sign patterns as extreme
    assert stats.wilcoxon_exact([1.0, 2.0, 3.0, 4.0, 5.0]) == 2 / 32
    assert stats.wilcoxon_exact([1.0, -2.0, 3.0]) == 0.75  # W+ 4: subsets of {1,2,3} summing 0,1,2,4,5,6
    assert stats.wilcoxon_exact([1.0, -1.0, 2.0]) == 0.75  # ranks 1.5, 1.5, 3
    assert stats.wilcoxon_exact([0.0, 2.0, 3.0, 0.0]) == 0.5  # zeros dropped: 2 of 4
    assert stats.wilcoxon_exact([0.0]) is None
    # mid-ranks: |d| 1, 2, 2 -> ranks 1, 2.5, 2.5; W+ = 2.5 + 2.5 = 5 against the centre 3; as extreme: the sums
    # 0 (W- all) and 1 of {0, 1, 2.5, 2.5, 3.5, 3.5, 5, 6}, and 5, 6: 4 of 8 (ranks 2 and 3 would give 3 of 8)
    assert stats.wilcoxon_exact([-1.0, 2.0, 2.0]) == 0.5
    # equal differences that a float's last bits tell apart are ties, and such a zero is dropped
    assert stats.wilcoxon_exact([-1.0, 0.1 + 0.2, 0.3]) == stats.wilcoxon_exact([-1.0, 0.3, 0.3])
    assert stats.wilcoxon_exact([0.1 + 0.2 - 0.3, 1.0]) == 1.0


def test_the_detectable_effect_at_80_percent_power():
    assert stats.paired_t_power(0.0, 10, 0.05) == pytest.approx(0.05, abs=1e-6)  # no effect: the test's level
    # Cohen's and G*Power's one-sample t: n = 10, two-sided 0.05, 80% power at d = 0.994
    assert stats.detectable_effect(1.0, 10, 0.05) == pytest.approx(0.994, abs=0.003)
    assert stats.detectable_effect(0.03, 10, 0.05) == pytest.approx(0.03 * 0.994, abs=1e-4)
    # against simulation: 20,000 seeded sets of 10 normal differences at the effect found for 0.05/3
    import random
    import statistics

    rng, n, effect = random.Random(0), 10, stats.detectable_effect(1.0, 10, 0.05 / 3)
    crit = stats.t_ppf(1 - 0.05 / 6, n - 1)
    hits = 0
    for _ in range(20000):
        d = [rng.gauss(effect, 1.0) for _ in range(n)]
        hits += abs(statistics.fmean(d) / (statistics.stdev(d) / math.sqrt(n))) > crit
    assert abs(hits / 20000 - 0.8) < 0.012  # 4 standard errors
    # the shortcut (t_{1-a/2} + t_power) sd / sqrt(n) falls short of 80% power
    assert (2.933 + 0.8834) / math.sqrt(10) < effect
