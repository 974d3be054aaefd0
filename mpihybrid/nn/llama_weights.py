"""A Llama's weights under Hugging Face's LlamaForCausalLM names and (out, in) layouts: what
`weights export` writes of a llama and `model.init` reads back (kinds.LLAMA's WeightsFile).

    tensors, config = hf_export(stages, cfg, seq_len, vocab)  # the whole model, in order
    problem = hf_check(cfg, seq_len, vocab)                    # "" or one line: what does not fit
    hf_load(stage, cfg)                                        # a stage's blocks from cfg.init

model.embed_tokens, model.layers.N.{input_layernorm, self_attn.{q,k,v,o}_proj,
post_attention_layernorm, mlp.{gate,up,down}_proj}, model.norm, lm_head: this Llama's fused
q|k|v and gate|up matrices are cut by columns, each Linear weight transposed (ours (in, out)).
A tied model's file has no lm_head.weight (HF's tie_word_embeddings); an untied job loads the
head from embed_tokens where the file has none. The rotary convention is HF's (rotate_half).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from mpihybrid.nn.llama import RMS_EPS, ROPE_THETA, ffn_width
from mpihybrid.nn.weights import config_problem, file_shapes, same_tensor, untied_problem

EMBED, HEAD = "model.embed_tokens.weight", "lm_head.weight"


def _dims(cfg) -> tuple[int, int, int, int]:
    """(C, key/value width g d, F, key/value heads g) of a llama's model section."""
    kv_heads = cfg.kv_heads or cfg.heads
    return cfg.hidden, kv_heads * (cfg.hidden // cfg.heads), ffn_width(cfg), kv_heads


def hf_views(g: int, block: list, cfg) -> dict[str, np.ndarray]:
    """Block g's tensors under HF's names, as views of its parameters in HF's layout: export
    copies them, model.init writes into them (the stage's own flat buffer)."""
    if g == 0:
        return {EMBED: block[0].params["tokens"]}
    if g == cfg.depth + 1:
        norm, head = block
        views = {"model.norm.weight": norm.params["weight"]}
        if not head.tied:  # a tied head's weight is the table's
            views[HEAD] = head.params["weight"].T
        return views
    width, kv, ffn, _ = _dims(cfg)
    (norm, qkv, _, o), (norm2, up, _, down) = (r.branch for r in block)
    w, p = qkv.params["weight"], f"model.layers.{g - 1}."
    return {
        p + "input_layernorm.weight": norm.params["weight"],
        p + "self_attn.q_proj.weight": w[:, :width].T,
        p + "self_attn.k_proj.weight": w[:, width : width + kv].T,
        p + "self_attn.v_proj.weight": w[:, width + kv :].T,
        p + "self_attn.o_proj.weight": o.params["weight"].T,
        p + "post_attention_layernorm.weight": norm2.params["weight"],
        p + "mlp.gate_proj.weight": up.params["weight"][:, :ffn].T,
        p + "mlp.up_proj.weight": up.params["weight"][:, ffn:].T,
        p + "mlp.down_proj.weight": down.params["weight"].T,
    }


def hf_shapes(cfg, vocab: int) -> dict[str, tuple[int, ...]]:
    """Every tensor of the whole model's file and its shape (no weights needed); an untied
    model's lm_head.weight among them."""
    width, kv, ffn, _ = _dims(cfg)
    shapes = {EMBED: (vocab, width), "model.norm.weight": (width,)}
    if not cfg.tie_embeddings:
        shapes[HEAD] = (vocab, width)
    for layer in range(cfg.depth):
        p = f"model.layers.{layer}."
        shapes |= {
            p + "input_layernorm.weight": (width,),
            p + "self_attn.q_proj.weight": (width, width),
            p + "self_attn.k_proj.weight": (kv, width),
            p + "self_attn.v_proj.weight": (kv, width),
            p + "self_attn.o_proj.weight": (width, width),
            p + "post_attention_layernorm.weight": (width,),
            p + "mlp.gate_proj.weight": (ffn, width),
            p + "mlp.up_proj.weight": (ffn, width),
            p + "mlp.down_proj.weight": (width, ffn),
        }
    return shapes


def hf_export(stages: list, cfg, seq_len: int, vocab: int) -> tuple[dict, dict]:
    """`weights export` of a llama: every stage's tensors (the whole model, in order), float32
    and contiguous, and its LlamaConfig."""
    tensors = {}
    for stage in stages:
        for g, block in zip(stage.block_range, stage.blocks, strict=True):
            for name, view in hf_views(g, block, cfg).items():
                tensors[name] = np.ascontiguousarray(np.asarray(view, np.float32))
    return tensors, hf_config(cfg, seq_len, vocab)


def hf_config(cfg, seq_len: int, vocab: int) -> dict:
    """The LlamaConfig a Hugging Face model needs to compute this model's logits."""
    width, kv, ffn, kv_heads = _dims(cfg)
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": vocab,
        "hidden_size": width,
        "intermediate_size": ffn,
        "num_hidden_layers": cfg.depth,
        "num_attention_heads": cfg.heads,
        "num_key_value_heads": kv_heads,
        "head_dim": width // cfg.heads,
        "hidden_act": "silu",
        "max_position_embeddings": seq_len,
        "rms_norm_eps": RMS_EPS,
        "rope_theta": ROPE_THETA,
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": bool(cfg.tie_embeddings),
        "torch_dtype": "float32",
        "written_by": "mpihybrid weights export",
    }


def hf_check(cfg, seq_len: int, vocab: int) -> str:
    """model.init's file against a llama, in one line ("" = it fits): a missing, misshapen or
    foreign tensor, a tied job's file whose head is not its table, or a config that says other
    heads, another rotary base or RMSNorm eps."""
    p = Path(cfg.init)
    if p.suffix != ".safetensors":
        return f"model.init = {cfg.init!r}: expected a .safetensors file (weights export)"
    have, problem = file_shapes(p)
    if have is None:
        return problem
    want = hf_shapes(cfg, vocab)
    for name, shape in want.items():
        if name not in have:
            if name == HEAD and EMBED in have:  # a tied file: the head starts as the table
                continue
            return f"model.init = {str(p)!r}: no tensor {name} (not a llama of this job's model)"
        if have[name] != shape:
            return (
                f"model.init = {str(p)!r}: {name} is {list(have[name])}, the job's model "
                f"needs {list(shape)} (model.hidden {cfg.hidden}, heads {cfg.heads}, kv_heads "
                f"{cfg.kv_heads}, ffn {cfg.ffn}, depth {cfg.depth}, data.vocab {vocab})"
            )
    extra = sorted(set(have) - set(want))
    if HEAD in extra and not same_tensor(p, have, HEAD, EMBED):  # a tied job
        return untied_problem(p, HEAD, EMBED)
    extra = [name for name in extra if name != HEAD]
    if extra:
        return f"model.init = {str(p)!r}: {len(extra)} tensors the model has not ({extra[0]}, ...)"
    _, _, _, kv_heads = _dims(cfg)
    says = {
        "num_attention_heads": ("model.heads", cfg.heads),
        "num_key_value_heads": ("model.kv_heads (0: heads)", kv_heads),
        "rope_theta": ("rotary base", ROPE_THETA),
        "rms_norm_eps": ("RMSNorm eps", RMS_EPS),
    }
    return config_problem(p, says)


def hf_load(stage, cfg) -> None:
    """A stage's parameters from cfg.init, a file hf_check accepted (split on load: the stage
    reads its own blocks' tensors); an untied head absent from the file is the table."""
    from safetensors import safe_open

    with safe_open(str(cfg.init), framework="numpy") as f:
        keys = set(f.keys())
        for g, block in zip(stage.block_range, stage.blocks, strict=True):
            for name, view in hf_views(g, block, cfg).items():
                value = f.get_tensor(name if name in keys or name != HEAD else EMBED)
                view[...] = value.astype(view.dtype, copy=False)
