"""Where and in what precision the models run."""

from dataclasses import dataclass

import torch

from avatar_cli.errors import InputError
from avatar_cli.spec import RuntimeSpec

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class Runtime:
    device: torch.device
    dtype: torch.dtype

    @property
    def is_cuda(self) -> bool:
        return self.device.type == "cuda"

    def synchronize(self) -> None:
        if self.is_cuda:
            torch.cuda.synchronize(self.device)


def resolve_runtime(spec: RuntimeSpec) -> Runtime:
    device = spec.device.value
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    elif device == "cuda" and not torch.cuda.is_available():
        raise InputError("runtime.device: cuda was asked for but no CUDA device is available")
    if device == "cpu" and spec.threads > 0:
        torch.set_num_threads(spec.threads)
    # bf16 is the fast path on both: ~4x fp32 matmul throughput on this class of CPU, tensor cores on GPU.
    dtype = torch.bfloat16 if spec.dtype.value == "auto" else _DTYPES[spec.dtype.value]
    if device == "cpu" and dtype == torch.float16:
        raise InputError("runtime.dtype: float16 is not supported on CPU; use bfloat16 or float32")
    return Runtime(torch.device(device), dtype)
