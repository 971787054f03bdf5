"""Architectures the planner plans that vLLM 0.33.0 cannot build on the emulated GPU.

``spillway-engine serve --emulate-gpu`` refuses them before vLLM starts, with the
reason in one line (exit status 2), instead of an engine-core traceback a minute
later. Each reason is outside Spillway: a vLLM code path that needs a real device.
``tests/contract/test_emulated_families.py`` starts every other planned architecture
on the emulated GPU and asserts this table is exactly the set that cannot start.
"""

from __future__ import annotations

#: architecture (config.json ``architectures[0]``) -> why the emulated GPU cannot run it
REFUSED: dict[str, str] = {
    # Every DeepSeek-V4 plan uses vLLM's own offloader (Spillway's cannot re-cut groups
    # coarser than its 4-token compressor-state blocks; the planner says so), and vLLM
    # 0.33's CPU offloading worker gates on the platform, asserts CUDA tensors and copies
    # with CUDA streams and its batched CUDA op.
    "DeepseekV4ForCausalLM": (
        "its plan runs vLLM's own offloader, whose CPU offloading worker vLLM 0.33.0 "
        "runs only on CUDA-alike and XPU GPUs"
    ),
}


def refusal(architecture: str) -> str | None:
    """One line saying why ``architecture`` cannot run on the emulated GPU, or None."""
    reason = REFUSED.get(architecture)
    if reason is None:
        return None
    return (
        f"the emulated GPU cannot run {architecture}: {reason} "
        "(it is planned and served on real GPUs; see spillway_engine/emulator/refusals.py)"
    )
