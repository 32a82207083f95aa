"""One conformance case's result: the checks it made and the ones that failed (`retention conformance`).

Shared by the scorer cases (`retention.runs.conformance`), the random control's
(`conformance_random`) and the allocating routings' (`conformance_routing`), so that none of them
imports another for the result type.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch


@dataclass
class CaseResult:
    """One case: its name, the scorer, every check made and the ones that failed."""

    name: str
    scorer: str
    checks: list[str] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)
    worst: float = 0.0  # the largest score error as a fraction of its tolerance
    exact: bool = False  # every check is an exact comparison (the routing cases): no tolerance to report
    summary: str | None = None  # what a passing case says instead (the random control: structure, not draws)

    @property
    def ok(self) -> bool:
        return bool(self.checks) and not self.failures

    def line(self) -> str:
        head = f"{'PASS' if self.ok else 'FAIL'} {self.name} ({self.scorer}): {len(self.checks)} checks"
        if not self.ok:
            return head + "; " + ("; ".join(self.failures) if self.failures else "nothing was checked")
        if self.summary:
            return head + ", " + self.summary
        if self.exact:
            return head + ", every budget and kept slot exact"
        return head + f", worst score error {self.worst:.2f} of its tolerance"

    # -- comparisons --------------------------------------------------------------------------

    def close(self, what: str, got: torch.Tensor, want: torch.Tensor, atol: float | torch.Tensor) -> None:
        """Scores: same shape and |got - want| <= atol everywhere; atol is one number or a tensor that
        broadcasts against the scores (a tolerance per head)."""
        self.checks.append(what)
        got, want = got.detach().double().cpu(), want.detach().double().cpu()
        if got.shape != want.shape:
            self.failures.append(f"{what}: shape {tuple(got.shape)} != reference {tuple(want.shape)}")
            return
        if not isinstance(atol, torch.Tensor):
            err = float((got - want).abs().max()) if got.numel() else 0.0
            if not err <= atol:  # also catches NaN
                self.failures.append(f"{what}: max |error| {err:.3g} > {atol:.3g}")
            self.worst = max(self.worst, err / atol if atol > 0 else (0.0 if err == 0 else math.inf))
            return
        diff = (got - want).abs()
        tol = atol.double().cpu().expand_as(diff)
        ratio = diff / tol
        if not got.numel():
            return
        at = int(torch.nan_to_num(ratio, nan=math.inf).reshape(-1).argmax())
        worst = float(ratio.reshape(-1)[at])
        if not bool((diff <= tol).all()):  # also catches NaN
            self.failures.append(f"{what}: |error| {float(diff.reshape(-1)[at]):.3g} > its head's tolerance "
                                 f"{float(tol.reshape(-1)[at]):.3g}")
        self.worst = max(self.worst, worst if worst == worst else math.inf)

    def kept(self, what: str, got: torch.Tensor, want: torch.Tensor, keep_class: torch.Tensor | None = None,
             tie_quota: torch.Tensor | None = None) -> None:
        """Kept slots `[..., k]` (any order) against the reference's `[..., k]`.

        keep_class `[..., c]` covers slots `0..c-1` (the scored candidates): class 2 must be kept,
        class 0 dropped, exactly `tie_quota` of class 1 kept. Every slot outside class 1 (the window,
        and every slot of a case without classes) must match the reference's kept set exactly.
        """
        self.checks.append(what)
        got, want = got.cpu().long(), want.cpu().long()
        if got.shape != want.shape:
            self.failures.append(f"{what}: {tuple(got.shape)} kept, reference {tuple(want.shape)}")
            return
        if got.numel() and int(min(got.min(), want.min())) < 0:
            self.failures.append(f"{what}: negative slot index")
            return
        n = int(max(got.max(), want.max())) + 1 if got.numel() else 0
        if keep_class is not None:
            n = max(n, keep_class.shape[-1])
        g_mask = torch.zeros(*got.shape[:-1], n, dtype=torch.bool).scatter_(-1, got, True)
        w_mask = torch.zeros_like(g_mask).scatter_(-1, want, True)
        if int(g_mask.sum(-1).min()) != got.shape[-1]:
            self.failures.append(f"{what}: a slot is kept twice")
            return
        problems = []
        if keep_class is None:
            if not torch.equal(g_mask, w_mask):
                problems.append(f"kept set differs from the reference in {int((g_mask ^ w_mask).sum())} slots")
        else:
            cls = keep_class.cpu().long()
            c = cls.shape[-1]
            gc = g_mask[..., :c]
            if bool((gc & (cls == 0)).any()):
                problems.append(f"{int((gc & (cls == 0)).sum())} slot(s) below the reference's k-th score kept")
            if bool((~gc & (cls == 2)).any()):
                problems.append(f"{int((~gc & (cls == 2)).sum())} slot(s) above the reference's k-th score dropped")
            if tie_quota is not None and not torch.equal((gc & (cls == 1)).sum(-1), tie_quota.cpu().long()):
                problems.append("tied boundary slots kept in a number other than tie_quota")
            if not torch.equal(g_mask[..., c:], w_mask[..., c:]):
                problems.append("window slots differ from the reference")
            # Outside the tie group the reference's own set is determined: it must match too.
            untied = torch.ones_like(g_mask)
            untied[..., :c] = cls != 1
            if not problems and not torch.equal(g_mask & untied, w_mask & untied):
                problems.append("kept set differs from the reference outside the tied boundary slots")
        if problems:
            self.failures.append(f"{what}: " + ", ".join(problems))

    def fail(self, message: str) -> None:
        self.failures.append(message)


# --------------------------------------------------------------------------------------------
# Loading
# --------------------------------------------------------------------------------------------
