"""Pipeline schedules as data (schedules), their timing model (simulate), the runtime that
executes one rank's action list (runtime), activation liveness and what a trace says ran."""
