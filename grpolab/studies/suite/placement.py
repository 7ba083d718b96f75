"""Placing a suite's runs on devices: disjoint device sets, as many runs at once as fit, in the file's order.

A run starts when its devices are free and (for ``init_from``) its source run has completed. Runs start in
the suite file's order: a run waiting for devices holds back the runs after it (a large run is never
starved by small ones), while a run waiting for its source does not (the devices go on to later runs).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Sequence
from typing import Protocol

ONE_AT_A_TIME = "(one at a time)"  # the one "device" of a pool that places runs one at a time on what each sees
DEVICE_ID = re.compile(r"\d+|(GPU|MIG)-[0-9A-Za-z-]+")  # what CUDA_VISIBLE_DEVICES selects a device by


def parse_devices(text: str | Sequence[str | int]) -> list[str]:
    """'0,1,2,3' (or [0, 1, 2, 3]) -> ['0', '1', '2', '3']; one-line errors for an empty list, an id that is
    not a device index or a GPU-/MIG- UUID (-1 would hide every device from the run), or a repeat."""
    items = text.split(",") if isinstance(text, str) else [str(item) for item in text]
    devices = [item.strip() for item in items]
    if not devices or any(not device for device in devices):
        raise ValueError(f"devices {text!r}: give a comma-separated list of device ids, such as 0,1,2,3")
    bad = [device for device in devices if not DEVICE_ID.fullmatch(device)]
    if bad:
        raise ValueError(
            f"devices {text!r}: {', '.join(bad)} is not a device id (an index 0, 1, ... or a GPU- or "
            "MIG- UUID, as CUDA_VISIBLE_DEVICES takes them)"
        )
    repeated = sorted({device for device in devices if devices.count(device) > 1})
    if repeated:
        raise ValueError(f"devices {text!r}: {', '.join(repeated)} listed more than once")
    return devices


class DevicePool:
    """The suite's devices, each free or held by one run."""

    def __init__(self, devices: Sequence[str]):
        self.devices = list(devices)
        self.holder: dict[str, str] = {}

    def free(self) -> list[str]:
        return [device for device in self.devices if device not in self.holder]

    def take(self, run: str, count: int) -> list[str] | None:
        """The first ``count`` free devices in the list's order, now held by ``run``; None when fewer are free."""
        free = self.free()
        if len(free) < count:
            return None
        for device in free[:count]:
            self.holder[device] = run
        return free[:count]

    def hold(self, run: str, devices: Iterable[str]) -> None:
        """Mark ``devices`` held by ``run`` (a run found still training from an earlier runner); devices
        no longer in the list are ignored."""
        for device in devices:
            if device in self.devices:
                self.holder[device] = run

    def release(self, run: str) -> None:
        self.holder = {device: holder for device, holder in self.holder.items() if holder != run}


class Queued(Protocol):
    name: str
    init_from: str | None
    world_size: int


def next_to_start(queued: Sequence[Queued], completed: set[str], fits: Callable[[Queued], bool]) -> Queued | None:
    """The first queued run (in the file's order) that can start now: a run whose source has not completed
    is passed over; the first run that does not ``fit`` on the free devices blocks the rest."""
    for run in queued:
        if run.init_from is not None and run.init_from not in completed:
            continue
        return run if fits(run) else None
    return None
