"""Paired statistics for treatment vs baseline over problems (protocol section 4).

Each problem `i` (a cluster) has `k` generations per arm with 0/1 outcomes; a failed or ungradable
generation is 0, never dropped. Everything is computed from integer per-problem sums
`A_i, B_i` (correct counts, 0..k) and `D_i = A_i - B_i`, so resampled sums are integers and
comparisons such as `|S*_b - S| >= |S|` have no float ties.

All functions are pure: inputs are arrays, randomness comes from a seed, results are plain values or
the small `PairedResult` dataclass (`to_dict()` gives a JSON-ready dict).

(Over 400 lines: the paired test is one computation, from the per-problem sums through the
clustered SE, the centred cluster bootstrap and its Monte-Carlo error to the corrections and the
result record; each function is small and the statistics documentation follows this file in order.)
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from statistics import NormalDist

import numpy as np

from protocol.errors import ProtocolError

BOOT_DEFAULT = 100_000
BOOT_MAX = 1_000_000
# Rows of multinomial draws per chunk: memory stays O(chunk * distinct D values), independent of B.
_CHUNK = 1 << 14
# Largest support (2 * sum|D_i| + 1) for which the sign-flip distribution is enumerated exactly.
_SIGNFLIP_EXACT_LIMIT = 200_001


# --------------------------------------------------------------------------------------------------
# Data


@dataclass(frozen=True)
class PairedData:
    """Per-problem correct counts of two paired arms.

    clusters: (n,) problem labels, sorted; a, b: (n,) int64 correct counts in 0..k of treatment and
    baseline; k: generations per arm and problem (equal for every problem and both arms).
    """

    clusters: np.ndarray
    a: np.ndarray
    b: np.ndarray
    k: int

    @property
    def n(self) -> int:
        return int(self.a.shape[0])

    @property
    def D(self) -> np.ndarray:
        """(n,) int64 integer paired differences `A_i - B_i` in -k..k."""
        return self.a - self.b


def _as_binary(values, name: str) -> np.ndarray:
    """(N,) int64 array of 0/1; refuses missing values (a failure must be recorded as 0) and others."""
    arr = np.asarray(values)
    if arr.dtype == bool:
        return arr.astype(np.int64)
    if arr.dtype == object:  # e.g. None for a missing verdict
        arr = np.array([np.nan if v is None else v for v in arr.ravel()]).reshape(arr.shape)
    try:
        num = arr.astype(float)
    except (TypeError, ValueError):
        raise ProtocolError(f"{name}: outcomes must be 0/1 (a failed generation is 0)") from None
    missing = np.flatnonzero(np.isnan(num))
    if missing.size:
        raise ProtocolError(
            f"{name}: missing outcome in {missing.size} row(s) (first: row {missing[0]}); "
            "record a failed or ungradable generation as 0, never leave it out"
        )
    bad = np.flatnonzero((num != 0) & (num != 1))
    if bad.size:
        raise ProtocolError(f"{name}: outcome {num[bad[0]].item()!r} in row {bad[0]} is not 0/1")
    return num.astype(np.int64)


def paired_from_long(cluster, treatment, baseline, sample=None) -> PairedData:
    """Aggregate long rows (one per problem and generation) into per-problem integer sums.

    cluster: (N,) problem labels; treatment, baseline: (N,) 0/1 outcomes of the two arms on the same
    (problem, generation) row; sample: optional (N,) generation index, used only to refuse
    duplicated (problem, sample) rows. Every problem must have the same number k of rows.
    """
    cluster = np.asarray(cluster)
    t = _as_binary(treatment, "treatment")
    b = _as_binary(baseline, "baseline")
    if not (cluster.shape == t.shape == b.shape) or cluster.ndim != 1:
        raise ProtocolError("cluster, treatment and baseline must be 1-D columns of equal length")
    if cluster.size == 0:
        raise ProtocolError("no rows")
    if sample is not None:
        keys = np.rec.fromarrays([cluster.astype(str), np.asarray(sample).astype(str)])
        _, counts = np.unique(keys, return_counts=True)
        if (counts > 1).any():
            raise ProtocolError(f"{int((counts > 1).sum())} duplicated (problem, sample) row(s)")
    labels, inverse = np.unique(cluster, return_inverse=True)
    sizes = np.bincount(inverse)
    if sizes.min() != sizes.max():
        worst = labels[np.argmin(sizes)].item()  # a plain value: its repr is what the user wrote
        raise ProtocolError(
            f"unequal generations per problem: k ranges {sizes.min()}..{sizes.max()} "
            f"(e.g. problem {worst!r} has {sizes.min()}); missing rows must be recorded as 0"
        )
    a_sum = np.bincount(inverse, weights=t).astype(np.int64)
    b_sum = np.bincount(inverse, weights=b).astype(np.int64)
    return PairedData(clusters=labels, a=a_sum, b=b_sum, k=int(sizes[0]))


def paired_from_sums(D, k: int, a=None, b=None) -> PairedData:
    """PairedData from integer differences D (n,) in -k..k (and optionally the arm sums a, b)."""
    D = np.asarray(D)
    if D.ndim != 1 or D.size == 0 or not np.all(D == np.round(D)):
        raise ProtocolError("D must be a non-empty 1-D array of integer per-problem differences")
    D = D.astype(np.int64)
    if np.abs(D).max(initial=0) > k:
        raise ProtocolError(f"|D_i| exceeds k={k}")
    if a is None or b is None:
        # Only D matters for every test except McNemar's concordant counts; store D against zero.
        a, b = np.maximum(D, 0), np.maximum(-D, 0)
    return PairedData(clusters=np.arange(D.size), a=np.asarray(a, np.int64),
                      b=np.asarray(b, np.int64), k=int(k))


# --------------------------------------------------------------------------------------------------
# Analytic pieces


def mean_difference(D, k: int) -> float:
    """d̄ = mean_i D_i / k for D (n,) integer sums."""
    return float(np.asarray(D).sum() / (len(D) * k))


def clustered_se(D, k: int) -> float:
    """sqrt( sum (d_i - d̄)^2 / (n (n-1)) ) with d_i = D_i / k; equals the CR1 cluster-robust SE."""
    d = np.asarray(D, dtype=float) / k
    n = d.size
    if n < 2:
        raise ProtocolError("need at least 2 problems for a standard error")
    return float(math.sqrt(((d - d.mean()) ** 2).sum() / (n * (n - 1))))


# The normal distribution comes from the standard library: importing scipy.stats costs more than a
# whole bootstrap of 10^5 resamples.
_NORMAL = NormalDist()


def z_pvalue(estimate: float, se: float) -> tuple[float, float]:
    """Two-sided normal p of estimate/se -> (z, p). A zero SE gives p=1 for a zero estimate, else 0."""
    if se == 0.0:
        return (0.0, 1.0) if estimate == 0.0 else (math.copysign(math.inf, estimate), 0.0)
    z = estimate / se
    return float(z), float(math.erfc(abs(z) / math.sqrt(2.0)))  # = 2 * (1 - Phi(|z|))


def mde(se: float, alpha: float, power: float = 0.8) -> float:
    """Minimum detectable effect (two-sided test at `alpha`, given power): (z_{1-α/2} + z_power)·SE."""
    return float((_NORMAL.inv_cdf(1.0 - alpha / 2.0) + _NORMAL.inv_cdf(power)) * se)


def _binom_half_pmf(c: int) -> np.ndarray:
    """(c+1,) pmf of Binomial(c, 1/2), through log-gamma so that large c does not overflow."""
    x = np.arange(c + 1)
    log_choose = math.lgamma(c + 1) - np.array([math.lgamma(i + 1) + math.lgamma(c - i + 1) for i in x])
    return np.exp(log_choose - c * math.log(2.0))


def bonferroni(p, m: int):
    """min(1, m·p), elementwise."""
    return np.minimum(1.0, np.asarray(p, dtype=float) * m)


def holm(p, m: int | None = None) -> np.ndarray:
    """Holm step-down adjusted p-values, returned in input order.

    p: (c,) p-values of c cells; m: family size (>= c; defaults to c). With m > c the unseen cells
    are treated as having the largest p, which gives an upper bound on the exact adjustment.
    """
    p = np.asarray(p, dtype=float)
    m = p.size if m is None else int(m)
    if m < p.size:
        raise ProtocolError(f"m={m} is smaller than the number of p-values ({p.size})")
    order = np.argsort(p, kind="stable")
    factors = m - np.arange(p.size)
    adjusted = np.minimum(1.0, np.maximum.accumulate(p[order] * factors))
    out = np.empty_like(adjusted)
    out[order] = adjusted
    return out


def mcnemar_exact(data: PairedData) -> dict:
    """Exact McNemar test for k = 1: two-sided binomial test on the discordant pairs.

    Returns {"n11", "n10", "n01", "n00", "p"}. Refused for k > 1: pooled generations of one problem
    are not independent pairs, so the binomial null does not hold.
    """
    # deferred: scipy.stats adds ~0.3 s to CLI start-up (the CLI imports this module)
    from scipy.stats import binomtest

    if data.k != 1:
        raise ProtocolError(
            f"McNemar's test needs k = 1 generation per arm and problem (got k = {data.k}); "
            "pooling generations makes the pairs dependent: use the cluster bootstrap"
        )
    a, b = data.a, data.b
    n10 = int(((a == 1) & (b == 0)).sum())
    n01 = int(((a == 0) & (b == 1)).sum())
    disc = n10 + n01
    p = 1.0 if disc == 0 else float(binomtest(n10, disc, 0.5).pvalue)
    return {"n11": int(((a == 1) & (b == 1)).sum()), "n10": n10, "n01": n01,
            "n00": int(((a == 0) & (b == 0)).sum()), "p": p}


# --------------------------------------------------------------------------------------------------
# Cluster bootstrap


def bootstrap_sum_hist(D, B: int, rng: np.random.Generator, chunk: int = _CHUNK) -> np.ndarray:
    """Histogram of B cluster-bootstrap sums S*_b = sum of n problems drawn with replacement.

    D: (n,) integer sums in -k..k. Returns (2·n·kmax + 1,) int64 counts, index = S* + n·kmax with
    kmax = max|D_i|. A resample's sum depends only on how many drawn problems carry each distinct
    value of D, which is Multinomial(n, share of each value): drawing those counts is exactly the
    cluster bootstrap of the sum, with O(B · #values) work instead of O(B · n).
    """
    D = np.asarray(D, dtype=np.int64)
    n = D.size
    values, counts = np.unique(D, return_counts=True)
    offset = n * int(np.abs(values).max(initial=0))
    hist = np.zeros(2 * offset + 1, dtype=np.int64)
    if B <= 0:
        raise ProtocolError("B must be positive")
    shares = counts / n
    done = 0
    while done < B:
        c = min(chunk, B - done)
        draws = rng.multinomial(n, shares, size=c)  # (c, #values)
        sums = draws @ values  # (c,) integer resampled sums
        hist += np.bincount(sums + offset, minlength=hist.size)
        done += c
    return hist


def _hist_quantile(hist: np.ndarray, q: float) -> int:
    """Index of the smallest value whose cumulative share reaches q (numpy's 'inverted_cdf')."""
    cdf = np.cumsum(hist)
    return int(np.searchsorted(cdf, q * cdf[-1], side="left"))


def centred_bootstrap_p(hist: np.ndarray, S: int) -> float:
    """p = (1 + #{|S*_b - S| >= |S|}) / (B + 1) from a histogram made by `bootstrap_sum_hist`."""
    offset = hist.size // 2
    s_star = np.arange(hist.size, dtype=np.int64) - offset
    extreme = np.abs(s_star - S) >= abs(S)
    B = int(hist.sum())
    return float((1 + int(hist[extreme].sum())) / (B + 1))


def percentile_ci(hist: np.ndarray, level: float, scale: float) -> tuple[float, float]:
    """Percentile interval of S*/scale at the given two-sided level (e.g. 0.95)."""
    offset = hist.size // 2
    tail = (1.0 - level) / 2.0
    lo = _hist_quantile(hist, tail) - offset
    hi = _hist_quantile(hist, 1.0 - tail) - offset
    return float(lo / scale), float(hi / scale)


def mc_se(p: float, B: int) -> float:
    """Monte-Carlo standard error sqrt(p(1-p)/B) of a resampling p-value."""
    return float(math.sqrt(p * (1.0 - p) / B))


@dataclass(frozen=True)
class BootstrapOutcome:
    p: float
    mc_se: float
    boot: int
    escalated: bool
    cis: dict  # level -> (lo, hi) of d̄


def bootstrap_test(D, k: int, *, boot: int, boot_max: int, threshold: float,
                   levels: tuple[float, ...], rng: np.random.Generator,
                   chunk: int = _CHUNK) -> BootstrapOutcome:
    """Null-centred cluster-bootstrap p with automatic escalation, plus percentile CIs of d̄.

    D: (n,) integer sums. First `boot` resamples; if the p-value lies within 3 MC SEs of
    `threshold` (the per-cell alpha) and boot < boot_max, a fresh run of `boot_max` resamples from
    the same generator replaces it, so the decision is not left to Monte-Carlo noise.
    """
    D = np.asarray(D, dtype=np.int64)
    S = int(D.sum())
    hist = bootstrap_sum_hist(D, boot, rng, chunk)
    p = centred_bootstrap_p(hist, S)
    escalated = False
    if boot < boot_max and abs(p - threshold) <= 3.0 * mc_se(p, boot):
        hist = bootstrap_sum_hist(D, boot_max, rng, chunk)
        p, boot, escalated = centred_bootstrap_p(hist, S), boot_max, True
    scale = D.size * k
    cis = {lvl: percentile_ci(hist, lvl, scale) for lvl in levels}
    return BootstrapOutcome(p=p, mc_se=mc_se(p, boot), boot=boot, escalated=escalated, cis=cis)


# --------------------------------------------------------------------------------------------------
# Sign-flip permutation


def signflip_pvalue(D, *, rng: np.random.Generator | None = None, boot: int = BOOT_DEFAULT,
                    exact_limit: int = _SIGNFLIP_EXACT_LIMIT) -> tuple[float, str]:
    """Two-sided sign-flip permutation p of S = sum D_i -> (p, method).

    Under the null each D_i is symmetric, so S_perm = sum ε_i D_i with random signs ε_i. Problems
    sharing |D_i| = v contribute v·(2X_v - c_v), X_v ~ Binomial(c_v, 1/2); the exact distribution
    is the convolution of those few binomials ("exact"). Beyond `exact_limit` support points it
    falls back to Monte Carlo with `boot` draws and p = (1 + #extreme) / (B + 1) ("mc").
    """
    D = np.asarray(D, dtype=np.int64)
    S = abs(int(D.sum()))
    mags, counts = np.unique(np.abs(D[D != 0]), return_counts=True)
    total = int((mags * counts).sum())
    if total == 0:
        return 1.0, "exact"
    if 2 * total + 1 <= exact_limit:
        pmf = np.ones(1)  # distribution of S_perm + running offset, support step 1
        for v, c in zip(mags.tolist(), counts.tolist()):
            comp = np.zeros(2 * v * c + 1)
            comp[:: 2 * v] = _binom_half_pmf(c)  # value v(2x - c) at 2vx
            pmf = np.convolve(pmf, comp)
        values = np.arange(pmf.size) - total
        return float(min(1.0, pmf[np.abs(values) >= S].sum())), "exact"
    rng = rng if rng is not None else np.random.default_rng(0)
    s_perm = np.zeros(boot, dtype=np.int64)
    for v, c in zip(mags.tolist(), counts.tolist()):
        s_perm += v * (2 * rng.binomial(c, 0.5, size=boot) - c)
    return float((1 + int((np.abs(s_perm) >= S).sum())) / (boot + 1)), "mc"


# --------------------------------------------------------------------------------------------------
# The whole test


@dataclass
class PairedResult:
    """Everything reported for one cell: estimate, SE, the primary and cross-check p-values, CIs.

    Differences are proportions (0.04 = 4 percentage points). `p_holm` is exact when the other
    cells' p-values were given (`holm_exact`), else the Bonferroni value, an upper bound on it.
    """

    n: int
    k: int
    acc_treatment: float
    acc_baseline: float
    estimate: float
    S: int
    se: float
    z: float
    p_z: float
    p_bootstrap: float
    p_bootstrap_mc_se: float
    boot: int
    boot_requested: int
    boot_escalated: bool
    seed: int
    alpha: float
    m: int
    alpha_cell: float
    ci95: tuple[float, float]
    ci_bonferroni: tuple[float, float]
    ci_bonferroni_level: float
    p_bonferroni: float
    p_holm: float
    holm_exact: bool
    p_signflip: float
    signflip_method: str
    p_mcnemar: float | None
    mcnemar: dict | None
    mde: float
    power: float
    reject: bool
    verdict: str
    notes: list = field(default_factory=list)

    def to_dict(self) -> dict:
        out = asdict(self)
        out["ci95"] = list(self.ci95)
        out["ci_bonferroni"] = list(self.ci_bonferroni)
        return out


def paired_test(data: PairedData, *, alpha: float = 0.05, m: int = 1, boot: int = BOOT_DEFAULT,
                boot_max: int = BOOT_MAX, seed: int = 0, other_p=None, power: float = 0.8,
                chunk: int = _CHUNK) -> PairedResult:
    """Paired treatment-vs-baseline test of one cell (protocol section 4).

    data: per-problem sums (n problems, k generations per arm). alpha: family-wise level; m: number
    of pre-registered cells (Bonferroni threshold alpha/m, the threshold for bootstrap escalation,
    the CI level 1 - alpha/m and the MDE's alpha). boot/boot_max: initial and escalated resamples
    (boot_max <= boot disables escalation). other_p: the other m-1 cells' primary p-values, for an
    exact Holm adjustment. Sign-flip and bootstrap use independent streams derived from `seed`.
    """
    if not 0.0 < alpha < 1.0:
        raise ProtocolError(f"alpha must be in (0, 1), got {alpha}")
    if m < 1:
        raise ProtocolError(f"m must be >= 1, got {m}")
    if boot < 1:
        raise ProtocolError(f"the number of bootstrap resamples must be >= 1, got {boot}")
    D = data.D
    n, k = data.n, data.k
    estimate = mean_difference(D, k)
    se = clustered_se(D, k)
    z, p_z = z_pvalue(estimate, se)
    alpha_cell = alpha / m
    level_b = 1.0 - alpha_cell
    boot_ss, flip_ss = np.random.SeedSequence(seed).spawn(2)
    bt = bootstrap_test(D, k, boot=boot, boot_max=max(boot, boot_max), threshold=alpha_cell,
                        levels=(0.95, level_b), rng=np.random.default_rng(boot_ss), chunk=chunk)
    p_sf, sf_method = signflip_pvalue(D, rng=np.random.default_rng(flip_ss), boot=bt.boot)
    p_bonf = float(bonferroni(bt.p, m))
    notes = []
    if other_p is not None and len(other_p) > 0:
        if len(other_p) != m - 1:
            raise ProtocolError(f"--other-p needs the other m-1 = {m - 1} cells' p-values, "
                                f"got {len(other_p)}")
        p_holm, holm_exact = float(holm([bt.p, *other_p], m)[0]), True
    else:
        p_holm, holm_exact = p_bonf, m == 1
        if m > 1:
            notes.append("p_holm is the Bonferroni bound: the other cells' p-values were not given")
    mc = mcnemar_exact(data) if k == 1 else None
    if k > 1:
        notes.append("McNemar refused: k > 1 generations per problem are not independent pairs")
    reject = bt.p <= alpha_cell
    if reject:
        verdict = "treatment better" if estimate > 0 else "treatment worse"
    else:
        verdict = "no significant difference"
    return PairedResult(
        n=n, k=k, acc_treatment=float(data.a.sum() / (n * k)),
        acc_baseline=float(data.b.sum() / (n * k)), estimate=estimate, S=int(D.sum()), se=se,
        z=z, p_z=p_z, p_bootstrap=bt.p, p_bootstrap_mc_se=bt.mc_se, boot=bt.boot,
        boot_requested=boot, boot_escalated=bt.escalated, seed=seed, alpha=alpha, m=m,
        alpha_cell=alpha_cell, ci95=bt.cis[0.95], ci_bonferroni=bt.cis[level_b],
        ci_bonferroni_level=level_b, p_bonferroni=p_bonf, p_holm=p_holm, holm_exact=holm_exact,
        p_signflip=p_sf, signflip_method=sf_method, p_mcnemar=None if mc is None else mc["p"],
        mcnemar=mc, mde=mde(se, alpha_cell, power), power=power, reject=bool(reject),
        verdict=verdict, notes=notes,
    )
