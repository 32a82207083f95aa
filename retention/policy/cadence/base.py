"""Cadence: when to compact, and what `--budget` means.

A policy keeps a nominal `b` tokens per (layer, KV head) right after a compaction and compacts when
the stored length reaches `b + N` (interval `N`). Protected tokens (`sink` first positions, `recent`
newest positions) count inside `b`.

The decode step that follows a compaction attends to `b + 1` stored tokens (its own key included),
so the attended length cycles through `b+1 .. b+N`: mean `b + (N+1)/2`, peak `b + N`. After prefill
the prompt is compacted to `b` as soon as it is longer than `b`, so no decode step starts a cycle
above `b + 1`, and the mean over any prefix of the generation is at most `b + (N+1)/2`.

Accounting modes derive `b` from the budget `B`:

* `mean` (default, this project's meaning of budget): `b = B - N//2 - 1`, so the measured mean
  over the whole generation is at most `B` (exactly `B - 1/2` for even `N` over whole cycles).
  The literature's `b = B - N/2` would overshoot by half a token because of the `+1` above.
* `peak`: `b = B - N`: no decode step ever attends to more than `B` tokens.
* `prefill`: `b = B`, the loose convention of published implementations (size right after a
  compaction); the real mean is about `B + N/2`, which the meter reports.

The cadence family. A cadence is a subclass of `Cadence` (plugins: entry-point group
`retention.cadences`, `module:Class`, `file.py:Class`); `fixed` (this class) is the interval cadence
above. A cadence decides `due(stored, prefill, prompt_length, token)` (`token`: the id the forward
just wrote, on the host) and states its `span`: the most tokens a row stores above `b` before it is
due. The rule that derives `b` from `B` is the one above with `span` for `N`: if every cycle runs
from `b + 1` to at most `b + span` attended tokens, the mean over any prefix of the generation is
at most `b + (span + 1)/2`, so `b = B - span//2 - 1` holds the mean at or below `B` whatever the
cycle lengths are (`mean`), and `b = B - span` holds the peak (`peak`). An irregular cadence is
therefore metered exactly like the fixed one, and the meter checks the bound on every record.

* `newline` (R-KV's `divide_method=newline`, Cai et al. 2025): once a row holds `b + N` tokens it
  compacts at the first line break it writes (a reasoning-step boundary), and at the latest after
  `max_wait` more tokens: `span = N + max_wait`. Line breaks are the token ids whose text contains
  `\n` (`prepare(tokenizer)`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from retention.errors import RetentionError
from retention.policy.settings import TrivialSetting

ACCOUNTING_MODES = ("mean", "prefill", "peak")
# What an arm does with the prompt: an ordinary candidate; protected and counted inside b (the
# protocol's meter); protected on top of b (the peers' convention, --protect-prompt).
PROMPT_RULES = ("evict", "keep", "keep-on-top")
REFERENCE_INTERVAL = 128


def largest_interval(budget: int, accounting: str, floor: int = 1) -> int | None:
    """The largest interval N that leaves `b >= floor` at budget B (None: no N does; B too small).

    mean: B - N//2 - 1 >= floor  <=>  N <= 2 (B - 1 - floor) + 1;  peak: N <= B - floor;
    prefill: b = B whatever N, so any N works once B >= floor."""
    if accounting == "mean":
        n = 2 * (budget - 1 - floor) + 1
    elif accounting == "peak":
        n = budget - floor
    else:
        n = REFERENCE_INTERVAL if budget >= floor else 0
    return n if n >= 1 else None


def default_interval(budget: int, accounting: str = "mean", floor: int = 1) -> int:
    """The reference interval 128, shortened for small budgets so that about half the budget stays
    after a compaction: `min(128, B)` in mean and prefill accounting (mean: b = B - N//2 - 1),
    `min(128, B // 2)` in peak accounting (b = B - N; `min(128, B)` would leave b = 0 at B <= 128).
    Finally capped by `largest_interval`, so the default works at every budget in every mode."""
    n = min(REFERENCE_INTERVAL, budget // 2 if accounting == "peak" else budget)
    return max(1, min(n, largest_interval(budget, accounting, floor) or 1))


def nominal_budget(budget: int, interval: int, accounting: str) -> int:
    """Tokens kept right after a compaction for budget `B`, interval `N` and an accounting mode."""
    if accounting == "mean":
        return budget - interval // 2 - 1
    if accounting == "peak":
        return budget - interval
    if accounting == "prefill":
        return budget
    raise RetentionError(f"unknown accounting mode {accounting!r}; choose one of {', '.join(ACCOUNTING_MODES)}")


@dataclass(frozen=True)
class Cadence(TrivialSetting):
    """Interval cadence with a nominal target (`fixed`). `budget=None` means no eviction (the `full` row)."""

    name: ClassVar[str] = "fixed"
    budget: int | None
    interval: int
    accounting: str = "mean"
    sink: int = 0
    recent: int = 0
    # The reference's prompt rule: prompt tokens are never evicted and never candidates; the budget
    # applies to the generated tokens on top of the prompt (the meter still counts the prompt).
    protect_prompt: bool = False
    # The protocol's prompt rule (docs/random-control.md): the prompt is protected but counted inside
    # b, so a prompt-protecting arm holds fewer generated tokens; at most b - recent - 1 prompt
    # tokens are protected (the first ones), so one scored slot is always left, as Random
    # Attention's `random_pp` caps its prompt at K - 1.
    prompt_counted: bool = False

    def __post_init__(self):
        if self.accounting not in ACCOUNTING_MODES:
            raise RetentionError(
                f"unknown accounting mode {self.accounting!r}; choose one of {', '.join(ACCOUNTING_MODES)}"
            )
        if self.interval <= 0:
            raise RetentionError(f"--interval must be a positive number of tokens, got {self.interval}")
        if self.sink < 0 or self.recent < 0:
            raise RetentionError("--sink and --recent must be >= 0")
        if self.protect_prompt and self.prompt_counted:
            raise RetentionError("the prompt is either kept on top of b (--protect-prompt) or counted inside b "
                                 "(--prompt-rule keep), not both")
        if self.budget is None:
            return
        if self.budget <= 0:
            raise RetentionError(f"--budget must be a positive number of tokens, got {self.budget}")
        floor = max(1, self.sink + self.recent + 1)
        if self.nominal < floor:
            fits = largest_interval(self.budget, self.accounting, floor)
            hint = (f"the largest --interval that works here is {fits}" if fits
                    else "no interval works at this budget; use a larger --budget (or --budget-bytes)")
            raise RetentionError(
                f"budget {self.budget} with interval {self.interval} in '{self.accounting}' accounting leaves "
                f"b = {self.nominal} tokens after a compaction, below the {floor} needed by sink {self.sink} + "
                f"recent {self.recent} + 1 scored token; {hint}"
            )

    @property
    def evicts(self) -> bool:
        return self.budget is not None

    @property
    def span(self) -> int:
        """The most tokens a row stores above `b` before it is due (the `N` of the bound on `b`)."""
        return self.interval

    @property
    def nominal(self) -> int | None:
        """`b`: tokens per (layer, KV head) right after a compaction."""
        if self.budget is None:
            return None
        return nominal_budget(self.budget, self.span, self.accounting)

    def prepare(self, tokenizer) -> None:
        """Read what the cadence needs from the run's tokenizer (once per run; None in some tests)."""

    def params(self) -> dict:
        """This cadence's own parameters beyond the fixed cadence's (recorded in the configuration)."""
        return {}


    @property
    def prompt_rule(self) -> str:
        """One of PROMPT_RULES: "evict", "keep" (counted inside b), "keep-on-top" (on top of b)."""
        return "keep-on-top" if self.protect_prompt else "keep" if self.prompt_counted else "evict"

    def protected_prompt(self, prompt_length: int, k: int) -> int:
        """How many leading prompt positions a compaction that keeps `k` tokens protects."""
        if self.protect_prompt:
            return prompt_length
        if self.prompt_counted:
            return max(0, min(prompt_length, k - self.recent - 1))
        return 0

    def keep(self, prompt_length: int = 0) -> int:
        """Tokens a compaction keeps: `b`, plus the whole prompt with `protect_prompt`."""
        return self.nominal + (prompt_length if self.protect_prompt else 0)

    def due(self, stored: int, prefill: bool, prompt_length: int = 0, token: int | None = None) -> bool:
        """Whether to compact now, given `stored` tokens per (layer, KV head) after a forward (with
        `protect_prompt` the prompt is never compacted at prefill and not counted against `b + N`);
        `token`: the id the forward just wrote (None at prefill)."""
        if self.budget is None:
            return False
        if self.protect_prompt:
            return not prefill and stored - prompt_length >= self.nominal + self.interval
        if prefill:
            return stored > self.nominal
        return stored >= self.nominal + self.interval
