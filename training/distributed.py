"""Process-launch helpers shared by the scripts that start training runs (comparison, distributed parity).

`SAFE_COLLECTIVES_ENV` turns off NVLink SHARP / multicast in NCCL, torch symmetric memory and NVSHMEM: on the
H200 hosts we run on, multicast objects are not available to containers and collectives that try them fail or hang
at start-up. The plain ring/tree algorithms are what the parity and scaling numbers are measured with.
"""

from __future__ import annotations

SAFE_COLLECTIVES_ENV = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}
