"""Peer of bench/tokenize.sh: Hugging Face `tokenizers` batch-encoding the same documents with
the same tokenizer.json that `shardlm tokenize` reads.

  tokenize_peer.py tokenizer RANKS DIR      DIR/tokenizer.json from GPT-2's real ranks (a
                                            gpt2.tiktoken file), converted by transformers'
                                            TikTokenConverter, with <|endoftext|> = 50256
  tokenize_peer.py encode DIR TEXT THREADS  encodes TEXT's documents (maximal runs of non-blank
                                            lines, each line ending in "\\n": shardlm's rule)
                                            with Tokenizer.encode_batch on THREADS threads; one
                                            JSON line: documents, tokens (+1 end-of-text per
                                            document, as shardlm counts), best seconds of 3
"""
import json
import os
import sys
import time

GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""


def make_tokenizer(ranks, out_dir):
    from transformers.convert_slow_tokenizer import TikTokenConverter
    tok = TikTokenConverter(vocab_file=ranks, pattern=GPT2_PATTERN).converted()
    tok.add_special_tokens(["<|endoftext|>"])
    assert tok.token_to_id("<|endoftext|>") == 50256
    os.makedirs(out_dir, exist_ok=True)
    tok.save(os.path.join(out_dir, "tokenizer.json"))


def documents(path):
    docs, cur = [], []
    with open(path, "rb") as f:
        for raw in f:
            line = raw.rstrip(b"\n")
            if line in (b"", b"\r"):
                if cur:
                    docs.append(b"".join(cur).decode("utf-8"))
                    cur = []
            else:
                cur.append(line + b"\n")
    if cur:
        docs.append(b"".join(cur).decode("utf-8"))
    return docs


def encode(tok_dir, text, threads):
    os.environ["RAYON_NUM_THREADS"] = str(threads)  # before tokenizers starts its pool
    os.environ["TOKENIZERS_PARALLELISM"] = "true"
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(os.path.join(tok_dir, "tokenizer.json"))
    docs = documents(text)
    best = None
    for _ in range(3):
        t0 = time.perf_counter()
        enc = tok.encode_batch(docs, add_special_tokens=False)
        dt = time.perf_counter() - t0
        best = dt if best is None else min(best, dt)
    tokens = sum(len(e.ids) for e in enc) + len(docs)
    print(json.dumps({"documents": len(docs), "tokens": tokens, "seconds": best,
                      "tokens_per_s": tokens / best}))


if __name__ == "__main__":
    if sys.argv[1] == "tokenizer":
        make_tokenizer(sys.argv[2], sys.argv[3])
    elif sys.argv[1] == "encode":
        encode(sys.argv[2], sys.argv[3], int(sys.argv[4]))
    else:
        raise SystemExit(__doc__)
