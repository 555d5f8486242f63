"""The statistics of the package, pure functions: intervals of an accuracy over problems (Wilson,
:func:`accuracy_interval`), of a mean over tasks (:func:`macro_interval`) and over seeds
(:func:`seed_interval`, :func:`welch_interval` with Student's t, :func:`t_quantile_975`), pass@k
(:func:`pass_at_k`), Spearman's rank correlation (:func:`spearman`) and a critic's explained
variance (:func:`explained_variance`).

Used by the evaluation (:mod:`marft.run.evaluation`) and the reports (:mod:`marft.experiments.report`).
Imports only math, statistics and torch.
"""
from __future__ import annotations

import math
import statistics

import torch


def wilson_interval(successes: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """95% Wilson score interval of a binomial proportion: ``successes`` of ``n``, p = successes / n,
    the interval of :func:`_wilson` at n; ``(0, 1)`` for n = 0."""
    if n == 0:
        return 0.0, 1.0
    return _wilson(successes / n, n, z)


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k (Chen et al. 2021) of one problem with n samples of which c are correct:
    1 - C(n-c, k) / C(n, k), the chance that at least one of k samples drawn without replacement is."""
    if k > n:
        raise ValueError(f"pass@{k} needs at least {k} samples per problem, got {n}")
    if n - c < k:
        return 1.0
    return 1.0 - math.prod((n - c - i) / (n - i) for i in range(k))


def accuracy_interval(success: torch.Tensor, z: float = 1.96) -> tuple[float, float, float]:
    """Mean accuracy and 95% interval from a [problems, samples] table of 0/1 (or per-sample scores).

    One sample per problem: Wilson interval. Several: the problems are the independent units. The
    standard error of the per-problem means gives an effective sample size, n_eff = p(1 - p) / se^2
    (the number of independent 0/1 draws with the same standard error, at most problems x samples),
    and the interval is Wilson's at n_eff. Where the per-problem means carry no spread to estimate it
    from (all 0 or all 1), n_eff is the number of problems. Unlike mean +- z se, the interval is never
    a single point and stays inside [0, 1]."""
    n, k = success.shape
    mean = float(success.float().mean())
    if k == 1:
        lo, hi = wilson_interval(int(success.sum()), n, z)
        return mean, lo, hi
    se = float(success.float().mean(1).std(unbiased=True)) / math.sqrt(n) if n > 1 else 0.0
    n_eff = min(mean * (1 - mean) / se**2, n * k) if se > 0 and 0 < mean < 1 else float(n)
    lo, hi = _wilson(mean, n_eff, z)
    return mean, lo, hi


def _wilson(p: float, n: float, z: float) -> tuple[float, float]:
    """Wilson's score interval of a proportion p from n (not necessarily whole) draws:
    (p + z^2 / 2n -+ z sqrt(p(1 - p) / n + z^2 / 4n^2)) / (1 + z^2 / n), clipped to [0, 1]."""
    denom = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    return max(0.0, centre - half), min(1.0, centre + half)


def macro_interval(results: list[dict], z: float = 1.96) -> list[float]:
    """95% interval of the mean of several tasks' accuracies (each task's own problems, independent):
    each task's standard error read from its own interval (half its width over 2 z), the mean's
    ``sqrt(sum se_j^2) / T``; normal, clipped to [0, 1]."""
    T = len(results)
    mean = sum(r["accuracy"] for r in results) / T
    se = math.sqrt(sum(((r["ci95"][1] - r["ci95"][0]) / (2 * z)) ** 2 for r in results)) / T
    return [max(0.0, mean - z * se), min(1.0, mean + z * se)]


def t_quantile_975(df: float) -> float:
    """The 0.975 quantile of Student's t with ``df`` (>= 1, not necessarily whole) degrees of
    freedom: bisection on the distribution function, whose density is integrated by Simpson's rule
    (within 1e-4 of the printed tables; no scipy needed).

    The density is Gamma((df + 1) / 2) / (Gamma(df / 2) sqrt(df pi)) (1 + x^2 / df)^(-(df + 1) / 2),
    the distribution function 1/2 + its integral from 0 to x; above 1e5 degrees of freedom, the
    normal's 1.959964."""
    if not df >= 1:
        raise ValueError(f"degrees of freedom must be at least 1, got {df}")
    if df > 1e5:
        return 1.959963984540054
    log_c = math.lgamma((df + 1) / 2) - math.lgamma(df / 2) - 0.5 * math.log(df * math.pi)

    def cdf(x: float, steps: int = 1000) -> float:
        h = x / steps
        f = [math.exp(log_c - (df + 1) / 2 * math.log1p((k * h) ** 2 / df)) for k in range(steps + 1)]
        return 0.5 + h / 3 * (f[0] + f[-1] + 4 * sum(f[1:-1:2]) + 2 * sum(f[2:-1:2]))

    lo, hi = 1.9, 13.0  # t(0.975) falls from 12.706 at df = 1 towards 1.960
    for _ in range(40):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if cdf(mid) < 0.975 else (lo, mid)
    return (lo + hi) / 2


def seed_interval(accs: list[float]) -> list[float] | None:
    """95% interval of the mean over seeds, the runs as the units (None for one seed):
    mean +- t(0.975, S - 1) s / sqrt(S) over the S seeds' values (s their sample standard
    deviation), clipped to [0, 1]."""
    if len(accs) < 2:
        return None
    mean, half = statistics.fmean(accs), t_quantile_975(len(accs) - 1) * statistics.stdev(accs) / math.sqrt(len(accs))
    return [max(0.0, mean - half), min(1.0, mean + half)]


def welch_interval(a: list[float], b: list[float]) -> list[float] | None:
    """95% interval of mean(a) - mean(b) for two independent sets of runs (Welch: unequal
    variances, Welch-Satterthwaite degrees of freedom), clipped to [-1, 1]; None unless both have
    two runs.

    With v_a = s_a^2 / n_a and v_b = s_b^2 / n_b: d +- t(0.975, df) sqrt(v_a + v_b), where
    df = (v_a + v_b)^2 / (v_a^2 / (n_a - 1) + v_b^2 / (n_b - 1)) (at least 1); [d, d] if both
    sets are constant."""
    if len(a) < 2 or len(b) < 2:
        return None
    d = statistics.fmean(a) - statistics.fmean(b)
    va, vb = statistics.variance(a) / len(a), statistics.variance(b) / len(b)
    if va + vb == 0:
        return [d, d]
    df = (va + vb) ** 2 / (va**2 / (len(a) - 1) + vb**2 / (len(b) - 1))
    half = t_quantile_975(max(df, 1.0)) * math.sqrt(va + vb)
    return [max(-1.0, d - half), min(1.0, d + half)]  # two accuracies differ by at most 1


def spearman(x: list[float], y: list[float]) -> float | None:
    """Spearman's rank correlation: Pearson's r of the ranks, tied values sharing their mean rank
    (rank(w) = #{u < w} + (#{u = w} + 1) / 2). None with fewer than three pairs or where either
    side is constant."""
    def ranks(v):  # values below w, then the mean of the ranks the ties of w share
        return [sum(u < w for u in v) + (sum(u == w for u in v) + 1) / 2 for w in v]
    if len(x) < 3 or len(set(x)) < 2 or len(set(y)) < 2:
        return None
    return statistics.correlation(ranks(x), ranks(y))


def explained_variance(returns: torch.Tensor, values: torch.Tensor) -> float | None:
    """1 - Var(R - V) / Var(R) of returns R and a critic's values V (1: perfect; 0: no better than
    the mean return; below 0: worse), in float64; None for fewer than two entries or returns that
    vary by no more than float rounding (then the ratio means nothing: one such batch gave -1.9e15)."""
    ret, val = returns.double().flatten(), values.double().flatten()
    if len(ret) < 2 or not float(ret.std()) > 1e-6 * max(1.0, float(ret.abs().max())):
        return None
    return float(1 - (ret - val).var() / ret.var())
