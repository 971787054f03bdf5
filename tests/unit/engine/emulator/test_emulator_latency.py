"""The emulated GPU's step-time model (spillway_engine.emulator.latency): pure functions,
no vLLM or torch."""

from __future__ import annotations

import subprocess
import sys

import pytest

from spillway_engine.emulator import latency as lat

H100 = lat.gpu_profile("h100")
H200 = lat.gpu_profile("h200")
B8 = lat.ModelCost.of(8e9)  # an 8B model in bfloat16


def test_profiles_carry_the_datasheet_figures():
    assert H100.bf16_flops == H200.bf16_flops == pytest.approx(989.5e12)
    assert H100.hbm_bytes_per_s == pytest.approx(3.35e12)
    assert H200.hbm_bytes_per_s == pytest.approx(4.8e12)
    # PCIe Gen5 x16, per direction: 32 GT/s x 16 lanes x 128/130 / 8
    link = H100.host_link_bytes_per_s
    assert link == lat.PCIE_GEN5_X16_BYTES_PER_S == H200.host_link_bytes_per_s
    assert link == pytest.approx(63.0e9, rel=1e-3)
    assert lat.gpu_profile("H200") is H200  # plan names are matched case-insensitively
    assert lat.gpu_profile("l40s") is H100 and lat.gpu_profile(None) is H100


def test_prefill_is_compute_bound_and_linear_in_tokens():
    rate = lat.prefill_tokens_per_s(H100, B8)
    assert rate == pytest.approx(989.5e12 * 0.45 / 16e9)  # about 27.8k tokens/s
    assert 20_000 < rate < 40_000
    assert lat.prefill_s(8192, H100, B8) == pytest.approx(2 * lat.prefill_s(4096, H100, B8))
    # a long prompt's step is its compute time, the same on H100 and H200
    assert lat.step_s(8192, H100, B8) == pytest.approx(lat.prefill_s(8192, H100, B8))
    assert lat.step_s(8192, H200, B8) == pytest.approx(lat.step_s(8192, H100, B8))


def test_small_decode_batches_are_memory_bound():
    one = lat.decode_step_s(1, H100, B8)
    assert one == pytest.approx(16e9 / (3.35e12 * 0.8))  # about 6 ms: the weights once
    assert lat.decode_step_s(32, H100, B8) == pytest.approx(one)  # flat in batch size
    assert lat.decode_step_s(1, H200, B8) < one  # more bandwidth, faster decode
    # attention reads each sequence's KV: 1 GiB more read costs its bandwidth time
    assert lat.decode_step_s(1, H100, B8, kv_bytes_read=2**30) == pytest.approx(
        one + 2**30 / (3.35e12 * 0.8)
    )
    # a batch big enough turns compute-bound and grows with it
    big = 4096
    assert lat.decode_step_s(big, H100, B8) == pytest.approx(lat.prefill_s(big, H100, B8))
    assert lat.decode_step_s(2 * big, H100, B8) > lat.decode_step_s(big, H100, B8)


def test_model_size_scales_both_sides():
    b70 = lat.ModelCost.of(70e9)
    assert lat.step_s(8192, H100, b70) == pytest.approx(lat.step_s(8192, H100, B8) * 70 / 8)
    assert lat.decode_step_s(1, H100, b70) == pytest.approx(lat.decode_step_s(1, H100, B8) * 70 / 8)
    fp8 = lat.ModelCost.of(8e9, bytes_per_param=1)
    assert lat.decode_step_s(1, H100, fp8) == pytest.approx(lat.decode_step_s(1, H100, B8) / 2)
    assert lat.ModelCost() == B8  # the documented default
    assert lat.step_s(0, H100, B8) == 0.0  # nothing scheduled: no time


def test_transfer_time_is_bytes_over_the_link():
    assert lat.transfer_s(0, H100) == 0.0
    gib = lat.transfer_s(2**30, H100)
    assert gib == pytest.approx(2**30 / (63.0e9 * 0.8), rel=1e-3)  # about 21 ms
    assert lat.transfer_s(2**31, H200) == pytest.approx(2 * gib)


@pytest.mark.parametrize(
    ("text", "value"), [(None, 0.0), ("", 0.0), (" ", 0.0), ("0", 0.0), ("1", 1.0), ("2.5", 2.5)]
)
def test_speed_factor(text, value):
    assert lat.parse_speed(text) == value
    env = {} if text is None else {lat.ENV_SPEED: text}
    assert lat.speed_from_env(env) == value


@pytest.mark.parametrize("text", ["-1", "nan", "inf", "fast"])
def test_bad_speed_is_refused(text):
    with pytest.raises(ValueError):
        lat.parse_speed(text)


def test_model_params_override():
    assert lat.parse_params(None) is None and lat.parse_params("") is None
    assert lat.parse_params("8e9") == 8e9
    for bad in ("0", "-5", "inf", "x"):
        with pytest.raises(ValueError):
            lat.parse_params(bad)


def test_sleep_is_the_scaled_time_less_the_work_done():
    assert lat.sleep_for(0.010, 1.0) == pytest.approx(0.010)
    assert lat.sleep_for(0.010, 2.0, elapsed_s=0.005) == pytest.approx(0.015)
    assert lat.sleep_for(0.010, 1.0, elapsed_s=0.020) == 0.0  # already slower
    assert lat.sleep_for(5.0, 0.0) == 0.0  # factor 0: never sleeps


def test_the_module_imports_no_vllm_or_torch():
    code = (
        "import sys\n"
        "import spillway_engine.emulator.latency\n"
        "assert 'vllm' not in sys.modules and 'torch' not in sys.modules\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_the_emulator_plugs_its_link_and_counters_into_the_offloader(monkeypatch):
    """The offloader never imports the emulator: the emulator's platform plug-in, which
    vLLM calls in every process, installs the modelled host link and its counter."""
    from spillway_engine import emulator
    from spillway_engine.emulator import platform, plugin
    from spillway_engine.offloader import spec, stand_in

    monkeypatch.setattr(stand_in, "host_link", None)
    monkeypatch.setattr(stand_in, "counters", ())
    monkeypatch.delenv(emulator.ENV_EMULATE, raising=False)
    monkeypatch.delenv("SPILLWAY_PLAN", raising=False)
    assert plugin.platform_plugin() is None
    assert stand_in.link_seconds() is None and spec.stand_in_metric_definitions() == {}

    monkeypatch.setenv(emulator.ENV_EMULATE, "1")
    monkeypatch.setenv(emulator.ENV_GPU, "h100")
    platform.planned_gpu.cache_clear()
    assert plugin.platform_plugin() == emulator.PLATFORM_QUALNAME
    assert list(spec.stand_in_metric_definitions()) == ["spillway_emulator_kv_mismatch"]
    monkeypatch.setenv(emulator.ENV_SPEED, "0")
    assert stand_in.link_seconds() is None  # speed 0: copies finish at once
    monkeypatch.setenv(emulator.ENV_SPEED, "2")
    link = stand_in.link_seconds()
    assert link is not None
    assert link(2**30) == pytest.approx(2 * lat.transfer_s(2**30, lat.gpu_profile("h100")))
    platform.planned_gpu.cache_clear()
