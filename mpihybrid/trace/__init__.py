"""What every rank did and when: the event recorder (recorder), the HDF5 file's writer (file)
and its reader (read).

    from mpihybrid.trace import load
    trace = load("runs/seed.h5")      # .events, .steps, .config, .attrs; no MPI needed

The reader's names are re-exported here because users call them (README, docs/trace-format.md);
code inside the package imports from the modules themselves.
"""

from mpihybrid.trace.read import Trace, TraceError, load
from mpihybrid.trace.recorder import EVENT_DTYPE, KIND, KINDS

__all__ = ["EVENT_DTYPE", "KIND", "KINDS", "Trace", "TraceError", "load"]
