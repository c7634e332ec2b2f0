"""PCIe byte counters from NVML, to cross-check the bytes the engine says it moved (TX: sent by
the GPU, RX: received by it). They count link bytes: packet headers, the read requests of
host-to-device copies, and every other transfer of the device, so they exceed the payload by a
known margin (LINK_* below). They wrap at 2^32 bytes, so a step that moves more than 4 GiB is
read by PcieSampler, which samples on a background thread and sums the wrapped deltas.
Everything returns None wherever pynvml or an NVIDIA GPU is missing; never raises for that."""

from __future__ import annotations

import dataclasses
import threading

COUNTER_MODULUS = 1 << 32
"""The counters wrap here: on the lent H100 (driver 580) a 4 GiB copy read as a delta of
-3.6 GiB between two plain reads."""

LINK_HEADER_BYTES_PER_COMPLETION = 20
"""Measured on the lent H100: RX = 1.078125 x host-to-device payload = 1 + 20/256, i.e. 20 B
per 256 B read completion; device-to-host copies add nothing to RX."""
LINK_HEADER_BYTES_PER_WRITE = 24
"""TX = 1.09375 x device-to-host payload = 1 + 24/256 (24 B per 256 B posted write)."""
LINK_REQUEST_BYTES_PER_READ = 24
"""Host-to-device copies also send 24 B of read request per 256 B fetched, on TX."""
LINK_PAYLOAD_BYTES = 256
"""Payload per packet (the PCIe max payload / read completion size on that machine)."""


@dataclasses.dataclass(frozen=True, slots=True)
class PcieBytes:
    tx_bytes: int
    """Bytes the GPU sent over PCIe (device to host) since the counter's origin."""
    rx_bytes: int
    """Bytes the GPU received (host to device)."""

    def __sub__(self, other: "PcieBytes") -> "PcieBytes":
        """Counter difference modulo the wrap (right if less than 4 GiB passed between)."""
        return PcieBytes((self.tx_bytes - other.tx_bytes) % COUNTER_MODULUS,
                         (self.rx_bytes - other.rx_bytes) % COUNTER_MODULUS)

    def __add__(self, other: "PcieBytes") -> "PcieBytes":
        return PcieBytes(self.tx_bytes + other.tx_bytes, self.rx_bytes + other.rx_bytes)

    @property
    def d2h_bytes(self) -> int:
        return self.tx_bytes

    @property
    def h2d_bytes(self) -> int:
        return self.rx_bytes


class PcieCounter:
    """An NVML handle kept open for repeated reads: `c = PcieCounter.open(); a = c.read(); ...;
    (c.read() - a).h2d_bytes`. `open` returns None where NVML or the device is unavailable."""

    def __init__(self, nvml, handle):
        self._nvml, self._handle = nvml, handle

    @classmethod
    def open(cls, device: int = 0, pci_bus_id: str | None = None) -> "PcieCounter | None":
        """By PCI bus id when given (CUDA and NVML may number devices differently), else by
        NVML index `device`."""
        try:
            import pynvml

            pynvml.nvmlInit()
            if pci_bus_id:
                handle = pynvml.nvmlDeviceGetHandleByPciBusId(pci_bus_id.encode())
            else:
                handle = pynvml.nvmlDeviceGetHandleByIndex(device)
        except Exception:  # noqa: BLE001 - no pynvml, no driver, no such device: no counters
            return None
        counter = cls(pynvml, handle)
        if counter.read() is None:
            counter.close()
            return None
        return counter

    def read(self) -> PcieBytes | None:
        nvml = self._nvml
        try:
            values = nvml.nvmlDeviceGetFieldValues(
                self._handle, [nvml.NVML_FI_DEV_PCIE_COUNT_TX_BYTES,
                               nvml.NVML_FI_DEV_PCIE_COUNT_RX_BYTES])
        except Exception:  # noqa: BLE001 - field unsupported on this device or driver
            return None
        if any(v.nvmlReturn != nvml.NVML_SUCCESS for v in values):
            return None
        return PcieBytes(tx_bytes=int(_value(nvml, values[0])),
                         rx_bytes=int(_value(nvml, values[1])))

    def close(self) -> None:
        try:
            self._nvml.nvmlShutdown()
        except Exception:  # noqa: BLE001 - shutting down a dead library is not an error
            pass


def _value(nvml, field) -> int:
    kinds = {nvml.NVML_VALUE_TYPE_UNSIGNED_LONG_LONG: "ullVal",
             nvml.NVML_VALUE_TYPE_UNSIGNED_LONG: "ulVal",
             nvml.NVML_VALUE_TYPE_UNSIGNED_INT: "uiVal",
             nvml.NVML_VALUE_TYPE_SIGNED_LONG_LONG: "sllVal"}
    return getattr(field.value, kinds.get(field.valueType, "ullVal"))


def pcie_counters(device: int = 0) -> PcieBytes | None:
    """One reading of NVML's PCIe TX/RX byte counters for NVML device `device`, or None when
    pynvml, the driver or the counters are unavailable."""
    counter = PcieCounter.open(device)
    if counter is None:
        return None
    try:
        return counter.read()
    finally:
        counter.close()


def expected_link_bytes(h2d_bytes: int, d2h_bytes: int) -> PcieBytes:
    """What the counters should read for these payloads under the LINK_* packet model:
    RX = h2d (1 + 20/256); TX = d2h (1 + 24/256) + h2d 24/256."""
    p = LINK_PAYLOAD_BYTES
    rx = h2d_bytes * (p + LINK_HEADER_BYTES_PER_COMPLETION) // p
    tx = (d2h_bytes * (p + LINK_HEADER_BYTES_PER_WRITE)
          + h2d_bytes * LINK_REQUEST_BYTES_PER_READ) // p
    return PcieBytes(tx_bytes=tx, rx_bytes=rx)


class PcieSampler:
    """Sums a PcieCounter's deltas over a window, reading it every `interval_s` on a daemon
    thread so no 4 GiB wrap is missed (at 64 GB/s the counter wraps every ~67 ms).
    `s = PcieSampler(counter); s.start(); ...; moved = s.stop()`."""

    def __init__(self, counter: PcieCounter, interval_s: float = 0.01):
        self.counter, self.interval_s = counter, interval_s
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._total = PcieBytes(0, 0)
        self._last = self.counter.read()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="pcie-sampler", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._sample()

    def _sample(self) -> None:
        now = self.counter.read()
        if now is None or self._last is None:
            return
        with self._lock:
            self._total = self._total + (now - self._last)
            self._last = now

    def stop(self) -> PcieBytes | None:
        """The bytes counted since start(), or None if the counter could not be read."""
        if self._thread is None:
            return None
        self._stop.set()
        self._thread.join()
        self._thread = None
        self._sample()
        return self._total if self._last is not None else None
