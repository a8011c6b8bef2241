"""A real developmental trajectory: a tiny model trained by the tests until induction forms.

The data repeats a random segment whose period varies per sequence (8..47 tokens), so a fixed
positional offset cannot solve it: the model has to learn content-based induction, which is what
the paper's single-bigram probe measures. Probes every ``every`` steps with both induction probes.
"""

from __future__ import annotations

import numpy as np
import torch
from tiny_models import VOCAB, build

from sinkwatch import InductionProbe, Monitor, RepeatedRandomProbe

TOKENS_PER_STEP = 16 * 128
SAVE_STEPS = (0, 100, 300, 600, 900, 1300)
# 1500 steps: on this 2-core machine the best head reaches 49.3x at step 1200 and 72.5x at 1300, so the
# >= 50x rule first holds at 1300 and needs one more probe (patience 2) to be declared; 1300 steps left
# that to the last probe and to the CPU's rounding


def periodic_batch(rng: np.random.RandomState, batch: int, seq_len: int) -> torch.Tensor:
    x = np.empty((batch, seq_len), dtype=np.int64)
    for b in range(batch):
        period = rng.randint(8, 48)
        x[b] = np.tile(rng.randint(2, VOCAB, size=period), seq_len // period + 1)[:seq_len]
    return torch.from_numpy(x)


def train_with_probes(
    family: str = "llama", steps: int = 1500, every: int = 100, seed: int = 0, lr: float = 3e-3, save_dir=None, save_steps=()
) -> list[dict]:
    """Records (docs/design.md §10, untracked) at steps 0, every, 2*every, ..., steps; with ``save_dir``,
    ``save_pretrained`` checkpoints at ``save_steps`` (save_dir/step{N})."""
    torch.manual_seed(seed)
    rng = np.random.RandomState(seed)
    model = build(family, hidden_size=64, intermediate_size=128, max_position_embeddings=256)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    monitor = Monitor([InductionProbe(n=64, seq_len=128), RepeatedRandomProbe(n=16, seq_len=64)])
    records = []
    for step in range(steps + 1):
        if step % every == 0:
            records.append(monitor.probe(model, step=step, tokens=step * TOKENS_PER_STEP).to_record())
        if save_dir is not None and step in save_steps:
            model.save_pretrained(f"{save_dir}/step{step}")
        if step == steps:
            break
        model.train()
        ids = periodic_batch(rng, 16, 128)
        loss = model(input_ids=ids, labels=ids).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    return records


def hf_cache_from_checkpoints(checkpoints: dict, cache_dir, repo: str = "sinkwatch-test/tiny-llama") -> str:
    """A Hugging Face hub cache holding ``checkpoints`` (revision -> save_pretrained dir) as revisions.

    Layout as the hub client writes it: models--org--name/refs/<rev> holds a commit id and
    snapshots/<commit>/ holds the files, so from_pretrained(repo, revision=rev) resolves it offline.
    """
    import hashlib
    import shutil
    from pathlib import Path

    root = Path(cache_dir) / ("models--" + repo.replace("/", "--"))
    for rev, src in checkpoints.items():
        commit = hashlib.sha1(rev.encode()).hexdigest()
        (root / "refs").mkdir(parents=True, exist_ok=True)
        (root / "refs" / rev).write_text(commit)
        shutil.copytree(src, root / "snapshots" / commit, dirs_exist_ok=True)
    return repo
