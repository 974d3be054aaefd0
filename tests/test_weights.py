"""Weights out and in: nanoGPT's names and layouts in a safetensors file, the round trip through
any split of the model, the file checked against the job, and the CLI on a real checkpoint."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import numpy as np
import pytest

# every test here writes or reads a safetensors file: the `weights` extra
pytest.importorskip("safetensors", reason="safetensors is not installed (the weights extra)")
from safetensors.numpy import load_file, save_file  # noqa: E402

from mpihybrid.cli.text import checkpoint_stages, read_checkpoint
from mpihybrid.config import ConfigError, load_job
from mpihybrid.nn import weights as nw
from mpihybrid.nn.data import build_task
from mpihybrid.nn.loss import SoftmaxCrossEntropy
from mpihybrid.nn.model import build_stage
from mpihybrid.trace.file import load
from tests.helpers import ROOT, mpi_env, run_mpi

TINY = ["model.kind=gpt", "model.hidden=16", "model.heads=2", "model.ffn=32", "model.depth=3",
        "data.kind=markov", "data.vocab=37", "data.seq_len=8", "data.test_samples=4"]  # fmt: skip


def job(*more, world=1):
    return load_job(None, [*TINY, "grid.pp=1", *more], world)


def stages(j, chunks, seed):
    d = j.data
    return [build_stage(j.model, d.seq_len, d.vocab, c, chunks, seed=seed) for c in range(chunks)]


def whole(parts) -> np.ndarray:
    return np.concatenate([s.flat_params for s in parts])


def test_names_and_layouts_are_nanogpts():
    j = job()
    t = nw.export_tensors(stages(j, 1, 0), j.model.depth + 2)
    C, F, V, T = 16, 32, 37, 8
    assert t["transformer.wte.weight"].shape == (V, C)
    assert t["transformer.wpe.weight"].shape == (T, C)
    assert t["transformer.h.0.ln_1.weight"].shape == (C,)
    assert t["transformer.h.2.attn.c_attn.weight"].shape == (3 * C, C)  # (out, in)
    assert t["transformer.h.2.attn.c_proj.weight"].shape == (C, C)
    assert t["transformer.h.1.mlp.c_fc.weight"].shape == (F, C)
    assert t["transformer.h.1.mlp.c_proj.weight"].shape == (C, F)
    assert t["transformer.ln_f.bias"].shape == (C,)
    assert t["lm_head.weight"].shape == (V, C)
    assert len(t) == 2 + 12 * 3 + 4
    assert nw.num_params(t) == sum(s.num_params for s in stages(j, 1, 0))


@pytest.mark.parametrize("out_chunks, in_chunks", [(1, 3), (3, 2), (4, 1)])
def test_round_trip_through_any_split(tmp_path, out_chunks, in_chunks):
    j = job()
    path = tmp_path / "m.safetensors"
    source = stages(j, out_chunks, 0)
    save_file(nw.export_tensors(source, 5), str(path))
    target = stages(j, in_chunks, 7)  # drawn from another seed, then overwritten
    for s in target:
        nw.load_into(s, path, 5)
    np.testing.assert_array_equal(whole(target), whole(source))


def test_a_nanogpt_file_without_head_bias_or_head_loads(tmp_path):
    """nanoGPT's lm_head has no bias (zero here); a tied file (Hugging Face) may hold wte only."""
    j = job()
    t = nw.export_tensors(stages(j, 1, 0), 5)
    del t["lm_head.bias"], t["lm_head.weight"]
    path = tmp_path / "nano.safetensors"
    save_file(t, str(path))
    j2 = job(f"model.init={path}")
    (s,) = stages(j2, 1, 3)
    nw.load_into(s, path, 5)
    head = s.blocks[-1][1]
    np.testing.assert_array_equal(head.params["weight"], t["transformer.wte.weight"].T)
    assert not head.params["bias"].any()


def test_a_tied_model_goes_out_with_both_names_and_comes_back(tmp_path):
    """A tied model writes lm_head.weight = wte (nanoGPT's state_dict has both names); it loads
    into a tied job on any split (the head reads the table); an untied file is refused in one
    line by a tied job."""
    from mpihybrid.train.tie import bind_local

    j = job("model.tie_embeddings=true")
    source = stages(j, 3, 0)
    bind_local(source, j.model)
    t = nw.export_tensors(source, 5)
    np.testing.assert_array_equal(t["lm_head.weight"], t["transformer.wte.weight"])
    path = tmp_path / "tied.safetensors"
    save_file(t, str(path))
    target = stages(job("model.tie_embeddings=true", f"model.init={path}"), 2, 7)
    for s in target:
        nw.load_into(s, path, 5)
    bind_local(target, j.model)
    np.testing.assert_array_equal(whole(target), whole(source))
    np.testing.assert_array_equal(target[-1].layers[-1].params["weight"], t["lm_head.weight"].T)
    untied = _file(tmp_path)
    with pytest.raises(ConfigError) as err:
        job("model.tie_embeddings=true", f"model.init={untied}")
    assert "lm_head.weight is not transformer.wte.weight (an untied model)" in str(err.value)


@pytest.mark.parametrize("tied", [False, True])
def test_torch_computes_the_same_logits(tmp_path, tied):
    """benchmarks/torch_logits.py: a PyTorch GPT to nanoGPT's model.py loading the exported file
    (tied: nanoGPT's wte = lm_head) gives mpihybrid's logits to float32 tolerance."""
    pytest.importorskip("torch", reason="torch is not a dependency: the logits are compared "
                        "where it is installed")  # fmt: skip
    from mpihybrid.train.tie import bind_local

    j = job(f"model.tie_embeddings={str(tied).lower()}")
    (stage,) = stages(j, 1, 0)
    bind_local([stage], j.model)
    stage.flat_params += np.random.default_rng(1).standard_normal(stage.num_params).astype(
        np.float32
    ) * np.float32(0.02)
    path = tmp_path / "m.safetensors"
    save_file(nw.export_tensors([stage], 5), str(path))
    nw.config_path(path).write_text(json.dumps(nw.config_of(j.model, 8, 37)))
    script = [
        sys.executable,
        str(ROOT / "benchmarks" / "torch_logits.py"),
        str(path),
        "--batch",
        "4",
    ]
    proc = subprocess.run(script, capture_output=True, text=True, env=mpi_env(), timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    print(proc.stdout)
    assert "max |torch - mpihybrid|" in proc.stdout


def _file(tmp_path, change=None, heads=None):
    j = job()
    t = nw.export_tensors(stages(j, 1, 0), 5)
    if change:
        change(t)
    path = tmp_path / "m.safetensors"
    save_file(t, str(path))
    if heads is not None:
        (tmp_path / "m.json").write_text(json.dumps({"n_head": heads}))
    return path


@pytest.mark.parametrize(
    "change, heads, says",
    [
        (lambda t: t.pop("transformer.h.1.mlp.c_fc.bias"), None, "no tensor transformer.h.1.mlp"),
        (lambda t: t.update({"transformer.wpe.weight": np.zeros((9, 16), np.float32)}), None,
         "transformer.wpe.weight is [9, 16], the job's model needs [8, 16]"),
        (lambda t: t.update({"transformer.h.3.ln_1.weight": np.ones(16, np.float32)}), None,
         "1 tensors the model has not (transformer.h.3.ln_1.weight"),
        (None, 4, "says n_head = 4, the job's model.heads = 2"),
    ],
)  # fmt: skip
def test_a_file_that_does_not_fit_is_one_config_error(tmp_path, change, heads, says):
    path = _file(tmp_path, change, heads)
    with pytest.raises(ConfigError) as err:
        job(f"model.init={path}")
    assert says in str(err.value) and "\n" not in str(err.value)


def test_the_pair_is_written_whole_or_not_at_all(tmp_path, monkeypatch):
    """weights export's write_pair: the weights file carries its config in its metadata (a run
    starts from it alone, and its head count is checked without the JSON); a failure after the
    weights are written leaves neither file (nor a temporary) behind."""
    j = job()
    tensors = nw.export_tensors(stages(j, 1, 0), 5)
    config = nw.config_of(j.model, j.data.seq_len, j.data.vocab)
    path = tmp_path / "w.safetensors"
    assert nw.write_pair(path, tensors, config, overwrite=False) == tmp_path / "w.json"
    assert nw.file_config(path) == config == json.loads((tmp_path / "w.json").read_text())
    (tmp_path / "w.json").unlink()
    assert job(f"model.init={path}").model.init == str(path)  # complete alone
    with pytest.raises(ConfigError, match=r"w.safetensors says n_head = 2, the job's model.heads"):
        job(f"model.init={path}", "model.heads=4", "model.hidden=16")
    with pytest.raises(FileExistsError):
        nw.write_pair(path, tensors, config, overwrite=False)

    def fail(self, *args, **kwargs):
        raise OSError(28, "No space left on device")

    half = tmp_path / "half.safetensors"
    monkeypatch.setattr(type(half), "write_text", fail)  # the JSON, after the weights' bytes
    with pytest.raises(OSError, match="No space left"):
        nw.write_pair(half, tensors, config, overwrite=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["w.safetensors"]


def test_other_bad_inits(tmp_path):
    (tmp_path / "junk.safetensors").write_bytes(b"not a safetensors file")
    for setting, says in [
        (f"model.init={tmp_path / 'none.safetensors'}", "no such file"),
        (f"model.init={tmp_path / 'junk.safetensors'}", "not a readable safetensors file"),
        (f"model.init={tmp_path / 'm.h5'}", "expected a .safetensors file"),
    ]:
        with pytest.raises(ConfigError, match=says):
            job(setting)
    only = r"starts a gpt or a llama only \(model.kind = 'mlp' has no weights file\)"
    with pytest.raises(ConfigError, match=only):
        load_job(None, [f"model.init={_file(tmp_path)}"], 2)


@pytest.mark.mpi
def test_export_a_checkpoint_and_start_another_grid_from_it(tmp_path):
    """A pp=2 run's checkpoint exported by the CLI holds its weights; a pp=3 run started from
    the file computes, at its first step, the loss of those weights on its first batch."""
    ckpt, out = tmp_path / "ckpt", tmp_path / "w.safetensors"
    argv = [a for s in TINY for a in ("--set", s)] + ["--quiet", "--set", "train.global_batch=8",
            "--set", "train.optimizer=adamw", "--set", "train.lr=3e-3"]  # fmt: skip
    proc = run_mpi(2, "-m", "mpihybrid", "train", *argv, "--set", "grid.pp=2", "--set",
                   "train.steps=3", "--set", f"checkpoint.dir={ckpt}",
                   "--set", "checkpoint.every=3")  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    cli = run_mpi(1, "-m", "mpihybrid", "weights", "export", str(ckpt), "-o", str(out))
    assert cli.returncode == 0, cli.stderr
    config = json.loads(out.with_suffix(".json").read_text())
    assert config["n_layer"] == 3 and config["gelu"] == "tanh" and config["step"] == 3
    j, step_dir, manifest = read_checkpoint(ckpt)
    saved = checkpoint_stages(step_dir, j, manifest)
    tensors = load_file(str(out))
    expected = nw.export_tensors(saved, 5)
    assert sorted(tensors) == sorted(expected)
    assert all(np.array_equal(tensors[k], v) for k, v in expected.items())
    _generate_ids_and_tokenizers(ckpt)
    again = run_mpi(1, "-m", "mpihybrid", "weights", "export", str(ckpt), "-o", str(out))
    assert again.returncode == 2 and "exists: pass --overwrite" in again.stderr
    trace = tmp_path / "init.h5"
    proc = run_mpi(3, "-m", "mpihybrid", "train", *argv, "--set", "grid.pp=3", "--set",
                   "train.steps=1", "--set", f"model.init={out}",
                   "--trace", str(trace))  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    task = build_task(j.data)
    (model,) = stages(j, 1, 99)
    nw.load_into(model, out, 5)
    x, y = task.global_batch(0, 8)
    logits, _ = model.forward(x)
    loss, _ = SoftmaxCrossEntropy().forward(logits, y)
    assert load(trace).steps["loss"][0] == pytest.approx(loss, rel=1e-5)
    assert not math.isclose(loss, math.log(37), rel_tol=0.01)  # trained, not the initial model


def run(argv):
    return subprocess.run(argv, capture_output=True, text=True, env=mpi_env(), timeout=120)


def _generate_ids_and_tokenizers(ckpt):
    """A checkpoint of token data with no tokenizer (markov): --ids samples ids, a byte
    tokenizer (256 tokens) does not fit its 37, and without either the error names both."""
    gen = [sys.executable, "-m", "mpihybrid", "generate", str(ckpt), "--tokens", "5"]
    ids = run([*gen, "--ids", "--prompt", "3, 4 5"])
    assert ids.returncode == 0, ids.stderr
    assert len(ids.stdout.split()) == 5 and all(0 <= int(t) < 37 for t in ids.stdout.split())
    byte = run([*gen, "--tokenizer", "byte"])
    assert byte.returncode == 2 and "its tokenizer has 256 tokens, the model 37" in byte.stderr
    none = run(gen)
    assert none.returncode == 2 and "--tokenizer byte|PATH, or --ids" in none.stderr
    bad = run([*gen, "--ids", "--prompt", "40"])
    assert bad.returncode == 2 and "outside the model's vocabulary [0, 37)" in bad.stderr
