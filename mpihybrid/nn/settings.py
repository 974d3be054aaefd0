"""A model kind's own settings: the model.* keys it reads beyond every kind's (kind, hidden,
depth, partition, init), each with its default, what it means and its check. A kind's module
declares them, its entry in nn/kinds.py lists them, and config/job.py makes [model] from
every kind's (the keys stay flat: `model.heads`, `--set model.heads=8`):

    HEADS = Setting("heads", 4, "attention heads (model.hidden must divide by it)", low=1)
    HEADS.problem(0)  # "model.heads = 0: must be >= 1"
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Setting:
    name: str  # the key under [model]
    default: bool | int | float | str  # its type is the key's type
    doc: str  # what it means to the kind that reads it
    choices: tuple = ()  # the values it may take (empty: any of its type)
    low: int | float | None = None  # the least value it may take

    def problem(self, value) -> str:
        """What is wrong with `value` for this setting, in one line ("" = nothing)."""
        where = f"model.{self.name}"
        if self.choices and value not in self.choices:
            return f"{where} = {value!r}: unknown; choose one of {', '.join(self.choices)}"
        if self.low is not None and value < self.low:
            return f"{where} = {value}: must be >= {self.low}"
        return ""


def toml_text(value) -> str:
    """A setting's value as a job file spells it (true, 2, "erf")."""
    if isinstance(value, bool):
        return "true" if value else "false"
    return repr(value) if isinstance(value, str) else str(value)
