"""`mpihybrid weights export`: a checkpoint as a safetensors file under the names its model kind
writes (a GPT's: nanoGPT's; registered lazily by mpihybrid.cli.commands; `export` is the
trace's).

    mpihybrid weights export runs/text_gpt -o runs/text_gpt.safetensors   # + runs/text_gpt.json
    mpiexec -n 2 mpihybrid train jobs/text_gpt.toml --set model.init=runs/text_gpt.safetensors

The file holds every tensor of the model (the kind's `export` in nn/kinds.py says which and how
they are laid out: a GPT's nn/weights.py) and, in its metadata, the config the kind writes (a
GPT's: nanoGPT's GPTConfig fields and where this GPT differs from nanoGPT); the JSON beside it
is a copy of that config. The two are written whole or not at all (nn/weights.write_pair); an
existing file is replaced only with --overwrite. One process, no mpiexec; errors are one line
and exit 2.
"""

from __future__ import annotations

import sys
from pathlib import Path

import click

from mpihybrid.cli.commands import EXIT_USAGE


def _fail(message: str) -> None:
    click.echo(f"mpihybrid: error: {message}", err=True)
    sys.exit(EXIT_USAGE)


@click.group()
def weights() -> None:
    """A model's weights to and from other tools (safetensors, under its kind's names)."""


@weights.command()
@click.argument("checkpoint_dir", metavar="CHECKPOINT_DIR")
@click.option("-o", "--output", required=True, help="The .safetensors file to write.")
@click.option("--overwrite", is_flag=True, help="Replace an existing output file.")
def export(checkpoint_dir, output, overwrite) -> None:
    """Write a checkpoint of any grid (a checkpoint.dir or one step-N directory) as one
    safetensors file under its model kind's names and layouts (a GPT's: nanoGPT's GPT-2 names,
    (out, in) Linears), and a JSON config beside it (OUTPUT with .json): `model.init = "OUTPUT"`
    starts a run from it."""
    from mpihybrid.cli.text import checkpoint_stages, read_checkpoint
    from mpihybrid.nn import weights as nw
    from mpihybrid.nn.kinds import model_kind
    from mpihybrid.nn.tokens import DataError

    out = Path(output)
    if out.suffix != ".safetensors":
        _fail(f"-o {output}: name the file *.safetensors (its config goes beside it as .json)")
    beside = nw.config_path(out)
    for path in (out, beside):
        if path.exists() and not overwrite:
            _fail(f"{path} exists: pass --overwrite to replace it")
    try:
        job, step_dir, manifest = read_checkpoint(Path(checkpoint_dir))
        stages = checkpoint_stages(step_dir, job, manifest)
    except DataError as exc:
        _fail(str(exc))
    m, d = job.model, job.data
    file = model_kind(m.kind).weights  # the kind's names and config (a gpt's: nanoGPT's)
    if file is None:
        _fail(f"{checkpoint_dir}: a {m.kind} model has no weights file format")
    tensors, config = file.export(stages, m, d.seq_len, d.vocab)
    config = {**config, "step": int(manifest.get("step", -1))}
    try:
        nw.write_pair(out, tensors, config, overwrite)
    except OSError as exc:
        _fail(str(exc))
    click.echo(f"{out}: {len(tensors)} tensors, {nw.num_params(tensors):,} parameters; {beside}")
