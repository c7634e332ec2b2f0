"""Measurement aid (not part of dataflow): with DATAFLOW_WATCH=S, print every S seconds which
schedule event the main thread is dispatching (the run-ahead bound keeps it near the GPU)."""
import os, sys, threading, time
_S = float(os.environ.get("DATAFLOW_WATCH") or 0)
if _S > 0:
    def _watch():
        main, t0, last = threading.main_thread().ident, time.time(), None
        while True:
            time.sleep(_S)
            f = sys._current_frames().get(main)
            while f is not None and not (f.f_code.co_name == "_run" and "ev" in f.f_locals):
                f = f.f_back
            if f is not None:
                ev = f.f_locals["ev"]
                name = getattr(ev, "name", type(ev).__name__)
                print(f"watch {time.time() - t0:6.0f} s: {name}", file=sys.stderr, flush=True)
    threading.Thread(target=_watch, daemon=True).start()
