"""The weight cache: which models' weights are on the device.

Owned by the dispatch loop (one task); nothing else calls it. This first version keeps every
model that has run resident; the byte budget and LRU eviction build on :meth:`ensure_resident`.
"""
from __future__ import annotations

from dataclasses import dataclass

import trio

from xlaserve.bundle import ModelVersion
from xlaserve.runtime.pjrt import Device


@dataclass(frozen=True, slots=True)
class Residency:
    """A snapshot of one model's device residency."""

    model: str
    version: int
    device_bytes: int


class WeightCache:
    def __init__(self, device: Device, limiter: trio.CapacityLimiter) -> None:
        self._device = device
        self._limiter = limiter
        self._resident: dict[tuple[str, int], tuple[object, ...]] = {}
        # Versions replaced or unloaded: requests admitted to them still run, on a transient copy.
        self._retired: set[tuple[str, int]] = set()
        self._floors: dict[str, str] = {}

    async def ensure_resident(self, model: ModelVersion) -> tuple[object, ...]:
        """The model's weights as device arrays, in binding order; copied on first use."""
        key = (model.name, model.version)
        arrays = self._resident.get(key)
        if arrays is None:
            host = model.weights.arrays if model.weights else ()
            arrays = await trio.to_thread.run_sync(self._copy, host, limiter=self._limiter)
            if key not in self._retired:
                self._resident[key] = arrays
        return arrays

    def _copy(self, host) -> tuple[object, ...]:
        return tuple(self._device.to_device(a, copy=True) for a in host)

    def release(self, name: str, version: int | None = None) -> None:
        """Forget a model's device copy (all versions when ``version`` is None)."""
        for key in [k for k in self._resident if k[0] == name and (version is None or k[1] == version)]:
            del self._resident[key]
            self._retired.add(key)
        if version is not None:
            self._retired.add((name, version))

    def set_residency(self, name: str, floor: str) -> None:
        """Record a model's residency floor (``device``, ``system`` or ``unpinned``). Minimal
        first version (issue 5): recorded and reported; the budgeted cache enforces it."""
        if floor not in ("device", "system", "unpinned"):
            raise ValueError(f"residency must be one of device, system, unpinned; got {floor!r}")
        self._floors[name] = floor

    def residency(self, name: str) -> str | None:
        return self._floors.get(name)

    async def compact(self) -> int:
        """Drop device copies of models not pinned with ``device`` and defragment; the bytes freed.
        Minimal first version (issue 5); the budgeted cache refines it."""
        freed = 0
        for key in [k for k in self._resident if self._floors.get(k[0]) != "device"]:
            freed += sum(self._device.device_bytes(a) for a in self._resident.pop(key))
        await trio.to_thread.run_sync(self._device.defragment, limiter=self._limiter)
        return freed

    def snapshot(self) -> tuple[Residency, ...]:
        return tuple(Residency(n, v, sum(self._device.device_bytes(a) for a in arrays))
                     for (n, v), arrays in self._resident.items())
