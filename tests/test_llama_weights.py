"""A llama's safetensors file (Hugging Face's LlamaForCausalLM names): `weights export` then
`model.init` gives the same model at pp 1 and pp 2 (split on load), and a file that does not
fit the job is refused in one line.

python -m pytest -q tests/test_llama_weights.py
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from mpihybrid.config import ConfigError, build_job, resolve
from mpihybrid.nn.data import build_task, task_dims
from mpihybrid.nn.kinds import model_kind
from mpihybrid.nn.loss import SoftmaxCrossEntropy
from mpihybrid.nn.model import build_stage
from mpihybrid.nn.weights import write_pair
from mpihybrid.train.tie import bind_local

SETS = ["model.kind=llama", "data.kind=markov", "model.hidden=16", "model.heads=4",
        "model.kv_heads=2", "model.ffn=24", "model.depth=3", "data.vocab=37", "data.seq_len=8",
        "train.global_batch=4", "train.microbatches=2"]  # fmt: skip


def chunks_of(job, n: int, seed: int) -> list:
    """The job's model in n chunks (pp = n), tied as training ties it."""
    chunks = [build_stage(job.model, *task_dims(job.data), c, n, seed=seed) for c in range(n)]
    bind_local(chunks, job.model)
    return chunks


def logits_loss(chunks, job):
    x, y = build_task(job.data).global_batch(0, 4)
    for chunk in chunks:
        x, _ = chunk.forward(x)
    return x, SoftmaxCrossEntropy().forward(x, y)[0]


def exported(tmp_path, job, noise_seed: int = 5):
    """A pp = 2 model off its init, exported to tmp_path/w.safetensors: (path, its chunks)."""
    chunks = chunks_of(job, 2, seed=1)
    rng = np.random.default_rng(noise_seed)
    for chunk in chunks:
        chunk.flat_params += 0.2 * rng.standard_normal(chunk.num_params).astype(np.float32)
    tensors, config = model_kind("llama").weights.export(chunks, job.model, 8, 37)
    path = tmp_path / "w.safetensors"
    write_pair(path, tensors, config, overwrite=True)
    return path, chunks


@pytest.mark.parametrize("tie", [False, True])
def test_export_then_init_is_the_same_model_at_pp_1_and_2(tmp_path, tie):
    base = build_job({}, [*SETS, f"model.tie_embeddings={str(tie).lower()}"])
    path, source = exported(tmp_path, base)
    want_logits, want_loss = logits_loss(source, base)
    for pp in (1, 2):
        job = resolve(build_job({}, [*SETS, f"model.tie_embeddings={str(tie).lower()}",
                                     f"model.init={path}", f"grid.pp={pp}"]), pp)  # fmt: skip
        chunks = chunks_of(job, pp, seed=99)  # another draw: the file must replace all of it
        for chunk in chunks:
            model_kind("llama").weights.load(chunk, job.model)  # as train/build does, per stage
        bind_local(chunks, job.model)
        logits, loss = logits_loss(chunks, job)
        np.testing.assert_allclose(logits, want_logits, rtol=1e-6, atol=1e-6)
        assert loss == pytest.approx(want_loss, rel=1e-6), (pp, loss, want_loss)
        again, _ = model_kind("llama").weights.export(chunks, job.model, 8, 37)
        from safetensors.numpy import load_file

        assert all(np.array_equal(again[k], v) for k, v in load_file(str(path)).items())


def test_an_untied_job_starts_from_a_tied_file(tmp_path):
    tied = build_job({}, [*SETS, "model.tie_embeddings=true"])
    path, source = exported(tmp_path, tied)
    job = resolve(build_job({}, [*SETS, f"model.init={path}"]), 1)
    (stage,) = chunks_of(job, 1, seed=7)
    model_kind("llama").weights.load(stage, job.model)
    np.testing.assert_array_equal(stage.blocks[-1][-1].params["weight"].T,
                                  source[0].blocks[0][0].params["tokens"])  # fmt: skip
    np.testing.assert_allclose(logits_loss([stage], job)[1], logits_loss(source, tied)[1],
                               rtol=1e-6)  # fmt: skip


def refused(tmp_path, file_sets: list, job_sets: list) -> str:
    path, _ = exported(tmp_path, build_job({}, [*SETS, *file_sets]))
    with pytest.raises(ConfigError) as err:
        resolve(build_job({}, [*SETS, *job_sets, f"model.init={path}"]), 1)
    return str(err.value)


@pytest.mark.parametrize(
    "file_sets, job_sets, says",
    [
        ([], ["model.hidden=32", "model.ffn=24"], "model.embed_tokens.weight is [37, 16], the "
         "job's model needs [37, 32]"),
        ([], ["model.depth=2"], "9 tensors the model has not (model.layers.2."),
        ([], ["model.depth=4"], "no tensor model.layers.3.input_layernorm.weight (not a llama"),
        ([], ["model.heads=2", "model.kv_heads=1"], "says num_attention_heads = 4, the job's "
         "model.heads = 2"),
        ([], ["model.tie_embeddings=true"], "lm_head.weight is not model.embed_tokens.weight "
         "(an untied model) and this job ties them"),
        ([], ["model.kind=gpt", "model.kv_heads=0"], "no tensor transformer.wte.weight (not a GPT"),
    ],
)  # fmt: skip
def test_a_file_that_does_not_fit_is_one_line(tmp_path, file_sets, job_sets, says):
    assert says in refused(tmp_path, file_sets, job_sets)


def test_a_config_of_another_rotary_base_is_refused(tmp_path):
    job = build_job({}, SETS)
    chunks = chunks_of(job, 1, seed=1)
    tensors, config = model_kind("llama").weights.export(chunks, job.model, 8, 37)
    path = tmp_path / "w.safetensors"
    write_pair(path, tensors, {**config, "rope_theta": 500000.0}, overwrite=True)
    with pytest.raises(ConfigError, match="says rope_theta = 500000.0, the job's rotary base"):
        resolve(dataclasses.replace(job, model=dataclasses.replace(job.model, init=str(path))), 1)


@pytest.mark.mpi
def test_a_run_starts_from_the_file_at_pp_1_and_2(tmp_path):
    """`mpihybrid train` with model.init = a llama's file: its first step's loss, at pp 1 and
    pp 2 (each stage loading its own blocks), is the file's model's loss on that batch."""
    from mpihybrid.trace.file import load
    from tests.helpers import run_mpi

    base = build_job({}, SETS)
    path, source = exported(tmp_path, base)
    _, want = logits_loss(source, base)
    _, fresh = logits_loss(chunks_of(base, 1, seed=5), base)
    assert abs(fresh - want) > 1e-3 * want  # the seed's own model is told apart
    sets = [*SETS, "train.steps=1", "train.seed=5", "comm.codec=fp32", "data.test_samples=4"]
    argv = ["--quiet", *(a for s in [*sets, f"model.init={path}"] for a in ("--set", s))]
    for pp in (1, 2):
        trace = tmp_path / f"pp{pp}.h5"
        proc = run_mpi(pp, "-m", "mpihybrid", "train", *argv, "--set", f"grid.pp={pp}",
                       "--trace", str(trace), timeout=120)  # fmt: skip
        assert proc.returncode == 0, proc.stderr
        assert load(trace).steps["loss"][0] == pytest.approx(want, rel=1e-5), pp
