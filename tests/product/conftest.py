"""Product tier: Spillway installed from its images and chart on the real nodes, with
engine pods that are real containers of the engine image (tests/product).

It shares the real-nodes tier's cluster fixtures (one real-node cluster per machine,
in one fixed folder; it fails, never skips, when it cannot run). It is its own tier,
run by ``make test-product`` and not by ``make test``: loading the 10 GB engine image
into both nodes and starting real engines on 2 cores takes 15-20 minutes, which CI's
90-minute budget does not hold beside the other tiers (README, "Tests").
"""

from tests.nodes.conftest import (  # noqa: F401 -- fixtures and the summary hook, shared
    api,
    core,
    namespace,
    pytest_terminal_summary,
    real_cluster,
    tier_lock,
)
