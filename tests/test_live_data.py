"""The natural probe and the token count on the data real runs feed:
padded batches, long rows, streaming (IterableDataset) datasets, through the real trainers."""

import pytest
import torch
from tiny_models import build
from train_helpers import LitLM, trainer
from transformers import Trainer, TrainingArguments

from sinkwatch.hf import SinkWatchTrainerCallback
from sinkwatch.lightning import SinkWatchCallback
from sinkwatch.probes import bos_of_batch, natural_windows
from sinkwatch.reporting.jsonl import read_jsonl

PAD = 0


def padded_rows(n: int = 64, length: int = 48, seed: int = 0) -> list[dict]:
    """Rows of distinct tokens (row r uses ids 100 + r*... so each token names its row), right-padded
    with PAD to ``length`` at a different real length per row, with an attention mask."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(n):
        real = 24 + int(torch.randint(0, length - 24 + 1, (1,), generator=g))
        ids = torch.full((length,), PAD, dtype=torch.int64)
        ids[:real] = torch.randint(2, 250, (real,), generator=g)
        mask = (torch.arange(length) < real).long()
        rows.append({"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)})
    return rows


def _window_sources(windows: torch.Tensor, batch_ids: torch.Tensor, mask: torch.Tensor) -> list[int]:
    """For each window, the batch row whose real tokens contain it as a consecutive run."""
    out = []
    for w in windows:
        hits = []
        for r, (row, m) in enumerate(zip(batch_ids, mask)):
            real = row[m.bool()]
            if any(torch.equal(real[i : i + len(w)], w) for i in range(real.numel() - len(w) + 1)):
                hits.append(r)
        assert hits, "a window that is not a run of real tokens of any row"
        out.append(hits[0])
    return out


def test_natural_windows_spread_over_rows_and_skip_padding():
    ids = torch.arange(8 * 2048).view(8, 2048)  # every token names its row: row r holds r*2048 ..
    w = natural_windows(ids, 64, 32)
    assert w.shape == (32, 64)
    assert sorted({int(x) // 2048 for x in w[:, 0]}) == list(range(8))  # 4 windows from each of the 8 rows
    left_padded = torch.tensor([[PAD, PAD, 5, 6, 7, 8], [9, 10, 11, 12, PAD, PAD]])
    got = natural_windows(left_padded, 2, 10, pad_token_id=PAD)
    assert got.tolist() == [[5, 6], [9, 10], [7, 8], [11, 12]]
    mask = torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 0, 0]])
    assert natural_windows(left_padded, 2, 10, attention_mask=mask).tolist() == got.tolist()


def test_a_bos_trained_runs_windows_all_start_with_its_bos():
    """Rows that start with the model's BOS (a BOS-trained run): every window, mid-row ones too, is the
    BOS and then its row's text after the row's own BOS (formerly: B = 8, natural_n = 32 cut three
    windows in four mid-row, without the BOS)."""
    BOS = 1
    rows = torch.arange(2, 2 + 8 * 255).view(8, 255)
    ids = torch.cat([torch.full((8, 1), BOS), rows], dim=1)  # (8, 256): BOS + 255 tokens
    assert bos_of_batch(ids, BOS) == BOS and bos_of_batch(ids, 7) is None and bos_of_batch(ids, None) is None
    w = natural_windows(ids, 64, 32, bos_token_id=BOS)
    assert w.shape == (32, 64) and (w[:, 0] == BOS).all() and (w[:, 1:] != BOS).all()
    first_of_row0 = w[0, 1:].tolist()
    assert first_of_row0 == rows[0, :63].tolist() and w[8, 1:].tolist() == rows[0, 63:126].tolist()  # consecutive, no overlap
    mixed = ids.clone()
    mixed[3, 0] = 5  # one row without the BOS: not a BOS-trained batch
    assert bos_of_batch(mixed, BOS) is None
    padded = torch.cat([torch.zeros(8, 2, dtype=torch.int64), ids], dim=1)
    mask = torch.cat([torch.zeros(8, 2, dtype=torch.int64), torch.ones(8, 256, dtype=torch.int64)], dim=1)
    assert bos_of_batch(padded, BOS, attention_mask=mask) == BOS  # left padding before the BOS


def test_live_natural_probe_of_a_bos_trained_run_records_its_bos(tmp_path):
    from sinkwatch.live import LiveConfig, LiveMonitor

    model = build("llama", seed=1)  # config.bos_token_id = 0
    ids = torch.cat([torch.zeros(8, 1, dtype=torch.int64), torch.randint(2, 256, (8, 127))], dim=1)
    live = LiveMonitor(LiveConfig(out_dir=str(tmp_path), wandb="disabled", console=False, probes=None))
    live.setup(model, is_global_zero=True)
    live.batch_start({"input_ids": ids})
    assert live.natural is not None and live.natural.params["bos_token_id"] == 0
    assert (live.natural.tokens[:, 0] == 0).all() and live.natural.n == 16  # 2 windows of 1 + 63 per row


def test_lightning_natural_probe_comes_from_every_row_and_no_padding(tmp_path):
    data = padded_rows()
    first = torch.stack([d["input_ids"] for d in data[:8]]), torch.stack([d["attention_mask"] for d in data[:8]])
    cb = SinkWatchCallback(every_n_steps=2, natural_n=8, natural_seq_len=16, out_dir=str(tmp_path / "sw"), wandb="disabled", console=False)
    trainer(tmp_path, [cb], max_steps=2).fit(LitLM(build("llama")), torch.utils.data.DataLoader(data, batch_size=8))
    windows = cb.live.natural.tokens
    assert windows.shape == (8, 16)
    assert not (windows == PAD).any()  # padding is never a probe token
    assert sorted(_window_sources(windows, *first)) == list(range(8))  # one window from each row of the first batch
    records = read_jsonl(tmp_path / "sw" / "records.jsonl")
    assert records[0]["probe"].startswith("natural")


class Stream(torch.utils.data.IterableDataset):
    """A streaming dataset (no __len__, no indexing), like ``datasets.load_dataset(..., streaming=True)``."""

    def __init__(self, rows: list[dict]):
        self.rows = rows

    def __iter__(self):
        yield from self.rows


def hf_args(tmp_path, **kw):
    base = dict(
        output_dir=str(tmp_path / "out"), max_steps=6, per_device_train_batch_size=8, learning_rate=3e-3, use_cpu=True,
        report_to=[], save_strategy="no", logging_steps=1, seed=11, disable_tqdm=True, dataloader_num_workers=0,
    )  # fmt: skip
    base.update(kw)
    return TrainingArguments(**base)


@pytest.mark.parametrize("streaming", [True, False])
def test_hf_natural_probe_and_tokens_from_the_batches_the_trainer_feeds(tmp_path, streaming):
    data = padded_rows()
    every_row = torch.stack([d["input_ids"] for d in data]), torch.stack([d["attention_mask"] for d in data])
    cb = SinkWatchTrainerCallback(
        every_n_steps=3, natural_n=8, natural_seq_len=16, out_dir=str(tmp_path / "sw"), wandb="disabled", console=False
    )
    dataset = Stream(data) if streaming else data
    Trainer(model=build("llama"), args=hf_args(tmp_path), train_dataset=dataset, callbacks=[cb]).train()
    records = read_jsonl(tmp_path / "sw" / "records.jsonl")
    assert [r["step"] for r in records] == [0, 3, 6]
    assert [r["tokens"] for r in records] == [0, 3 * 8 * 48, 6 * 8 * 48]  # counted from the batches fed, never 0
    assert all(r["probe"] == "natural+induction+repeated" for r in records)
    windows = cb.live.natural.tokens
    assert not (windows == PAD).any()
    sources = _window_sources(windows, *every_row)
    assert len(set(sources)) == 8  # one window from each row of the first batch fed
    if streaming:  # no sampler: the first batch is the stream's first 8 rows
        assert sorted(sources) == list(range(8))


class RandomCrop(torch.utils.data.Dataset):
    """A map-style dataset with a random transform: each item read draws from torch's global RNG."""

    def __init__(self, rows: list[dict]):
        self.rows = rows

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        shift = int(torch.randint(0, 8, (1,)))
        ids = torch.roll(self.rows[i]["input_ids"], shift)
        return {"input_ids": ids, "labels": ids}


def test_hf_callback_never_reads_dataset_items(tmp_path):
    # reading items outside the training loop would draw the transform's random numbers and shift training
    def losses(with_cb: bool) -> list[float]:
        cbs = [SinkWatchTrainerCallback(every_n_steps=3, out_dir=str(tmp_path / "sw"), wandb="disabled", console=False)] if with_cb else []
        data = RandomCrop(padded_rows())
        t = Trainer(model=build("llama", seed=3), args=hf_args(tmp_path, max_steps=4), train_dataset=data, callbacks=cbs)
        t.train()
        return [h["loss"] for h in t.state.log_history if "loss" in h]

    assert losses(False) == losses(True)
