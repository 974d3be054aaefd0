"""Reading a finished run: metrics from a trace (metrics), its tables (report), the timeline
(Gantt PNG, ASCII grid) and exports (Chrome/Perfetto JSON, CSV)."""
