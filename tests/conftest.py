"""Shared pytest configuration.

This directory holds no ``__init__.py``; pytest's default import mode puts it on ``sys.path``
because of this file, so test modules import shared helpers such as ``net_conformance`` directly.
"""

from hypothesis import HealthCheck, settings

# Tests never assert on wall-clock speed: hypothesis' per-example deadline and its "too slow"
# health checks are exactly that, and fail on a loaded 2-core machine.  Tests keep their own
# max_examples; only the timing checks are off for every property test.
settings.register_profile(
    "pccl", deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.load_profile("pccl")
