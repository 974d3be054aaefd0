"""A GPT's weights under nanoGPT's GPT-2 names and layouts, to and from safetensors files.

    tensors = export_tensors(cfg, stages)            # {"transformer.wte.weight": (V, C), ...}
    write_pair(path, tensors, config, overwrite)     # PATH.safetensors (config inside) + PATH.json
    problem = check_file(cfg, seq_len, vocab, path)  # "" or one line: what does not fit
    load_into(stage, cfg, path)                      # a stage's blocks from the file

nanoGPT's model (transformer.wte, wpe, h.i.{ln_1, attn.c_attn, attn.c_proj, ln_2, mlp.c_fc,
mlp.c_proj}, ln_f, lm_head) holds the same tensors as this GPT; its nn.Linear stores the weight
as (out, in), ours as (in, out), so every Linear weight is transposed on the way out and back.
Where this GPT differs from nanoGPT's defaults the config says so: it is the file's own
safetensors metadata (key "config", so the file alone is complete) and a JSON copy beside it (a
PyTorch model that loads the file must follow it to compute the same logits,
benchmarks/torch_logits.py): GELU in its tanh form (nanoGPT: erf), an LM head with a bias
(nanoGPT: none), LayerNorm eps 1e-5 and biases everywhere else as nanoGPT's bias=True.
A file without `lm_head.bias` (nanoGPT's own) loads with a zero bias, one without
`lm_head.weight` (tied, as Hugging Face writes it) with the head = wte, one without any bias
(nanoGPT's bias = False) with every bias zero.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import numpy as np

from mpihybrid.inputs import InputFileError, MiB, check_regular, read_text

WTE, HEAD, HEAD_BIAS = "transformer.wte.weight", "lm_head.weight", "lm_head.bias"
# the names of one transformer layer's tensors: (residual branch, layer in it) -> nanoGPT name
_LAYER = {
    (0, 0): "ln_1",
    (0, 1): "attn.c_attn",
    (0, 3): "attn.c_proj",
    (1, 0): "ln_2",
    (1, 1): "mlp.c_fc",
    (1, 3): "mlp.c_proj",
}


def block_names(g: int, num_blocks: int) -> list[tuple[str, tuple, str, bool]]:
    """Block g's tensors: (nanoGPT name, path to the layer, its parameter, transposed)."""
    if g == 0:
        return [
            ("transformer.wte.weight", (0,), "tokens", False),
            ("transformer.wpe.weight", (0,), "positions", False),
        ]
    if g == num_blocks - 1:
        return [
            ("transformer.ln_f.weight", (0,), "weight", False),
            ("transformer.ln_f.bias", (0,), "bias", False),
            (HEAD, (1,), "weight", True),
            (HEAD_BIAS, (1,), "bias", False),
        ]
    out = []
    for (branch, i), name in _LAYER.items():
        prefix = f"transformer.h.{g - 1}.{name}"
        out.append((f"{prefix}.weight", (branch, i), "weight", "." in name))  # Linears: c_*
        out.append((f"{prefix}.bias", (branch, i), "bias", False))
    return out


def _layer(block: list, path: tuple):
    return block[path[0]] if len(path) == 1 else block[path[0]].branch[path[1]]


def _param(block: list, path: tuple, name: str) -> np.ndarray:
    return _layer(block, path).params[name]


def own_names(g: int, block: list, num_blocks: int) -> list[tuple[str, tuple, str, bool]]:
    """block_names of the tensors block g holds itself (a tied head's weight is wte's; under
    model.vocab_parallel the vocabulary shares hold wte and the head)."""
    return [
        entry
        for entry in block_names(g, num_blocks)
        if entry[1][0] < len(block) and entry[2] in _layer(block, entry[1]).param_shapes()
    ]


def expected_shapes(blocks: list) -> dict[str, tuple[int, ...]]:
    """nanoGPT name -> its shape in the file, for the model's blocks (no weights needed)."""
    shapes = {}
    for g, block in enumerate(blocks):
        for name, path, key, transposed in own_names(g, block, len(blocks)):
            shape = _layer(block, path).param_shapes()[key]
            shapes[name] = shape[::-1] if transposed else shape
    return shapes


def export_tensors(stages: list, num_blocks: int) -> dict[str, np.ndarray]:
    """Every stage's tensors (the whole model, in order) under nanoGPT's names and layouts; a
    tied model's lm_head.weight is wte (nanoGPT's state_dict holds both names)."""
    out = {}
    for stage in stages:
        for g, block in zip(stage.block_range, stage.blocks, strict=True):
            for name, path, key, transposed in own_names(g, block, num_blocks):
                value = np.asarray(_param(block, path, key), np.float32)
                out[name] = np.ascontiguousarray(value.T if transposed else value)
    if HEAD not in out and WTE in out:
        out[HEAD] = out[WTE].copy()
    return out


def config_of(cfg, seq_len: int, vocab: int) -> dict:
    """The JSON config beside an exported file: nanoGPT's GPTConfig fields and where this GPT
    differs from nanoGPT's choices."""
    return {
        "model_type": "gpt",
        "block_size": seq_len,
        "vocab_size": vocab,
        "n_layer": cfg.depth,
        "n_head": cfg.heads,
        "n_embd": cfg.hidden,
        "n_inner": cfg.ffn or 4 * cfg.hidden,
        "bias": True,
        "dropout": 0.0,
        # tanh: 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))); erf (model.gelu): nanoGPT's
        "gelu": cfg.gelu,
        "lm_head_bias": True,  # nanoGPT's lm_head has none
        "layer_norm_eps": 1e-5,
        "attention_scale": "1/sqrt(head_dim)",
        "tie_embeddings": bool(cfg.tie_embeddings),
        "linear_layout": "(out, in) as torch.nn.Linear",
        "written_by": "mpihybrid weights export",
    }


def config_path(path: str | Path) -> Path:
    """The JSON config beside a weights file: model.safetensors -> model.json."""
    return Path(path).with_suffix(".json")


def write_pair(path: str | Path, tensors: dict, config: dict, overwrite: bool) -> Path:
    """The weights file, its config in its metadata, and the config's JSON copy beside it
    (config_path), both or neither: each is written in full under a temporary name first, and
    only then renamed into place, the weights file first (complete by itself, should the last
    rename fail). FileExistsError when either exists and overwrite is False (nothing written)."""
    from safetensors.numpy import save

    from mpihybrid.files import atomic_path, check_target

    path, beside = Path(path), config_path(path)
    for target in (path, beside):
        check_target(target, overwrite)
    text = json.dumps(config, indent=1) + "\n"
    with atomic_path(beside, overwrite) as tmp_json, atomic_path(path, overwrite) as tmp:
        tmp.write_bytes(save(tensors, metadata={"format": "pt", "config": text}))
        tmp_json.write_text(text)
    return beside


def file_config(path: str | Path) -> dict | None:
    """The config an exported file carries in its metadata (None: a file written elsewhere)."""
    from safetensors import safe_open

    with safe_open(str(path), framework="numpy") as f:
        text = (f.metadata() or {}).get("config")
    return None if text is None else json.loads(text)


def file_shapes(path: str | Path) -> tuple[dict[str, tuple[int, ...]] | None, str]:
    """model.init's file: (each tensor's shape by name, "") or (None, why it cannot be read,
    in one line). Any kind's file (its `weights` check calls it)."""
    from safetensors import SafetensorError, safe_open

    p = Path(path)
    try:  # a FIFO or a device: refused before safetensors opens it (open() would block)
        check_regular(p, what="model.init")
    except InputFileError as exc:
        return None, str(exc)
    try:
        with safe_open(str(p), framework="numpy") as f:
            return {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}, ""  # noqa: SIM118
    except (SafetensorError, OSError, ValueError) as exc:
        return None, f"model.init = {str(p)!r}: not a readable safetensors file ({exc})"


def check_file(cfg, seq_len: int, vocab: int, path: str | Path, blocks: list) -> str:
    """What keeps the file from starting this model, in one line ("" = it fits): a missing,
    misshapen or unexpected tensor, another model's head count in its config."""
    p = Path(path)
    have, problem = file_shapes(p)
    if have is None:
        return problem
    want = expected_shapes(blocks)
    lenient = {HEAD_BIAS, HEAD} if WTE in have else {HEAD_BIAS}
    if biasless(have):  # nanoGPT's bias = False: every bias starts at zero (load_into)
        lenient |= {name for name in want if name.endswith(".bias")}
    for name, shape in want.items():
        if name not in have:
            if name in lenient:
                continue
            return f"model.init = {str(p)!r}: no tensor {name} (not a GPT of this job's model)"
        if have[name] != shape:
            return (
                f"model.init = {str(p)!r}: {name} is {list(have[name])}, the job's model "
                f"needs {list(shape)} (model.hidden {cfg.hidden}, depth {cfg.depth}, "
                f"data.vocab {vocab}, data.seq_len {seq_len})"
            )
    extra = sorted(k for k in set(have) - set(want) if not k.endswith(".attn.bias"))
    if HEAD in extra and WTE in want:  # a tied job: the file's head must be its wte
        extra.remove(HEAD)
        if not same_tensor(p, have, HEAD, WTE):
            return untied_problem(p, HEAD, WTE)
    if extra:
        return f"model.init = {str(p)!r}: {len(extra)} tensors the model has not ({extra[0]}, ...)"
    return config_problem(p, {"n_head": ("model.heads", cfg.heads)})


def biasless(names) -> bool:
    """nanoGPT's bias = False: no Linear or LayerNorm bias in the file (the attention's mask
    buffer, `.attn.bias`, is no parameter)."""
    return not any(k.endswith(".bias") and not k.endswith(".attn.bias") for k in names)


def config_problem(p: Path, says: dict) -> str:
    """The settings the file's config says (its metadata's, else the JSON beside it) against
    the job's: says = {config key: (the job's setting, its value)}; "" when they agree or when
    no config says."""
    beside = config_path(p)
    where = str(p)
    try:
        config = file_config(p)
        if config is None and beside.exists():
            where = str(beside)
            config = json.loads(read_text(beside, what="model.init's config", limit=MiB))
        config = config or {}
        theirs = {key: config.get(key, ours) for key, (_, ours) in says.items()}
    except InputFileError as exc:
        return str(exc)
    except (ValueError, AttributeError) as exc:
        return f"model.init: {where} holds no readable JSON config ({exc})"
    for key, (setting, ours) in says.items():
        if theirs[key] != ours:
            return f"model.init: {where} says {key} = {theirs[key]}, the job's {setting} = {ours}"
    return ""


def same_tensor(p: Path, have: dict, a: str, b: str) -> bool:
    """Whether the file's tensors a and b are equal (a tied model's head and table)."""
    from safetensors import safe_open

    if have[a] != have[b]:
        return False
    with safe_open(str(p), framework="numpy") as f:
        return bool(np.array_equal(f.get_tensor(a), f.get_tensor(b)))


def untied_problem(p: Path, head: str, table: str) -> str:
    """A tied job's file whose head is not its table, in one line."""
    return (
        f"model.init = {str(p)!r}: {head} is not {table} (an untied model) and this job ties "
        "them (model.tie_embeddings = true)"
    )


def init_problem(cfg, seq_len: int, vocab: int) -> str:
    """model.init's file against a GPT (nn/kinds.py: GPT.init), in one line ("" = it fits)."""
    from mpihybrid.nn.transformer import gpt_blocks

    if not cfg.init.endswith(".safetensors"):
        return f"model.init = {cfg.init!r}: expected a .safetensors file (weights export)"
    if cfg.vocab_parallel:  # the file holds the whole model: check that
        cfg = dataclasses.replace(cfg, vocab_parallel=False)
    blocks = gpt_blocks(cfg, seq_len, vocab, tied=cfg.tie_embeddings)  # GPT.build's blocks
    return check_file(cfg, seq_len, vocab, cfg.init, blocks)


def nonfinite_problem(path: str | Path) -> str:
    """The first tensor of a model.init file holding a NaN or an infinity, in one line ("" =
    none): read once, a tensor at a time, before any rank starts from it. A nanoGPT-named file
    without biases (nanoGPT's bias = False) is said here, once."""
    import logging

    from safetensors import safe_open

    with safe_open(str(path), framework="numpy") as f:
        if WTE in f.keys() and biasless(f.keys()):  # noqa: SIM118 (a nanoGPT-named file)
            logging.getLogger("mpihybrid").info(
                "model.init = %r has no biases (nanoGPT's bias = False): every bias starts at "
                "zero, so the model computes the file's function",
                str(path),
            )
        for name in sorted(f.keys()):
            bad = np.count_nonzero(~np.isfinite(f.get_tensor(name)))
            if bad:
                return (
                    f"model.init = {str(path)!r}: {name} holds {bad} non-finite values (nan or "
                    "inf); a run cannot start from it"
                )
    return ""


def load_into(stage, path: str | Path, num_blocks: int) -> None:
    """A stage's parameters from a file that check_file accepted (fp32 in the stage's layout)."""
    from safetensors import safe_open

    with safe_open(str(path), framework="numpy") as f:
        fill(stage, f.get_tensor, set(f.keys()), num_blocks)


def fill(stage, get, keys: set, num_blocks: int) -> None:
    """A stage's parameters from named tensors: get(name) for the names in `keys` (a file's,
    or a dict's: get = tensors.__getitem__)."""
    for g, block in zip(stage.block_range, stage.blocks, strict=True):
        for name, path_, key, transposed in own_names(g, block, num_blocks):
            target = _param(block, path_, key)
            if name in keys:
                value = get(name)
            elif name == HEAD:
                value, transposed = get(WTE), True  # tied: the head is wte
            else:  # lm_head.bias of a nanoGPT file, any bias of a bias = False one: none
                value = np.zeros(target.shape, np.float32)
            value = value.T if transposed else value
            target[...] = value.astype(target.dtype, copy=False)


def num_params(tensors: dict[str, np.ndarray]) -> int:
    return sum(math.prod(v.shape) for v in tensors.values())
