"""Does a PyTorch GPT written to nanoGPT's conventions, loading `mpihybrid weights export`'s file,
compute mpihybrid's logits? (torch is not a dependency: this script runs where it is installed.)

    mpihybrid weights export runs/text_gpt -o runs/text_gpt.safetensors
    python benchmarks/torch_logits.py runs/text_gpt.safetensors [--batch 8]
    python benchmarks/torch_logits.py            # a GPT of jobs/text_gpt.toml's shape, seed 0

The PyTorch model is nanoGPT's model.py in its structure and names (transformer.wte, wpe,
h.i.ln_1 / attn.c_attn / attn.c_proj / ln_2 / mlp.c_fc / mlp.c_proj, ln_f, lm_head; nn.Linear
with (out, in) weights; q, k, v split from c_attn in that order; scale 1/sqrt(head_dim)) and
follows the JSON config beside the file where mpihybrid's GPT differs from nanoGPT's defaults:
GELU's tanh form (`gelu`), an LM head with a bias (`lm_head_bias`), LayerNorm's eps. Both models
run the same token windows in float32; the script prints the largest difference of the logits
and exits 1 when it is above the float32 tolerance (1e-4 absolute, logits of size ~1-10).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
from pathlib import Path
from types import SimpleNamespace

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

TOLERANCE = 1e-4


def torch_gpt(config: dict):
    """nanoGPT's GPT, with the config's deviations from it."""
    import torch
    from torch import nn
    from torch.nn import functional as F

    C, H, eps = config["n_embd"], config["n_head"], config["layer_norm_eps"]
    gelu = "tanh" if config["gelu"] == "tanh" else "none"

    class CausalSelfAttention(nn.Module):
        def __init__(self):
            super().__init__()
            self.c_attn = nn.Linear(C, 3 * C, bias=config["bias"])
            self.c_proj = nn.Linear(C, C, bias=config["bias"])

        def forward(self, x):
            B, T, _ = x.size()
            q, k, v = self.c_attn(x).split(C, dim=2)
            q, k, v = (t.view(B, T, H, C // H).transpose(1, 2) for t in (q, k, v))
            att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
            mask = torch.tril(torch.ones(T, T, dtype=torch.bool))
            att = F.softmax(att.masked_fill(~mask, float("-inf")), dim=-1)
            y = (att @ v).transpose(1, 2).contiguous().view(B, T, C)
            return self.c_proj(y)

    class MLP(nn.Module):
        def __init__(self):
            super().__init__()
            self.c_fc = nn.Linear(C, config["n_inner"], bias=config["bias"])
            self.gelu = nn.GELU(approximate=gelu)
            self.c_proj = nn.Linear(config["n_inner"], C, bias=config["bias"])

        def forward(self, x):
            return self.c_proj(self.gelu(self.c_fc(x)))

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln_1 = nn.LayerNorm(C, eps=eps)
            self.attn = CausalSelfAttention()
            self.ln_2 = nn.LayerNorm(C, eps=eps)
            self.mlp = MLP()

        def forward(self, x):
            x = x + self.attn(self.ln_1(x))
            return x + self.mlp(self.ln_2(x))

    class GPT(nn.Module):
        def __init__(self):
            super().__init__()
            self.transformer = nn.ModuleDict(
                dict(
                    wte=nn.Embedding(config["vocab_size"], C),
                    wpe=nn.Embedding(config["block_size"], C),
                    h=nn.ModuleList([Block() for _ in range(config["n_layer"])]),
                    ln_f=nn.LayerNorm(C, eps=eps),
                )
            )
            self.lm_head = nn.Linear(C, config["vocab_size"], bias=config["lm_head_bias"])
            if config.get("tie_embeddings"):
                self.transformer.wte.weight = self.lm_head.weight  # nanoGPT's weight tying

        def forward(self, idx):
            pos = torch.arange(idx.size(1))
            x = self.transformer.wte(idx) + self.transformer.wpe(pos)
            for block in self.transformer.h:
                x = block(x)
            return self.lm_head(self.transformer.ln_f(x))

    return GPT()


def mpihybrid_gpt(config: dict, path: Path):
    """The whole model as one mpihybrid stage, its weights from the file."""
    from mpihybrid.nn import weights
    from mpihybrid.nn.model import build_stage
    from mpihybrid.train.tie import bind_local

    cfg = SimpleNamespace(
        kind="gpt", hidden=config["n_embd"], depth=config["n_layer"], heads=config["n_head"],
        ffn=config["n_inner"], partition="cost", init=str(path),
        tie_embeddings=config.get("tie_embeddings", False), vocab_parallel=False,
        gelu=config.get("gelu", "tanh"),
    )  # fmt: skip
    stage = build_stage(cfg, config["block_size"], config["vocab_size"], 0, 1, seed=12345)
    weights.load_into(stage, path, cfg.depth + 2)
    bind_local([stage], cfg)  # tied: the head reads the token table
    return stage


def example_file(out: Path) -> Path:
    """A GPT of jobs/text_gpt.toml's shape at seed 0, exported as a file and its config."""
    from safetensors.numpy import save_file

    from mpihybrid.config import load_job
    from mpihybrid.nn import weights
    from mpihybrid.nn.model import build_stage

    job = load_job(ROOT / "jobs/text_gpt.toml", ["grid.pp=1"], 1)
    m, d = job.model, job.data
    stage = build_stage(m, d.seq_len, d.vocab, 0, 1, seed=job.train.seed)
    rng = np.random.default_rng(1)  # biases and norms away from their 0 / 1 start
    stage.flat_params += rng.standard_normal(stage.num_params).astype(np.float32) * 0.02
    save_file(weights.export_tensors([stage], m.depth + 2), str(out))
    weights.config_path(out).write_text(json.dumps(weights.config_of(m, d.seq_len, d.vocab)))
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("weights", nargs="?", help="a file of `mpihybrid weights export`")
    parser.add_argument("--batch", type=int, default=8, help="token windows compared")
    args = parser.parse_args()
    try:
        import torch
        from safetensors.torch import load_file
    except ImportError as exc:
        print(f"torch_logits: needs torch and safetensors ({exc})", file=sys.stderr)
        return 2
    tmp = tempfile.TemporaryDirectory()
    path = Path(args.weights) if args.weights else example_file(Path(tmp.name) / "m.safetensors")
    config = json.loads(path.with_suffix(".json").read_text())
    model = torch_gpt(config)
    state = load_file(str(path))
    model.load_state_dict(state, strict=True)
    model.eval()
    ours = mpihybrid_gpt(config, path)
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, config["vocab_size"], (args.batch, config["block_size"]))
    with torch.no_grad():
        theirs = model(torch.from_numpy(tokens)).numpy()
    mine, _ = ours.forward(tokens.astype(np.int64))
    diff = float(np.max(np.abs(theirs - mine)))
    scale = float(np.max(np.abs(mine)))
    print(
        f"torch {torch.__version__}: nanoGPT-convention GPT ({config['n_layer']} layers, "
        f"width {config['n_embd']}, {config['n_head']} heads, vocab {config['vocab_size']}, "
        f"T {config['block_size']}, gelu {config['gelu']}, lm_head bias "
        f"{config['lm_head_bias']}) loaded {len(state)} tensors from {path.name}; logits "
        f"{tokens.shape} max |torch - mpihybrid| = {diff:.2e} (max |logit| {scale:.2f}); "
        f"argmax agree {np.mean(theirs.argmax(-1) == mine.argmax(-1)):.4f}"
    )
    return 0 if diff <= TOLERANCE else 1


if __name__ == "__main__":
    sys.exit(main())
