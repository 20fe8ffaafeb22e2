"""Make the small trained adapter that ``bench/local_backend.py --episodes --adapter`` serves: a rank-4 LoRA of the
embedded model that calls tools, so its episodes take several steps (the base model's rarely do). It is trained
with SFT on a few of the tools suite's demonstration steps that call a tool (first calls and the calls that follow
a result), several epochs over them: over-fitted on purpose, since what the benchmark needs is an agent that acts,
not a good one. Committed under
``bench/fixtures/tools-sft-r4/``; rerun this only to remake it (about ten minutes of CPU).

    python -m bench.make_adapter_fixture [--rows 64] [--epochs 4] [--out bench/fixtures/tools-sft-r4]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import shutil
import tempfile
from pathlib import Path

from replay.filters import Filters
from training.capture import capture
from training.data import examples_from_store
from training.settings import HarnessSettings
from training.sft import SFTConfig, load_base, train_sft

OUT = Path(__file__).resolve().parent / "fixtures" / "tools-sft-r4"
README = """# tools-sft-r4

A rank-4 LoRA (q, v and o projections) of the embedded SmolLM2-135M-Instruct, trained for {steps} SFT steps (batches of
8, learning rate {lr}) on {rows} of the tools suite's demonstration steps that call a tool ({epochs:g} epochs; loss
{first:.2f} -> {last:.2f}, {seconds:.0f} s). Over-fitted on purpose: it calls a tool at every step, so its episodes
run to the step limit, which is what `bench/local_backend.py --episodes` measures the prefix cache on. Not a good
agent. Made by `python -m bench.make_adapter_fixture`.
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=64, help="Demonstration steps that call a tool to train on.")
    parser.add_argument("--epochs", type=float, default=4.0)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        settings = HarnessSettings.model_validate({"store": {"path": str(Path(tmp) / "demos.db")}})
        asyncio.run(capture(settings, "tools", "train", demos=True, attempts=0))
        loaded = load_base()
        examples, _ = examples_from_store(settings.store.path, Filters(source="demo"), loaded.tokenizer,
                                          max_seq_len=1024)
        calls = [e for e in examples if "<tool_call>" in loaded.tokenizer.decode([t for t in e.labels if t != -100])]
        rows = random.Random(0).sample(calls, min(args.rows, len(calls)))
        config = SFTConfig.from_settings(rank=4, alpha=8.0, target_modules=["q_proj", "v_proj", "o_proj"],
                                         batch_size=8, grad_accum=1, learning_rate=args.lr, epochs=args.epochs,
                                         checkpoints=1, gradient_checkpointing=True, rendering="hermes")
        result = train_sft(None, rows, config, Path(tmp) / "sft", loaded=loaded)
        print(f"{len(rows)} of {len(calls)} steps that call a tool; {len(result.losses)} steps in "
              f"{result.seconds:.0f} s, loss {result.losses[0]:.3f} -> {result.losses[-1]:.3f}")
        shutil.rmtree(args.out, ignore_errors=True)
        shutil.copytree(result.checkpoints[-1], args.out, ignore=shutil.ignore_patterns("README.md"))
        (args.out / "README.md").write_text(README.format(
            steps=len(result.losses), lr=args.lr, rows=len(rows), epochs=args.epochs, first=result.losses[0],
            last=result.losses[-1], seconds=result.seconds))
    print(f"adapter written to {args.out}")


if __name__ == "__main__":
    main()
