"""The devices a model is cut across, read from the spec's resources."""

from __future__ import annotations

from dataclasses import dataclass

from mixle_compile.spec.models import Resources

# Without any stated throughput every device is equally fast; the bottleneck is then in units
# of work, not seconds.
EQUAL_THROUGHPUT = 1.0


@dataclass(frozen=True)
class Device:
    """One device in rank order: its memory and its throughput (FLOP/s, or relative when not stated)."""

    rank: int
    kind: str
    memory_bytes: int
    throughput: float
    throughput_stated: bool = True
    name: str | None = None  # a mixle DeviceSpec's name, when the device came from one

    @property
    def label(self) -> str:
        return self.name or f"{self.kind}#{self.rank}"


def devices_from_resources(resources: Resources) -> tuple[Device, ...]:
    """One :class:`Device` per device of ``resources``, in rank order.

    A device without a stated throughput counts as equal to the others: 1.0 when none states
    one, else the slowest stated throughput (a cut must not lean on speed nobody promised).
    """
    groups = resources.device_list()
    stated = [g.throughput for g in groups if g.throughput is not None]
    fill = min(stated) if stated else EQUAL_THROUGHPUT
    return tuple(
        Device(
            rank=rank,
            kind=g.kind,
            memory_bytes=g.memory,
            throughput=g.throughput if g.throughput is not None else fill,
            throughput_stated=g.throughput is not None,
        )
        for rank, g in enumerate(groups)
    )
