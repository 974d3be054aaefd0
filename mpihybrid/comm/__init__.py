"""How ranks talk and where arrays live: the array backend (device), gradient codecs, the
hand-written ring all-reduce and the process grid (pp_comm, dp_comm)."""
