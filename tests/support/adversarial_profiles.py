"""Hypothesis settings for the adversarial suite.

CI (the default) is derandomized (a fixed seed per test, no example database): the same examples every run,
so a run cannot flake. ``PAGEDKV_ADVERSARIAL=long`` explores with fresh randomness and many more examples
(run it locally after touching page accounting or the API's validation).
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

LONG = os.environ.get("PAGEDKV_ADVERSARIAL", "") == "long"


def profile(ci_examples: int, long_examples: int, **kw) -> settings:
    return settings(
        max_examples=long_examples if LONG else ci_examples,
        derandomize=not LONG,
        database=None,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much],
        print_blob=True,
        **kw,
    )
