"""Which backend a worker runs on (runtime.backend, allow_cpu_fallback) and how the cuda
client's allocator is set (mem_fraction, preallocate): the decision is pure and tested here
with each possible probe; the probe and the client set-up are tested on this machine's jax."""
from __future__ import annotations

from importlib import metadata

import pytest

from xlaserve.config import RuntimeConfig
from xlaserve.errors import StartupError
from xlaserve.runtime.backend import plan_backend
from xlaserve.runtime.pjrt import CudaProbe, Device, configure_client, cuda_client_options, probe_cuda

NOT_INSTALLED = CudaProbe(False, 0, "jax's CUDA plugin is not installed")
NO_GPU = CudaProbe(True, 0, "jax's CUDA plugin sees no GPU (check the NVIDIA driver and CUDA_VISIBLE_DEVICES)")
TWO_GPUS = CudaProbe(True, 2, "")


def refusal(runtime: RuntimeConfig, probe: CudaProbe) -> str:
    with pytest.raises(StartupError) as caught:
        plan_backend(runtime, probe)
    return str(caught.value)


def test_cuda_allocator_options_are_the_bfc_pool_from_mem_fraction_and_preallocate():
    assert cuda_client_options(0.6, False) == {"allocator": "bfc", "memory_fraction": 0.6, "preallocate": False}
    assert cuda_client_options(1, True) == {"allocator": "bfc", "memory_fraction": 1.0, "preallocate": True}


def test_usable_cuda_gets_the_allocator_settings_and_nothing_to_say():
    plan = plan_backend(RuntimeConfig(backend="cuda", mem_fraction=0.6, preallocate=False), TWO_GPUS)
    assert plan.backend == "cuda"
    assert dict(plan.client_options) == {"allocator": "bfc", "memory_fraction": 0.6, "preallocate": False}
    assert plan.notes == () and plan.warning == ""


def test_cuda_without_the_plugin_is_refused_in_one_line_naming_the_key_and_the_fix():
    message = refusal(RuntimeConfig(backend="cuda"), NOT_INSTALLED)
    assert message.startswith("runtime.backend: cuda is not available: jax's CUDA plugin is not installed; ")
    assert 'pip install ".[cuda]"' in message and "runtime.allow_cpu_fallback: true" in message
    assert "\n" not in message


def test_cuda_without_a_gpu_is_refused_naming_what_the_plugin_saw():
    message = refusal(RuntimeConfig(backend="cuda", mem_fraction=0.5), NO_GPU)
    assert message.startswith("runtime.backend: cuda is not available: jax's CUDA plugin sees no GPU")
    assert ".[cuda]" not in message, "the plugin is installed: installing it again fixes nothing"
    assert "runtime.allow_cpu_fallback: true" in message and "\n" not in message


@pytest.mark.parametrize("probe", [NOT_INSTALLED, NO_GPU])
def test_fallback_runs_on_cpu_with_one_warning_naming_why(probe):
    plan = plan_backend(RuntimeConfig(backend="cuda", allow_cpu_fallback=True), probe)
    assert plan.backend == "cpu" and dict(plan.client_options) == {}
    assert plan.warning.startswith(f"runtime.backend: cuda is not available ({probe.problem}); running on the cpu")
    assert plan.notes == (), "default allocator keys have nothing to say"


def test_usable_cuda_ignores_allow_cpu_fallback():
    assert plan_backend(RuntimeConfig(backend="cuda", allow_cpu_fallback=True), TWO_GPUS).backend == "cuda"


def test_cpu_with_default_allocator_keys_says_nothing():
    plan = plan_backend(RuntimeConfig())
    assert (plan.backend, dict(plan.client_options), plan.notes, plan.warning) == ("cpu", {}, (), "")


@pytest.mark.parametrize("runtime, note", [
    (RuntimeConfig(mem_fraction=0.5),
     "runtime.mem_fraction: 0.5 is not applicable on the cpu backend (it sizes the cuda device allocator); ignored"),
    (RuntimeConfig(preallocate=False, mem_fraction=0.25),
     "runtime.mem_fraction: 0.25, runtime.preallocate: false are not applicable on the cpu backend "
     "(they size the cuda device allocator); ignored"),
    (RuntimeConfig(backend="cuda", allow_cpu_fallback=True, preallocate=False),
     "runtime.preallocate: false is not applicable on the cpu backend (it sizes the cuda device allocator); "
     "ignored"),
])
def test_cpu_notes_non_default_allocator_keys_once(runtime, note):
    assert plan_backend(runtime, NO_GPU).notes == (note,)


def test_probe_reports_this_machine_truthfully():
    probe = probe_cuda()
    # the plugin's PJRT part ships as jax-cuda13-pjrt or jax-cuda12-pjrt (what jax[cuda] installs)
    installed = any(_distribution(name) for name in ("jax-cuda13-pjrt", "jax-cuda12-pjrt"))
    assert probe.installed == installed
    if not installed:
        assert probe == NOT_INSTALLED
    assert probe.usable == (probe.devices > 0) and probe.usable == (probe.problem == "")
    assert probe_cuda() is probe, "the probe is a fact about the process, found once"


def test_the_client_cannot_be_reconfigured_once_it_exists():
    Device("cpu")  # jax's clients now exist in this process
    with pytest.raises(RuntimeError, match="must run before the first Device"):
        configure_client("cuda", cuda_client_options(0.5, True))


def _distribution(name: str) -> bool:
    try:
        metadata.distribution(name)
    except metadata.PackageNotFoundError:
        return False
    return True
