"""runtime.dtype auto: bf16 only where the hardware computes it; float32 where it would be emulated."""

import pytest
import torch

from avatar_cli.errors import InputError
from avatar_cli.runtime import device
from avatar_cli.runtime.device import CpuInfo, auto_dtype, resolve_runtime

AVX2_ZEN3 = CpuInfo(capability="AVX2", avx512_bf16=False, amx=False)
ZEN4 = CpuInfo(capability="AVX512", avx512_bf16=True, amx=False)
SAPPHIRE_RAPIDS = CpuInfo(capability="AVX512", avx512_bf16=True, amx=True)
SKYLAKE_X = CpuInfo(capability="AVX512", avx512_bf16=False, amx=False)
# The flag is there but torch's kernels were capped below AVX-512 (ATEN_CPU_CAPABILITY=avx2): bf16 is emulated.
CAPPED = CpuInfo(capability="AVX2", avx512_bf16=True, amx=True)


@pytest.mark.parametrize("cpu, want", [(AVX2_ZEN3, torch.float32), (SKYLAKE_X, torch.float32), (CAPPED, torch.float32),
                                       (ZEN4, torch.bfloat16), (SAPPHIRE_RAPIDS, torch.bfloat16)])
def test_auto_picks_bf16_only_where_native(cpu, want):
    dtype, reason = auto_dtype("cpu", cpu)
    assert dtype == want
    assert cpu.capability in reason  # the log line and the done event say what the choice was made on


def test_auto_on_cuda_is_bf16():
    assert auto_dtype("cuda")[0] == torch.bfloat16


@pytest.mark.parametrize("cpu, want", [(AVX2_ZEN3, torch.float32), (ZEN4, torch.bfloat16)])
def test_resolve_runtime_uses_what_the_cpu_reports(monkeypatch, cpu, want):
    monkeypatch.setattr(device, "cpu_info", lambda: cpu)
    rt = resolve_runtime("cpu", "auto")
    assert rt.dtype == want and rt.dtype_reason.startswith("auto: ")
    # An explicit dtype is taken as asked, whatever the CPU.
    assert resolve_runtime("cpu", "bfloat16").dtype == torch.bfloat16
    assert resolve_runtime("cpu", "float32").dtype_reason == "asked for"


def test_float16_on_cpu_is_refused():
    with pytest.raises(InputError, match="float16 is not supported on CPU"):
        resolve_runtime("cpu", "float16")


def test_cpu_info_reads_torch():
    info = device.cpu_info()
    assert info.capability == torch.backends.cpu.get_cpu_capability()
    assert info.native_bf16 == (info.capability.startswith("AVX512") and (info.avx512_bf16 or info.amx))


def test_threads_0_restores_the_start_count_after_a_job_that_set_one():
    """A batch (or a test session) renders jobs in one process: runtime.threads: 0 after a job with threads: 1 must
    not inherit that 1 (the thread count changes the order of float sums, and so the frames)."""
    import torch

    from avatar_cli.runtime import device

    start = device._START_THREADS
    try:
        device.resolve_runtime("cpu", "float32", 1)
        assert torch.get_num_threads() == 1
        device.resolve_runtime("cpu", "float32", 0)
        assert torch.get_num_threads() == start
    finally:
        torch.set_num_threads(start)


def test_one_cpu_thread_runs_its_block_on_one_thread_and_restores_the_count_even_on_error():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        with device.one_cpu_thread():
            assert torch.get_num_threads() == 1
        assert torch.get_num_threads() == 2
        with pytest.raises(RuntimeError), device.one_cpu_thread():
            raise RuntimeError("a load that fails")
        assert torch.get_num_threads() == 2
        with device.one_cpu_thread(on=False):  # a GPU job, or a load that computes: the job's count
            assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
