"""When speculation pays, and how many tokens to propose (docs/SPECULATIVE.md has the rule in words).

Costs are measured: the target forward time of decode steps is fitted as t = a + b n + o s, n the tokens of the
step and s = 1 when it verifies drafts (the batch leaves the one-token-per-request path: a fixed price o), plus
the proposer's seconds per draft token d. In tokens of plain throughput (a plain step of N requests yields N
tokens in a + b N seconds): one more draft token costs c = (b + d) N / (a + b N), verifying at all costs
O = o N / (a + b N). Gains are estimated: per request, an acceptance rate alpha (exponentially weighted
accepted / tried drafts); with i.i.d. acceptance k drafts yield E(alpha, k) = (1 - alpha^(k+1)) / (1 - alpha)
tokens, E - 1 more than a plain step. Each request takes k = argmax E(alpha, k) - 1 - c k, and the step
speculates only if the summed gains beat O. Large batches push c towards 1, where no acceptance rate short of
certainty gains, so the whole batch stops by itself, and starts again when the batch shrinks.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

PRIOR_ALPHA = 0.6          # acceptance rate assumed for a request that has not been verified yet
PRIOR_WEIGHT = 2.0         # ... worth this many draft tokens of evidence
DECAY = 0.8                # weight kept by old evidence at each verification of the request
RECOVERY = 0.97            # weight kept by old evidence at each step a request spends off (probing drift)
COST_DECAY = 0.95          # weight kept by old step timings at each new one
PRIOR_B_OVER_T = 0.05      # per-token cost of a decode step relative to the whole step, until measured


def expected_tokens(alpha: float, k: int) -> float:
    """Tokens one verification of k i.i.d.-accepted drafts emits: 1 + alpha + ... + alpha^k."""
    if alpha >= 1.0:
        return k + 1.0
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


def net_gain(alpha: float, k: int, cost_per_token: float) -> float:
    return expected_tokens(alpha, k) - 1.0 - cost_per_token * k


def best_k(alpha: float, cost_per_token: float, max_k: int) -> int:
    """argmax_k E(alpha, k) - 1 - c k over 0..max_k (0: speculation does not pay)."""
    return max(range(max_k + 1), key=lambda k: (net_gain(alpha, k, cost_per_token), -k))


@dataclass
class Acceptance:
    """Exponentially weighted accepted and tried drafts of one request."""

    accepted: float = PRIOR_ALPHA * PRIOR_WEIGHT
    tried: float = PRIOR_WEIGHT

    @property
    def alpha(self) -> float:
        return self.accepted / self.tried

    def update(self, num_drafts: int, num_accepted: int) -> None:
        """k drafts, a accepted: a successes in a + 1 trials (a < k) or k in k (all accepted)."""
        self.accepted = DECAY * self.accepted + num_accepted
        self.tried = DECAY * self.tried + num_accepted + (num_accepted < num_drafts)

    def recover(self) -> None:
        """Drift back towards the prior while off, so a request is probed again now and then."""
        self.accepted = RECOVERY * self.accepted + (1 - RECOVERY) * PRIOR_ALPHA * PRIOR_WEIGHT
        self.tried = RECOVERY * self.tried + (1 - RECOVERY) * PRIOR_WEIGHT


class StepCost:
    """t = a + b n + o s by exponentially weighted least squares over decode steps, with a weak prior
    (b = 5% of a step, o = 0) that settles what the data cannot: n that never varies, steps of one kind only."""

    def __init__(self) -> None:
        self.xtx = np.zeros((3, 3))
        self.xty = np.zeros(3)
        self.weight = self.seconds = 0.0

    def observe(self, num_tokens: int, seconds: float, verified: bool) -> None:
        x = np.array([1.0, num_tokens, float(verified)])
        g = COST_DECAY
        self.xtx = g * self.xtx + np.outer(x, x)
        self.xty = g * self.xty + x * seconds
        self.weight, self.seconds = g * self.weight + 1, g * self.seconds + seconds

    def fit(self) -> tuple[float, float, float] | None:
        """(a, b, o) in seconds, None before any decode step."""
        if self.weight == 0:
            return None
        prior = np.array([0.0, PRIOR_B_OVER_T * self.seconds / self.weight, 0.0])
        ridge = np.diag([0.0, 0.1, 0.1])   # a tenth of one observation
        a, b, o = np.linalg.solve(self.xtx + ridge, self.xty + ridge @ prior)
        return float(a), max(float(b), 0.0), max(float(o), 0.0)

    def costs(self, num_seqs: int, draft_seconds_per_token: float) -> tuple[float, float]:
        """(c, O): one more draft token, and verifying at all, in tokens of plain throughput."""
        fit = self.fit()
        if fit is None:
            return PRIOR_B_OVER_T * num_seqs, 0.0
        a, b, o = fit
        unit = max(a + b * num_seqs, 1e-9) / num_seqs   # seconds per token of a plain step
        return (b + draft_seconds_per_token) / unit, o / unit
