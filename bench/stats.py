"""Paired comparisons over shared samples: the mean difference with a 95% bootstrap interval, the smallest
difference the pairs could detect, and an exact sign test beside it.

Two methods run on the same prompts (or passages) give paired scores; what a reader may call a difference is a
difference whose interval excludes zero. The bootstrap resamples the pairs (percentile interval, a fixed seed, so a
re-render gives the same numbers); with fewer than two pairs there is no interval. "Indistinguishable" says nothing
about equality: ``detectable`` is the smallest true difference these pairs would find with 80% power at a two-sided
5% level, (z_0.975 + z_0.80) · sd / √n from the differences' own spread, so a reader sees how large a difference
could hide in an "indistinguishable" cell. The sign test (exact binomial on the pairs that differ; McNemar's exact
test when scores are 0 or 1) needs no resampling.

"No worse" is a claim of its own: a non-inferiority test against a margin written down before the rows were run
(``MARGINS``). With the one-sided 95% bound of the difference (the 5th bootstrap percentile, for higher-is-better)
above −margin, the method is no worse than the other by more than the margin; with both 90% bounds inside ±margin
(two one-sided tests, TOST) the two are equivalent within it. Neither follows from an interval that merely
straddles zero.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

RESAMPLES = 10_000
POWER_Z = 1.959963984540054 + 0.8416212335729143  # z_0.975 + z_0.80: two-sided 5%, 80% power



@dataclass(frozen=True)
class Margin:
    """A non-inferiority margin in a table's own units, and when it was written down: only rows run after that
    instant are judged against it (for older rows it would be a margin chosen after seeing them)."""
    size: float
    set_at: str  # ISO 8601, UTC: compared with a row's "time"

    def judges(self, rows: list[dict]) -> bool:
        return bool(rows) and all(r.get("time", "") > self.set_at for r in rows)


# Set before the fresh 16-bit evaluation of issue 45: RULER string_match_all × 100, in points
MARGINS = {"ruler": Margin(5.0, "2026-12-05T07:00:00+00:00")}


@dataclass(frozen=True)
class Paired:
    mean: float  # mean of a - b over the pairs
    low: float | None  # 95% bootstrap interval of that mean; None with fewer than two pairs
    high: float | None
    pairs: int
    sd: float | None = None  # sample standard deviation of the differences
    sign_p: float | None = None  # exact two-sided sign test over the pairs that differ (1.0 when none do)
    low90: float | None = None  # 90% bootstrap interval: its bounds are the one-sided 95% bounds (TOST)
    high90: float | None = None

    @property
    def detectable(self) -> float | None:
        """The smallest |difference| these pairs detect with 80% power at a two-sided 5% level; None without a
        spread to estimate it from (fewer than two pairs, or every difference the same)."""
        if self.sd is None or self.sd <= 1e-12 * max(1.0, abs(self.mean)):  # every difference the same (to rounding)
            return None
        return POWER_Z * self.sd / self.pairs ** 0.5

    @property
    def excludes_zero(self) -> bool:
        return self.low is not None and (self.low > 0 or self.high < 0)

    def verdict(self, better: str = "higher") -> str:
        """'better' / 'worse' where the interval excludes zero (``better``: which sign is good), else
        'indistinguishable'."""
        if not self.excludes_zero:
            return "indistinguishable"
        good = self.mean > 0 if better == "higher" else self.mean < 0
        return "better" if good else "worse"

    def no_worse(self, margin: float, better: str = "higher", scale: float = 1.0) -> str:
        """Against a margin set in advance (in the units of the differences times ``scale``): 'equivalent within
        ±m' where both 90% bounds lie inside ±m (TOST at 5%), 'no worse than −m' where the one-sided 95% bound on
        the bad side clears −m, else 'not shown no worse than −m'."""
        if self.low90 is None:
            return "not tested (one pair)"
        low, high = self.low90 * scale, self.high90 * scale
        worst = low if better == "higher" else -high  # the bound on the bad side, as a gain
        if -margin < low and high < margin:
            return f"equivalent within ±{margin:g}"
        if worst > -margin:
            return f"no worse than −{margin:g}"
        return f"not shown no worse than −{margin:g}"

    def text(self, scale: float = 1.0, digits: int = 1) -> str:
        """'+12.5 [+2.5, +22.5]' (values times ``scale``)."""
        if self.low is None:
            return f"{self.mean * scale:+.{digits}f}"
        return f"{self.mean * scale:+.{digits}f} [{self.low * scale:+.{digits}f}, {self.high * scale:+.{digits}f}]"


def paired_cell(result: Paired | None, scale: float, digits: int, better: str, margin: float | None = None) -> str:
    """One table cell: '+0.6 [-3.8, +5.3] (80; indistinguishable; detects ±6.1; sign p 0.82)', values times
    ``scale``; with a ``margin`` (in the scaled units) the non-inferiority verdict too; "—" without a comparison."""
    if result is None:
        return "—"
    detects = f"±{result.detectable * scale:.{digits}f}" if result.detectable is not None else "—"
    verdict = result.verdict(better)
    if margin is not None:
        verdict += "; " + result.no_worse(margin, better, scale)
    return (f"{result.text(scale, digits)} ({result.pairs}; {verdict}; detects {detects}; "
            f"sign p {result.sign_p:.2g})")


def paired(a: list[float], b: list[float], seed: int = 0) -> Paired:
    """a[i] and b[i] measured on the same sample i."""
    if len(a) != len(b):
        raise ValueError(f"paired samples need equal lengths (got {len(a)} and {len(b)})")
    if not a:
        raise ValueError("no shared samples to compare")
    from scipy.stats import binomtest

    diff = torch.tensor(a, dtype=torch.float64) - torch.tensor(b, dtype=torch.float64)
    mean = float(diff.mean())
    ups, downs = int((diff > 0).sum()), int((diff < 0).sum())
    sign_p = float(binomtest(ups, ups + downs, 0.5).pvalue) if ups + downs else 1.0
    if len(diff) < 2:
        return Paired(mean, None, None, len(diff), None, sign_p)
    g = torch.Generator().manual_seed(seed)
    picks = torch.randint(0, len(diff), (RESAMPLES, len(diff)), generator=g)
    means = diff[picks].mean(dim=1)
    low, low90, high90, high = torch.quantile(means, torch.tensor([0.025, 0.05, 0.95, 0.975],
                                                                  dtype=torch.float64)).tolist()
    return Paired(mean, low, high, len(diff), float(diff.std()), sign_p, low90, high90)


def shared(by_key_a: dict, by_key_b: dict) -> tuple[list[float], list[float]]:
    """Values of the keys both dicts hold, in one order: the pairs of a paired comparison."""
    keys = sorted(set(by_key_a) & set(by_key_b))
    return [by_key_a[k] for k in keys], [by_key_b[k] for k in keys]


def pooled(conditions: list[tuple[dict, dict]]) -> tuple[list[float], list[float]]:
    """The pairs of one comparison over several conditions of the same items (one prompt at several budgets):
    each item counts once, at its mean over the conditions where both sides have it, since an item's conditions
    are not independent samples; (by key a, by key b) per condition."""
    by_item: dict = {}
    for by_key_a, by_key_b in conditions:
        for key in by_key_a.keys() & by_key_b.keys():
            by_item.setdefault(key, []).append((by_key_a[key], by_key_b[key]))
    items = sorted(by_item, key=str)
    return ([sum(a for a, _ in by_item[k]) / len(by_item[k]) for k in items],
            [sum(b for _, b in by_item[k]) / len(by_item[k]) for k in items])
