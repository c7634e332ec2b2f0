"""One Engine setup in this process (fresh caches given by the caller's environment); prints a
JSON line: DATAFLOW_PREBUILD, wall seconds of the setup, phases, prebuild and warm_up parts, pin."""
import json, os, sys, time
t0 = time.perf_counter()
from dataflow.engine import Engine
model, seqlen, host, dev = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), float(sys.argv[4])
t1 = time.perf_counter()
eng = Engine(model, host_gb=host, dev_gb=dev, seqlen=seqlen, backend="cupy")
t2 = time.perf_counter()
rec = {"prebuild_env": os.environ.get("DATAFLOW_PREBUILD", "1"), "imports_s": t1 - t0,
       "setup_s": t2 - t1, "phases": eng.setup_seconds, "prebuild": eng.prebuild_parts,
       "warm_up": eng.warm_up_parts, "pin": eng.be.last_pin}
eng.close()
print(json.dumps(rec), flush=True)
