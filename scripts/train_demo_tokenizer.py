"""Train the demo byte-level BPE tokenizer (``demo/tokenizer.json``) on the demo corpus, offline.

    python scripts/train_demo_tokenizer.py [--data demo/data] [--out demo/tokenizer.json]

The corpus comes from :func:`lakeloader.demo.prepare_corpus` (size "demo": code, docs and
notes, all real text from the Python standard library), written under ``--data`` unless
already there.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from lakeloader.demo.corpus import iter_texts, prepare_corpus  # noqa: E402

log = logging.getLogger("train_demo_tokenizer")

VOCAB_SIZE = 8192
MIN_FREQUENCY = 2
# Ids 0, 1, 2, ... in this order.
SPECIAL_TOKENS = [
    "<|endoftext|>", "<|bos|>", "<|pad|>", "<|sep|>", "<|im_start|>", "<|im_end|>",
    "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|image|>", "<|image_start|>", "<|image_end|>",
]


def corpus_texts(data_dir: Path) -> list[str]:
    """All documents of the demo corpus's datasets, in dataset then file order."""
    files = prepare_corpus(data_dir, "demo")
    return [text for dataset in sorted(files) for text in iter_texts(sorted(files[dataset]))]


def train(texts: Sequence[str]) -> Tokenizer:
    """A byte-level BPE trained on ``texts`` (no normalizer, no post-processor)."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=MIN_FREQUENCY,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer, length=len(texts))
    return tokenizer


def main(argv: Sequence[str] | None = None) -> int:
    """Prepare the corpus, train, check the special-token ids and write the tokenizer."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", type=Path, default=REPO / "demo" / "data", help="corpus folder")
    parser.add_argument("--out", type=Path, default=REPO / "demo" / "tokenizer.json")
    parser.add_argument("--check-determinism", action="store_true",
                        help="train a second time and fail unless both results are byte-identical")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    texts = corpus_texts(args.data)
    log.info("training on %d documents (%d characters)", len(texts), sum(map(len, texts)))
    start = time.perf_counter()
    tokenizer = train(texts)
    seconds = time.perf_counter() - start
    for expected_id, token in enumerate(SPECIAL_TOKENS):
        if tokenizer.token_to_id(token) != expected_id:
            raise SystemExit(f"{token} got id {tokenizer.token_to_id(token)}, expected {expected_id}")
    result = tokenizer.to_str(pretty=True)
    if args.check_determinism:
        again = train(texts).to_str(pretty=True)
        if again != result:
            raise SystemExit("training is not deterministic: two runs gave different tokenizers")
        log.info("determinism check passed: a second training gave the same bytes")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(result + "\n", encoding="utf-8")
    print(f"trained {tokenizer.get_vocab_size()} tokens on {len(texts):,} documents in {seconds:.1f}s -> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
