"""The decision rule of a tuning campaign: is a candidate worth adopting over the incumbent?

A candidate is measured **interleaved** with the incumbent: in each cycle the incumbent runs,
then the candidate, on the same request list, so each cycle gives one pair
``(incumbent value, candidate value)`` of the campaign's objective. The effect is the
**log ratio** candidate / incumbent of each pair, signed so that positive is better (a
lower-is-better objective such as TTFT p50 flips the sign), and its interval is a paired
Student t interval on those log ratios (Student 1908; any statistics text, e.g. Wasserman
2004, "All of Statistics", 10.5). Working in logs makes a gain relative (``+0.0953`` is
``x1.10``) and the steps of a path additive.

Each bound of the interval is a **one-sided** bound at the rule's ``confidence``: together
they make the ``2 * confidence - 1`` two-sided interval (90 % for 95 %), the convention of
the two one-sided tests (TOST) for equivalence (Schuirmann 1987, "A comparison of the two
one-sided tests procedure and the power approach for assessing the equivalence of average
bioavailability", J. Pharmacokinetics and Biopharmaceutics 15(6)). So every verdict of
:func:`judge` is a test at level ``1 - confidence``:

- ``pays``: the lower bound is above ``log(1 + min_gain)``: the gain is at least the
  smallest gain worth adopting (a superiority-by-margin test);
- ``inert``: the interval lies inside ``(-log(1 + margin), +log(1 + margin))``: the knob is
  **shown** equivalent within the margin (TOST), not merely "no clear difference";
- ``worse``: the upper bound is below 0 (and the interval is not inside the margin);
- ``marginal``: the lower bound is above 0 (a real gain) but not shown to reach
  ``min_gain``;
- ``undecided``: none of these yet.

Pure: no database, no Ray, no HTTP.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from enum import StrEnum
from functools import lru_cache

from pydantic import BaseModel, ConfigDict, Field, model_validator
from scipy.stats import t as student_t


class Direction(StrEnum):
    """Which way an objective improves: output tokens/s is ``higher``, TTFT ``lower``."""

    HIGHER = "higher"
    LOWER = "lower"


class Verdict(StrEnum):
    """What one candidate's interval says against the incumbent (see the module docstring)."""

    PAYS = "pays"
    INERT = "inert"
    WORSE = "worse"
    MARGINAL = "marginal"
    UNDECIDED = "undecided"


class DecisionRule(BaseModel):
    """When a candidate is adopted, called inert or worse, and how many repeats it gets.

    ``min_gain`` and ``equivalence_margin`` are relative (``0.05`` is 5 %); a repeat is one
    interleaved pair (one incumbent run and one candidate run).
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    confidence: float = Field(0.95, gt=0.5, lt=1.0, description="of each one-sided test")
    min_gain: float = Field(0.05, gt=0.0, le=10.0, description="smallest gain worth adopting")
    equivalence_margin: float = Field(
        0.02, gt=0.0, le=1.0, description="a knob within it either way is inert"
    )
    min_repeats: int = Field(3, ge=2, le=100, description="pairs before any verdict")
    max_repeats: int = Field(6, ge=2, le=100, description="pairs at most per candidate")

    @model_validator(mode="after")
    def _consistent(self) -> DecisionRule:
        if self.max_repeats < self.min_repeats:
            raise ValueError(
                f"max_repeats ({self.max_repeats}) is below min_repeats ({self.min_repeats})"
            )
        if self.equivalence_margin >= self.min_gain:
            raise ValueError(
                f"equivalence_margin ({self.equivalence_margin}) must be below min_gain "
                f"({self.min_gain}): a gain worth adopting cannot also be inert"
            )
        return self

    @property
    def pay_threshold(self) -> float:
        """``log(1 + min_gain)``: the log gain a lower bound must pass to pay."""
        return math.log1p(self.min_gain)

    @property
    def inert_threshold(self) -> float:
        """``log(1 + equivalence_margin)``: the interval must sit inside plus or minus it."""
        return math.log1p(self.equivalence_margin)


class Gain(BaseModel):
    """A candidate's effect over the incumbent, in log ratio units (positive is better).

    ``low`` and ``high`` are one-sided bounds at ``confidence`` each; ``se`` is the standard
    error of ``estimate`` and ``df`` its degrees of freedom (``n - 1`` for a paired interval,
    Welch-Satterthwaite for a sum, see :func:`sum_gains`).
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    estimate: float
    low: float
    high: float
    se: float = Field(ge=0.0)
    df: float = Field(gt=0.0)
    n: int = Field(ge=2, description="pairs behind it (for a sum: the fewest of its parts)")
    confidence: float = Field(gt=0.5, lt=1.0)

    @property
    def relative(self) -> float:
        """The gain as a fraction: ``0.10`` is 10 % better."""
        return math.expm1(self.estimate)

    @property
    def relative_interval(self) -> tuple[float, float]:
        """The bounds as fractions."""
        return math.expm1(self.low), math.expm1(self.high)

    def describe(self) -> str:
        """``+10.2 % [+7.9 %, +12.6 %]``: for paths and reports."""
        low, high = self.relative_interval
        return f"{self.relative:+.1%} [{low:+.1%}, {high:+.1%}]"


@lru_cache(maxsize=4096)
def t_quantile(confidence: float, df: float) -> float:
    """The Student t quantile at ``confidence`` with ``df`` degrees of freedom (one-sided)."""
    return float(student_t.ppf(confidence, df))


def log_ratio(incumbent: float, candidate: float, direction: Direction) -> float:
    """``log(candidate / incumbent)``, negated when lower is better; both must be positive.

    Raises ``ValueError`` on a value that is not a positive finite number.
    """
    for value in (incumbent, candidate):
        if not (math.isfinite(value) and value > 0):
            raise ValueError(f"objective values must be positive and finite, got {value!r}")
    ratio = math.log(candidate) - math.log(incumbent)
    return ratio if direction is Direction.HIGHER else -ratio


def gain_from_pairs(
    pairs: Sequence[tuple[float, float]],
    confidence: float,
    direction: Direction = Direction.HIGHER,
) -> Gain:
    """The paired Student t gain of interleaved ``(incumbent, candidate)`` pairs.

    Each pair gives ``d = log_ratio(incumbent, candidate)``; the estimate is the mean of the
    ``d`` and each bound is ``mean -+ t(confidence, n - 1) * sd / sqrt(n)``. Raises
    ``ValueError`` with fewer than 2 pairs or a value that is not positive.
    """
    if len(pairs) < 2:
        raise ValueError(f"a paired interval needs at least 2 pairs, got {len(pairs)}")
    diffs = [log_ratio(inc, cand, direction) for inc, cand in pairs]
    n = len(diffs)
    mean = math.fsum(diffs) / n
    var = math.fsum((d - mean) ** 2 for d in diffs) / (n - 1)
    se = math.sqrt(var / n)
    half = t_quantile(confidence, n - 1) * se
    return Gain(
        estimate=mean,
        low=mean - half,
        high=mean + half,
        se=se,
        df=n - 1,
        n=n,
        confidence=confidence,
    )


def sum_gains(gains: Sequence[Gain], sign: Sequence[float] | None = None) -> Gain:
    """The gain of a chain of steps (log gains add), or a difference with ``sign=(1, -1)``.

    The parts are taken as independent: ``se`` is the root of the summed variances and
    ``df`` the Welch-Satterthwaite approximation (Satterthwaite 1946, "An approximate
    distribution of estimates of variance components", Biometrics Bulletin 2(6)). All parts
    must share one ``confidence``. Raises ``ValueError`` on an empty or mixed list.
    """
    if not gains:
        raise ValueError("no gains to add")
    signs = list(sign) if sign is not None else [1.0] * len(gains)
    if len(signs) != len(gains):
        raise ValueError("one sign per gain")
    confidence = gains[0].confidence
    if any(g.confidence != confidence for g in gains):
        raise ValueError("gains of different confidence levels do not add")
    estimate = math.fsum(s * g.estimate for s, g in zip(signs, gains, strict=True))
    variances = [g.se**2 for g in gains]
    var = math.fsum(variances)
    if var > 0:
        df = var**2 / math.fsum(v**2 / g.df for v, g in zip(variances, gains, strict=True))
    else:
        df = min(g.df for g in gains)
    se = math.sqrt(var)
    half = t_quantile(confidence, df) * se
    return Gain(
        estimate=estimate,
        low=estimate - half,
        high=estimate + half,
        se=se,
        df=df,
        n=min(g.n for g in gains),
        confidence=confidence,
    )


def judge(gain: Gain, rule: DecisionRule) -> Verdict:
    """The verdict of ``gain`` under ``rule`` (the order of the checks is the order below).

    ``pays`` when ``low > log(1 + min_gain)``; ``inert`` when ``-log(1 + margin) < low`` and
    ``high < log(1 + margin)``; ``worse`` when ``high < 0``; ``marginal`` when ``low > 0``;
    else ``undecided``. Equivalence comes before ``worse`` and ``marginal``: an interval
    inside the margin is a knob that does not matter, even when it is significantly off 0.
    """
    if gain.low > rule.pay_threshold:
        return Verdict.PAYS
    if -rule.inert_threshold < gain.low and gain.high < rule.inert_threshold:
        return Verdict.INERT
    if gain.high < 0:
        return Verdict.WORSE
    if gain.low > 0:
        return Verdict.MARGINAL
    return Verdict.UNDECIDED


def needs_more(gain: Gain, rule: DecisionRule, n: int) -> bool:
    """Whether a candidate with ``n`` pairs and this ``gain`` gets another repeat.

    Yes while ``n < max_repeats`` and the interval still straddles a threshold that would
    change its verdict: ``log(1 + min_gain)`` (it may still pay), or, while ``undecided``,
    0 or the equivalence margin (it may still be shown worse or inert). ``pays``, ``worse``
    and ``inert`` are final, and so is ``marginal`` once its upper bound is below the pay
    threshold (a real gain, shown too small to adopt). Below ``min_repeats`` always yes.
    """
    if n >= rule.max_repeats:
        return False
    if n < rule.min_repeats:
        return True
    verdict = judge(gain, rule)
    if verdict in (Verdict.PAYS, Verdict.WORSE, Verdict.INERT):
        return False
    if gain.low <= rule.pay_threshold < gain.high:
        return True
    return verdict is Verdict.UNDECIDED
