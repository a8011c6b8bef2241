"""Pretraining with the transformers Trainer, watched by sinkwatch: the lines that matter are marked.

Tiny defaults run on a laptop CPU (a byte-level GPT-NeoX on the Python standard library's source);
real sizes by flag:

    python recipes/hf_trainer_pretrain.py                         # tiny, CPU
    python recipes/hf_trainer_pretrain.py --text corpus.txt --tokenizer EleutherAI/pythia-160m \\
        --d-model 768 --layers 12 --heads 12 --seq-len 1024 --batch-size 32 --steps 50000
"""

import argparse

import numpy as np
from transformers import GPTNeoXConfig, GPTNeoXForCausalLM, Trainer, TrainingArguments

from sinkwatch import InductionProbe, RepeatedRandomProbe  # (1) import
from sinkwatch.demo import DemoWindows, stdlib_bytes
from sinkwatch.hf import SinkWatchTrainerCallback


class Windows(DemoWindows):
    def __getitem__(self, i):
        ids = super().__getitem__(i)
        return {"input_ids": ids, "labels": ids}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--text", default=None, help="a UTF-8 text file (default: the standard library's source, byte-level)")
    ap.add_argument("--tokenizer", default="EleutherAI/pythia-160m", help="with --text")
    ap.add_argument("--d-model", type=int, default=128)
    ap.add_argument("--layers", type=int, default=3)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--out", default="runs/hf_trainer_pretrain")
    ap.add_argument("--wandb", default="offline", choices=("offline", "online", "disabled"))
    args = ap.parse_args()

    if args.text is None:
        corpus, vocab = stdlib_bytes(), 256
    else:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(args.tokenizer)
        corpus = np.asarray(tok(open(args.text, encoding="utf-8").read(), add_special_tokens=False)["input_ids"], dtype=np.int64)
        vocab = len(tok)
    cfg = GPTNeoXConfig(vocab_size=vocab, hidden_size=args.d_model, intermediate_size=4 * args.d_model, num_hidden_layers=args.layers,
                        num_attention_heads=args.heads, max_position_embeddings=args.seq_len, bos_token_id=0, eos_token_id=0)
    vocab_range = (32, 127) if args.text is None else None
    watch = SinkWatchTrainerCallback(  # (2) the callback, with probes fitted to the data
        every_n_steps=max(1, args.steps // 20), out_dir=args.out, wandb=args.wandb,
        probes=[InductionProbe(n=100, seq_len=min(256, args.seq_len), vocab_range=vocab_range), RepeatedRandomProbe(n=32, seq_len=min(128, args.seq_len), vocab_range=vocab_range)],
    )
    targs = TrainingArguments(output_dir=args.out, max_steps=args.steps, per_device_train_batch_size=args.batch_size, learning_rate=args.lr,
                              warmup_steps=min(100, args.steps // 10), logging_steps=50, save_strategy="no", report_to=[], disable_tqdm=False)
    train = Windows(corpus, args.steps * args.batch_size, seq_len=args.seq_len, periodic=0.5 if args.text is None else 0.0)
    Trainer(model=GPTNeoXForCausalLM(cfg), args=targs, train_dataset=train, callbacks=[watch]).train()  # (3) attach it
    print(f"records: {args.out}/records.jsonl; report: sinkwatch report {args.out}")  # (4) read the results


if __name__ == "__main__":
    main()
