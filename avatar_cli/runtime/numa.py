"""Bind the process to the CPUs of its GPU's NUMA node, before any pinned memory is allocated.

Pinned host buffers are allocated on the node the allocating thread runs on; host-to-device copies
from the far node cross the socket interconnect. The lookup is done by hand through sysfs (torchrun's
--numa-binding needs numactl): PCI address -> numa_node -> that node's cpulist -> sched_setaffinity.
Where anything is unknown, nothing changes and one line is logged.
"""

import logging
import os
from pathlib import Path

import torch

log = logging.getLogger(__name__)


def parse_cpulist(text: str) -> set[int]:
    """'0-3,8,10-11' -> {0, 1, 2, 3, 8, 10, 11} (the kernel's cpulist format; may be empty)."""
    cpus: set[int] = set()
    for part in text.strip().split(","):
        if not part:
            continue
        lo, _, hi = part.partition("-")
        cpus.update(range(int(lo), int(hi or lo) + 1))
    return cpus


def pci_address(domain: int, bus: int, device: int, function: int = 0) -> str:
    """sysfs spelling of a PCI address: '0000:3b:00.0'."""
    return f"{domain:04x}:{bus:02x}:{device:02x}.{function:x}"


def numa_node(address: str, sysfs: Path = Path("/sys")) -> int | None:
    """The device's NUMA node; -1 (no affinity reported, e.g. a one-node machine) means node 0."""
    try:
        node = int((sysfs / "bus/pci/devices" / address / "numa_node").read_text().strip())
    except (OSError, ValueError):
        return None
    return max(node, 0)


def node_cpus(node: int, sysfs: Path = Path("/sys")) -> set[int]:
    try:
        return parse_cpulist((sysfs / f"devices/system/node/node{node}/cpulist").read_text())
    except OSError:
        return set()


def gpu_cpus(device_index: int, sysfs: Path = Path("/sys")) -> tuple[str, int | None, set[int]]:
    """(pci address, node, cpus) for a CUDA device; node None and no cpus where unknown."""
    props = torch.cuda.get_device_properties(device_index)
    address = pci_address(props.pci_domain_id, props.pci_bus_id, props.pci_device_id)
    node = numa_node(address, sysfs)
    return address, node, node_cpus(node, sysfs) if node is not None else set()


def bind_to_gpu_node(device: torch.device, sysfs: Path = Path("/sys")) -> set[int] | None:
    """Restrict this process to the GPU's node's CPUs (those it may use at all). Returns them, or None."""
    if device.type != "cuda":
        return None
    address, node, cpus = gpu_cpus(device.index if device.index is not None else torch.cuda.current_device(), sysfs)
    allowed = cpus & os.sched_getaffinity(0)
    if not allowed:
        log.info("numa: node of GPU %s (%s) unknown or has no usable CPUs; affinity unchanged", device, address)
        return None
    os.sched_setaffinity(0, allowed)
    log.info("numa: GPU %s (%s) on node %d; bound to %d CPUs", device, address, node, len(allowed))
    return allowed
