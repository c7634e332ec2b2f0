import time, sys, types, cupy
from dataflow.backend import Stream, Place
stub = types.ModuleType("dataflow.ops_cuda"); stub.WRITES = {"fill_": (0,)}
stub.fill_ = lambda x, v: x.fill(v)
sys.modules["dataflow.ops_cuda"] = stub
from dataflow.backends.cupy_backend import CupyBackend
from dataflow.instrument import TracingBackend, PcieCounter
inner = CupyBackend(); inner.ops, inner.writes = stub, stub.WRITES
G = 1 << 30
dev = inner.alloc(2 * G, Place.DEVICE); host = inner.alloc(2 * G, Place.HOST)
d = [inner.view(dev, i * G, (G,), "u8") for i in (0, 1)]
h = [inner.view(host, i * G, (G,), "u8") for i in (0, 1)]
pc = PcieCounter.open(pci_bus_id=inner.device.pci_bus_id)
def measure(label, fn, sleep=0.0):
    inner.synchronize(); time.sleep(sleep); a = pc.read(); fn(); inner.synchronize(); time.sleep(sleep); b = pc.read()
    dd = b - a
    print(f"{label:10s} sleep {sleep}: rx {dd.rx_bytes/G:.4f} GiB  tx {dd.tx_bytes/G:.4f} GiB")
for sl in (0.0, 0.5):
    measure("idle", lambda: None, sl)
    measure("h2d 4GiB", lambda: [inner.copy(d[i%2], h[i%2], Stream.H2D) for i in range(4)], sl)
    measure("d2h 4GiB", lambda: [inner.copy(h[i%2], d[i%2], Stream.D2H) for i in range(4)], sl)
    measure("both 2+2", lambda: [(inner.copy(d[0], h[0], Stream.H2D), inner.copy(h[1], d[1], Stream.D2H)) for i in range(2)], sl)
small = inner.view(dev, 0, (1 << 20,), "f32")
for nvtx in (False, True):
    be = TracingBackend(inner, nvtx=nvtx)
    for rep in range(3):
        t0 = time.perf_counter(); be.begin_step(rep)
        for i in range(20000): be.launch(Stream.COMPUTE, "fill_", small, 1.0, name="f.L1.c0.fill_")
        t1 = time.perf_counter(); tr = be.end_step(); t2 = time.perf_counter()
    print(f"nvtx={nvtx}: enqueue {(t1-t0)/20000*1e6:.1f} us/op, end_step {(t2-t1)*1e3:.1f} ms")
    be._clock.close()
for rep in range(2):
    t0 = time.perf_counter()
    for i in range(20000): inner.launch(Stream.COMPUTE, "fill_", small, 1.0, name="x")
    t1 = time.perf_counter(); inner.synchronize()
print(f"plain enqueue {(t1-t0)/20000*1e6:.1f} us/op")
s = inner.streams[Stream.COMPUTE]; ev = cupy.cuda.Event()
t0 = time.perf_counter()
for i in range(20000): ev.record(s)
print(f"event.record {(time.perf_counter()-t0)/20000*1e6:.2f} us")
from cupy.cuda import nvtx
t0 = time.perf_counter()
for i in range(20000): nvtx.RangePush("abc"); nvtx.RangePop()
print(f"nvtx push+pop {(time.perf_counter()-t0)/20000*1e6:.2f} us")
