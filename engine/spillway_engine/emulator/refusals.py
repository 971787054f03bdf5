"""Plans vLLM 0.33.0 cannot run on the emulated GPU.

``spillway-engine serve --emulate-gpu`` refuses them before vLLM starts, with the
reason in one line (exit status 2), instead of an engine-core traceback a minute
later. Each reason is outside Spillway: a vLLM code path that needs a real device.
``tests/contract/test_emulated_families.py`` starts every other planned architecture
on the emulated GPU and asserts this table is exactly the set that cannot start.
"""

from __future__ import annotations

from spillway_engine.planner.plan import Plan

#: What vLLM 0.33.0 cannot do on the emulated GPU: its own offloader's CPU worker gates
#: on the platform, asserts CUDA tensors and copies with CUDA streams.
UPSTREAM_OFFLOADER = ("vLLM's own offloader (plan offloader upstream), whose CPU offloading "
                      "worker vLLM 0.33.0 runs only on CUDA-alike and XPU GPUs")

#: architecture (config.json ``architectures[0]``) -> why the emulated GPU cannot run it
REFUSED: dict[str, str] = {
    # Spillway's offloader cannot re-cut groups coarser than DeepSeek-V4's 4-token
    # compressor-state blocks (the planner says so): every plan of it is upstream's.
    "DeepseekV4ForCausalLM": "every plan of it runs " + UPSTREAM_OFFLOADER,
}


def refusal(plan: Plan, offload_enabled: bool = True) -> str | None:
    """One line saying why ``plan`` cannot run on the emulated GPU, or None: an
    architecture it cannot build, or (offloading on) vLLM's own offloader."""
    architecture = plan.model.architecture
    reason = REFUSED.get(architecture)
    if reason is None and offload_enabled and plan.offloader == "upstream":
        reason = (UPSTREAM_OFFLOADER + "; plan with offloader spillway, or turn offloading "
                  "off")
    if reason is None:
        return None
    return (
        f"the emulated GPU cannot run {architecture} as planned: {reason} "
        "(it is served on real GPUs; see spillway_engine/emulator/refusals.py)"
    )
