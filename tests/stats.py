"""Chi-square goodness of fit on the support of an exact distribution."""

import numpy as np
from scipy.stats import chisquare


def chi2_pvalue(counts, probs) -> float:
    """counts, probs: 1-D arrays over the same outcomes. Outcomes with probability 0 must have count 0."""
    counts = np.asarray(counts, dtype=np.float64)
    probs = np.asarray(probs, dtype=np.float64)
    assert counts[probs <= 0].sum() == 0, "drew an outcome the exact distribution gives probability 0"
    support = probs > 0
    expected = probs[support] / probs[support].sum() * counts.sum()
    return float(chisquare(counts[support], expected).pvalue)
