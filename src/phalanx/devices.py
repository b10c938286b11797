"""Device lists: parse what the user wrote, check that every device exists, before launch.

Labels are strings such as ``cpu``, ``cpu:1`` or ``cuda:0``. ``cpu:N`` names the N-th CPU
worker (several CPU workers share the host's cores: for tests and CPU-only machines).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from phalanx.errors import (
    DeviceBusyError,
    DeviceSpecError,
    DeviceUnavailableError,
    DuplicateDeviceError,
    MixedDeviceTypesError,
    NoDevicesError,
)

DeviceSpec = str | torch.device | Sequence[str | torch.device]
SUPPORTED_TYPES = ("cpu", "cuda", "mps", "xpu")  # torch device types a label may name


def parse_devices(spec: DeviceSpec) -> list[str]:
    """``"cpu:0,cpu:1"``, ``["cuda:0", "cuda:1"]``, ``"auto"`` -> canonical labels, checked."""
    if isinstance(spec, str | torch.device):
        items: list[str | torch.device] = [p for p in str(spec).split(",") if p.strip()]
    else:
        items = list(spec)
    labels = [_canonical(item) for item in items]
    if labels == ["auto"]:
        labels = auto_devices()
    if not labels:
        raise NoDevicesError('no devices were given; pass devices="cpu", "cuda:0,cuda:1" or "auto"')
    seen: set[str] = set()
    for label in labels:
        if label in seen:
            raise DuplicateDeviceError(
                f"device {label} is listed twice in {labels}; list each device once "
                '(for several CPU workers write "cpu:0,cpu:1")'
            )
        seen.add(label)
        check_available(label)
    return labels


def auto_devices() -> list[str]:
    """Every visible GPU, or one CPU."""
    if torch.cuda.is_available() and torch.cuda.device_count() > 0:
        return [f"cuda:{i}" for i in range(torch.cuda.device_count())]
    return ["cpu"]


def _canonical(item: str | torch.device) -> str:
    text = str(item).strip().lower()
    if text == "auto":
        return text
    try:
        dev = torch.device(text)
    except RuntimeError as exc:
        raise DeviceSpecError(
            f"cannot read device {str(item)!r} ({exc}); write e.g. cpu, cpu:1, cuda:0 or auto"
        ) from None
    if dev.type not in SUPPORTED_TYPES:
        raise DeviceSpecError(
            f"device type {dev.type!r} is not supported; use one of {', '.join(SUPPORTED_TYPES)} "
            "(e.g. cpu, cpu:1, cuda:0) or auto"
        )
    if dev.type == "cuda" and dev.index is None:
        return "cuda:0"
    return text if dev.index is not None else dev.type


def check_available(label: str) -> None:
    dev = torch.device(label)
    if dev.type != "cuda":
        return
    if not torch.cuda.is_available():
        raise DeviceUnavailableError(
            f"device {label} was asked for but CUDA is not available here "
            f'(torch {torch.__version__}); use devices="cpu" or install a CUDA build of torch'
        )
    count = torch.cuda.device_count()
    if dev.index is not None and dev.index >= count:
        raise DeviceUnavailableError(
            f"device {label} does not exist: this machine has {count} GPU(s) "
            f"(cuda:0..cuda:{count - 1}); check CUDA_VISIBLE_DEVICES and the device list"
        )


def check_free_memory(labels: list[str], min_free_bytes: int | None) -> None:
    """Name a CUDA device whose free memory is below ``min_free_bytes`` before launch."""
    if not min_free_bytes:
        return
    for label in labels:
        dev = torch.device(label)
        if dev.type != "cuda":
            continue
        free, total = torch.cuda.mem_get_info(dev)
        if free < min_free_bytes:
            raise DeviceBusyError(
                f"device {label} has {free / 2**30:.1f} GiB free of {total / 2**30:.1f} GiB, "
                f"less than min_free_memory={min_free_bytes / 2**30:.1f} GiB: another process "
                "is using it (see nvidia-smi); pick another device or free it"
            )


def check_one_backend(labels: list[str]) -> None:
    """Under ddp every worker joins one process group whose backend follows its device
    (NCCL for CUDA, gloo for the others): a list mixing CUDA and other devices cannot
    form one group, so it is refused before launch."""
    cuda = [label for label in labels if torch.device(label).type == "cuda"]
    other = [label for label in labels if label not in cuda]
    if cuda and other:
        cpus = ",".join(f"cpu:{i}" for i in range(len(labels)))
        raise MixedDeviceTypesError(
            f'strategy="ddp" cannot mix CUDA and other devices in one run '
            f"({', '.join(labels)}): {', '.join(cuda)} would join the group over NCCL and "
            f"{', '.join(other)} over gloo, so the workers could never form one group; "
            f'list only CUDA devices (devices="{",".join(cuda)}") or only CPU workers '
            f'(devices="{cpus}")'
        )


def torch_device(label: str) -> torch.device:
    """The torch device for a label (``cpu:3`` -> ``cpu``)."""
    dev = torch.device(label)
    return torch.device("cpu") if dev.type == "cpu" else dev
