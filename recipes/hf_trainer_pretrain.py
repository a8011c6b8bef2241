"""Pretraining with the transformers Trainer, watched by sinkwatch: the lines that matter are marked.

Tiny defaults run on a laptop CPU (a byte-level GPT-NeoX on the Python standard library's source);
real sizes by flag:

    python recipes/hf_trainer_pretrain.py                         # tiny, CPU
    python recipes/hf_trainer_pretrain.py --text corpus.txt --tokenizer EleutherAI/pythia-160m \\
        --d-model 768 --layers 12 --heads 12 --seq-len 1024 --batch-size 32 --steps 50000
"""

import argparse

from transformers import GPTNeoXConfig, GPTNeoXForCausalLM, Trainer, TrainingArguments

from sinkwatch.demo import DemoWindows, add_pretrain_arguments, pretrain_corpus
from sinkwatch.hf import SinkWatchTrainerCallback
from sinkwatch.probes import default_probes  # (1) import


class Windows(DemoWindows):
    def __getitem__(self, i):
        ids = super().__getitem__(i)
        return {"input_ids": ids, "labels": ids}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_pretrain_arguments(ap)
    ap.add_argument("--out", default="runs/hf_trainer_pretrain")
    args = ap.parse_args()

    corpus, vocab, vocab_range = pretrain_corpus(args.text, args.tokenizer)
    cfg = GPTNeoXConfig(vocab_size=vocab, hidden_size=args.d_model, intermediate_size=4 * args.d_model, num_hidden_layers=args.layers,
                        num_attention_heads=args.heads, max_position_embeddings=args.seq_len, bos_token_id=0, eos_token_id=0)
    watch = SinkWatchTrainerCallback(  # (2) the callback, with probes fitted to the data
        every_n_steps=max(1, args.steps // 20),
        out_dir=args.out,
        wandb=args.wandb,
        probes=default_probes(args.seq_len, vocab_range=vocab_range),
    )
    targs = TrainingArguments(
        output_dir=args.out,
        max_steps=args.steps,
        per_device_train_batch_size=args.batch_size,
        learning_rate=args.lr,
        warmup_steps=min(100, args.steps // 10),
        logging_steps=50,
        save_strategy="no",
        report_to=[],
        disable_tqdm=False,
    )
    train = Windows(corpus, args.steps * args.batch_size, seq_len=args.seq_len, periodic=0.5 if args.text is None else 0.0)
    Trainer(model=GPTNeoXForCausalLM(cfg), args=targs, train_dataset=train, callbacks=[watch]).train()  # (3) attach it
    print(f"records: {args.out}/records.jsonl; report: sinkwatch report {args.out}")  # (4) read the results


if __name__ == "__main__":
    main()
