"""A tiny OLMo-core run on CPU: token file, model, train module, data loader, Trainer (tests and the
two-process launcher share it). Imports olmo_core inside functions: import this module only after
``pytest.importorskip("olmo_core")``."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import torch

VOCAB = 64
SEQ = 64
D_MODEL, N_LAYERS, N_HEADS, N_KV_HEADS = 32, 2, 4, 2


def token_file(dir: Path, n_tokens: int = SEQ * 64, seed: int = 0, bos: int | None = None) -> str:
    """Repeated random segments (induction-friendly text) as OLMo-core's uint16 token array; with
    ``bos``, every other SEQ-token instance starts with that id (the others never do)."""
    rng = np.random.default_rng(seed)
    seg = [np.tile(rng.integers(1, VOCAB, size=16), 2) for _ in range(n_tokens // 32)]
    path = Path(dir) / "tokens.npy"
    if path.exists():  # written by rank 0 before the ranks start
        return str(path)
    tokens = np.concatenate(seg)
    if bos is not None:
        tokens[:: 2 * SEQ] = bos
    tokens.astype(np.uint16).tofile(path)
    return str(path)


def model_config(*, moe: bool = False, window: int | None = None):
    """OLMo-2-like blocks (reordered norm, QK norm: convertible to HF), GQA; a sliding window on
    every layer but the last when ``window``; a (capacity-factor) MoE feed-forward when ``moe``."""
    from olmo_core.nn.attention import SlidingWindowAttentionConfig
    from olmo_core.nn.transformer import TransformerBlockType, TransformerConfig

    common = dict(d_model=D_MODEL, vocab_size=VOCAB, n_layers=N_LAYERS, n_heads=N_HEADS, n_kv_heads=N_KV_HEADS, hidden_size_multiple_of=16)
    if window is not None:
        common["sliding_window"] = SlidingWindowAttentionConfig(
            pattern=[window, -1], force_full_attention_on_first_layer=False, force_full_attention_on_last_layer=True
        )
    if moe:
        return TransformerConfig.llama_like_moe(num_experts=4, top_k=2, expert_hidden_size=32, capacity_factor=2.0, **common)
    return TransformerConfig.llama_like(block_name=TransformerBlockType.reordered_norm, qk_norm=True, layer_norm_eps=1e-6, **common)


def build_trainer(
    work: Path,
    callbacks: dict,
    *,
    steps: int,
    save_interval: int | None = None,
    moe: bool = False,
    window: int | None = None,
    global_seqs: int = 4,
    micro_seqs: int = 2,
    dp: str | None = None,
    hsdp_replicas: int | None = None,
    seed: int = 0,
    autocast_precision: torch.dtype | None = None,
):
    """A Trainer for ``steps`` steps of ``global_seqs`` x SEQ tokens, checkpoints in work/ckpt."""
    from olmo_core.config import DType
    from olmo_core.data import NumpyDataLoaderConfig, NumpyFSLDatasetConfig, TokenizerConfig
    from olmo_core.optim import AdamWConfig
    from olmo_core.train import Duration, TrainerConfig
    from olmo_core.train.callbacks import CheckpointerCallback
    from olmo_core.train.train_module import TransformerTrainModuleConfig
    from olmo_core.train.train_module.transformer.config import TransformerDataParallelConfig

    work = Path(work)
    data = work / "data"
    data.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    model = model_config(moe=moe, window=window).build(init_device="cpu")
    tokenizer = TokenizerConfig(vocab_size=VOCAB, eos_token_id=0, pad_token_id=0)
    dataset = NumpyFSLDatasetConfig(
        tokenizer=tokenizer, paths=[token_file(data)], sequence_length=SEQ, work_dir=str(data / "ds"), dtype="uint16"
    ).build()
    dp_config = None
    if dp is not None:
        from olmo_core.distributed.parallel import DataParallelType

        dp_config = TransformerDataParallelConfig(name=DataParallelType(dp), num_replicas=hsdp_replicas)
    train_module = TransformerTrainModuleConfig(
        rank_microbatch_size=micro_seqs * SEQ, max_sequence_length=SEQ, optim=AdamWConfig(lr=3e-3), dp_config=dp_config,
        autocast_precision=None if autocast_precision is None else DType(str(autocast_precision).removeprefix("torch.")),
    ).build(model, device=torch.device("cpu"))
    loader = NumpyDataLoaderConfig(global_batch_size=global_seqs * SEQ, seed=seed, work_dir=str(data / "dl"), num_workers=0).build(dataset)
    cbs = dict(callbacks)
    cbs["checkpointer"] = CheckpointerCallback(save_interval=save_interval or 10**9, save_async=False)
    return TrainerConfig(
        save_folder=str(work / "ckpt"),
        work_dir=str(work / "work"),
        max_duration=Duration.steps(steps),
        metrics_collect_interval=1,
        device="cpu",
        callbacks=cbs,
        save_overwrite=True,
    ).build(train_module, loader)


def model_state(trainer) -> dict[str, torch.Tensor]:
    from olmo_core.distributed.utils import get_full_tensor

    return {k: get_full_tensor(v).detach().clone() for k, v in trainer.train_module.model.state_dict().items()}


os.environ.setdefault("OLMO_SHARED_FS", "1")


def metrics_log_callback(logged: dict):
    """A real OLMo-core callback that keeps what the trainer hands its metrics callbacks (W&B, Comet
    see the same), per step, for the ``sinkwatch/`` names."""
    from olmo_core.train.callbacks import Callback

    class MetricsLog(Callback):
        def log_metrics(self, step, metrics):
            picked = {k: v for k, v in metrics.items() if k.startswith("sinkwatch/")}
            if picked:
                logged.setdefault(step, {}).update(picked)

    return MetricsLog()


def crash_callback(at_step: int):
    """Raise after step ``at_step`` (a preemption after the checkpoint and a probe were written)."""
    from olmo_core.train.callbacks import Callback

    class Crash(Callback):
        def post_step(self):
            if self.trainer.global_step == at_step:
                raise RuntimeError(f"simulated preemption after step {at_step}")

    return Crash()
