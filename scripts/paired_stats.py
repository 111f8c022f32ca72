"""Paired comparisons over seeds without scipy: Student's t (cdf and quantiles), paired t intervals, Holm's
correction, the exact Wilcoxon signed-rank test and the smallest effect a paired t test detects.

Used by ``scripts/credit_report.py``. Every function takes plain lists of floats.
"""

from __future__ import annotations

import itertools
import math
import statistics
from typing import Optional


def _betacf(a: float, b: float, x: float) -> float:
    """The continued fraction of the regularized incomplete beta function (modified Lentz)."""
    tiny, c, d = 1e-300, 1.0, 1.0 - (a + b) * x / (a + 1.0)
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 500):
        for num in (m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m)),
                    -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1))):
            d = 1.0 + num * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + num / c
            c = c if abs(c) > tiny else tiny
            h *= d * c
        if abs(d * c - 1.0) < 1e-15:
            break
    return h


def betainc(a: float, b: float, x: float) -> float:
    """I_x(a, b), the regularized incomplete beta function, for x in [0, 1]."""
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    front = math.exp(math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x))
    if x < (a + 1.0) / (a + b + 2.0):
        return front * _betacf(a, b, x) / a
    return 1.0 - front * _betacf(b, a, 1.0 - x) / b


def t_cdf(t: float, df: float) -> float:
    """P(T <= t) for Student's t with ``df`` degrees of freedom."""
    tail = 0.5 * betainc(df / 2.0, 0.5, df / (df + t * t))
    return 1.0 - tail if t > 0 else tail


def t_ppf(p: float, df: float) -> float:
    """The ``p`` quantile of Student's t (bisection on :func:`t_cdf`)."""
    if not 0.0 < p < 1.0:
        raise ValueError(f"p must be in (0, 1), got {p}")
    lo, hi = -1e4, 1e4
    for _ in range(200):
        mid = (lo + hi) / 2.0
        lo, hi = (mid, hi) if t_cdf(mid, df) < p else (lo, mid)
    return (lo + hi) / 2.0


def paired_t(diffs: list[float], level: float = 0.95) -> dict:
    """Mean of paired differences, its two-sided ``level`` t interval and the two-sided p of mean 0."""
    n = len(diffs)
    if n < 2:
        raise ValueError("a paired t test needs 2 or more differences")
    mean, sd = statistics.fmean(diffs), statistics.stdev(diffs)
    se = sd / math.sqrt(n)
    half = t_ppf(0.5 + level / 2.0, n - 1) * se
    p = 1.0 if se == 0 and mean == 0 else 0.0 if se == 0 else 2.0 * (1.0 - t_cdf(abs(mean) / se, n - 1))
    return {"n": n, "mean": mean, "sd": sd, "low": mean - half, "high": mean + half, "p": p, "level": level}


def holm(p_values: list[float], alpha: float = 0.05) -> tuple[list[float], list[float]]:
    """Holm's step-down correction: the adjusted p-values, and each test's level, in the order given. The test
    of rank r (0: the smallest p) is at alpha / (m - r) only when every test before it was rejected at its own
    level; from the first one not rejected on, every test stays at that one's level (the step-down stops)."""
    m = len(p_values)
    order = sorted(range(m), key=lambda k: p_values[k])
    adjusted, levels, running, stopped = [0.0] * m, [0.0] * m, 0.0, None
    for rank, k in enumerate(order):
        running = max(running, min(1.0, (m - rank) * p_values[k]))
        level = alpha / (m - rank) if stopped is None else stopped
        if stopped is None and p_values[k] > level:
            stopped = level
        adjusted[k], levels[k] = running, level
    return adjusted, levels


def wilcoxon_exact(diffs: list[float]) -> Optional[float]:
    """The exact two-sided p of Wilcoxon's signed-rank test: zeros dropped, tied magnitudes given their mean rank,
    every sign assignment enumerated (n <= 20); None without a nonzero difference."""
    values = [round(d, 12) for d in diffs]  # (means of the same evaluations: equal differences may differ in the
    values = [d for d in values if d != 0]  # last bits of a float, and would be ranked apart)
    n = len(values)
    if not n:
        return None
    if n > 20:
        raise ValueError("the exact enumeration is for 20 differences or fewer")
    order = sorted(range(n), key=lambda k: abs(values[k]))
    ranks = [0.0] * n
    start = 0
    while start < n:
        end = start
        while end + 1 < n and abs(values[order[end + 1]]) == abs(values[order[start]]):
            end += 1
        for k in order[start:end + 1]:
            ranks[k] = (start + end) / 2.0 + 1.0
        start = end + 1
    observed = sum(r for r, v in zip(ranks, values) if v > 0)
    centre = sum(ranks) / 2.0
    extreme = abs(observed - centre) - 1e-9
    hits = sum(abs(sum(r for r, s in zip(ranks, signs) if s) - centre) >= extreme
               for signs in itertools.product((0, 1), repeat=n))
    return hits / 2 ** n


def normal_cdf(x: float) -> float:
    return 0.5 * math.erfc(-x / math.sqrt(2.0))


def paired_t_power(effect: float, n: int, alpha: float, points: int = 2000) -> float:
    """The power of a two-sided paired t test at ``alpha`` over ``n`` pairs when the true mean difference is
    ``effect`` standard deviations of the differences: P(|T| > t_crit) for T noncentral t with n - 1 degrees of
    freedom and noncentrality effect * sqrt(n), integrated over the chi-square of the variance (Simpson's rule)."""
    df, delta = n - 1, effect * math.sqrt(n)
    crit = t_ppf(1.0 - alpha / 2.0, df)
    top = df + 40.0 * math.sqrt(2.0 * df) + 40.0
    h = top / points
    log_norm = -(df / 2.0) * math.log(2.0) - math.lgamma(df / 2.0)

    def integrand(v: float) -> float:
        if v <= 0.0:
            return 0.0
        density = math.exp(log_norm + (df / 2.0 - 1.0) * math.log(v) - v / 2.0)
        s = math.sqrt(v / df)
        return density * (1.0 - normal_cdf(crit * s - delta) + normal_cdf(-crit * s - delta))

    total = integrand(0.0) + integrand(top)
    total += sum((4.0 if k % 2 else 2.0) * integrand(k * h) for k in range(1, points))
    return total * h / 3.0


def detectable_effect(sd: float, n: int, alpha: float, power: float = 0.8) -> float:
    """The paired mean difference a two-sided paired t test at ``alpha`` detects with ``power`` over ``n`` pairs
    whose differences spread by ``sd``: the effect whose noncentral-t power (:func:`paired_t_power`) is
    ``power``, found by bisection, times ``sd``."""
    lo, hi = 0.0, 50.0
    for _ in range(60):
        mid = (lo + hi) / 2.0
        lo, hi = (mid, hi) if paired_t_power(mid, n, alpha) < power else (lo, mid)
    return (lo + hi) / 2.0 * sd
