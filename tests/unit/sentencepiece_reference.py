"""Reference side of test_sentencepiece: models trained and run by the `sentencepiece` package.

  sentencepiece_reference.py make DIR KIND CORPUS...  train DIR/tokenizer.model; KIND:
                            bpe, unigram   Llama-2's settings (identity normalization, dummy
                                           prefix, extra whitespace kept, digits split, byte
                                           fallback) and a user-defined <|im_start|>
                            gemma          Gemma's settings: bpe as above without the dummy
                                           prefix, <pad> <eos> <bos> <unk> at ids 0-3 and the
                                           user-defined <start_of_turn>, <end_of_turn>
                            nfkc           unigram with sentencepiece's defaults (NFKC,
                                           whitespace runs collapsed) and no byte fallback:
                                           characters outside the vocabulary become <unk>
  sentencepiece_reference.py strings N SEED  N varied test strings as a JSON list
  sentencepiece_reference.py encode DIR STRINGS_JSON  {"ids": [...], "decoded": [...]}: each
                            string's ids and what decoding those ids gives
  sentencepiece_reference.py hf DIR STRINGS_JSON  the ids of transformers' LlamaTokenizerFast
                            converted from DIR/tokenizer.model (a BPE model; needs protobuf);
                            also saves its tokenizer.json into DIR
"""
import io
import json
import os
import random
import sys

import sentencepiece as spm

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bpe_reference import strings as bpe_strings  # noqa: E402

# Beyond the BPE test's strings: characters no small model has seen (byte fallback or <unk>),
# long whitespace and digit runs, the control symbols' text, the user-defined symbol.
EXTRA = ["\u16a0\u16a1", "\U0001f9ec", "\u0f00", "\u2603\ufe0f", "\u00a0\u00a0", "    ",
         "\t\t\t", "\n\n\n", "000000", "12345678901234567890", "-1.5e10", "<s>", "</s>",
         "<unk>", "<|im_start|>", "x<|im_start|>y", "\u2581", "\u2581\u2581a", "ﾊﾝｶｸ", "①②"]


def strings(n, seed):
    rng = random.Random(seed)
    out = bpe_strings(n, seed)
    for i in range(0, n, 3):
        k = rng.randint(1, 4)
        out[i] = "".join(rng.choice(EXTRA) for _ in range(k)) + out[i]
    return out


def make(path, kind, corpus_files):
    corpus = strings(3000, 7)
    for f in corpus_files:
        corpus += open(f, encoding="utf-8").read().split("\n")
    options = dict(vocab_size=1000, hard_vocab_limit=False, character_coverage=0.99,
                   minloglevel=2, num_threads=1)
    if kind in ("bpe", "unigram"):
        options.update(model_type=kind, byte_fallback=True, normalization_rule_name="identity",
                       remove_extra_whitespaces=False, split_digits=True,
                       allow_whitespace_only_pieces=True, user_defined_symbols=["<|im_start|>"])
    elif kind == "gemma":
        options.update(model_type="bpe", byte_fallback=True, normalization_rule_name="identity",
                       add_dummy_prefix=False, remove_extra_whitespaces=False, split_digits=True,
                       allow_whitespace_only_pieces=True,
                       user_defined_symbols=["<start_of_turn>", "<end_of_turn>"],
                       pad_id=0, eos_id=1, bos_id=2, unk_id=3, pad_piece="<pad>",
                       eos_piece="<eos>", bos_piece="<bos>", unk_piece="<unk>")
    elif kind == "nfkc":
        options.update(model_type="unigram")
    else:
        raise SystemExit("unknown kind " + kind)
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(sentence_iterator=iter(corpus), model_writer=model, **options)
    with open(os.path.join(path, "tokenizer.model"), "wb") as f:
        f.write(model.getvalue())


def encode(path, strings_file):
    sp = spm.SentencePieceProcessor(model_file=os.path.join(path, "tokenizer.model"))
    texts = json.load(open(strings_file, encoding="utf-8"))
    ids = [sp.encode(s) for s in texts]
    print(json.dumps({"ids": ids, "decoded": [sp.decode(i) for i in ids],
                      "bos": sp.bos_id(), "eos": sp.eos_id(), "size": sp.get_piece_size()}))


def hf(path, strings_file):
    from transformers import LlamaTokenizerFast
    from transformers.convert_slow_tokenizer import SentencePieceExtractor

    # transformers' own conversion of the model: vocabulary, merges, user-defined and control
    # pieces as added tokens, Metaspace, byte fallback.
    converted = SentencePieceExtractor(os.path.join(path, "tokenizer.model")).extract(None)
    tok = LlamaTokenizerFast(**converted)
    tok.save_pretrained(path)
    texts = json.load(open(strings_file, encoding="utf-8"))
    print(json.dumps([tok.encode(s, add_special_tokens=False) for s in texts]))


if __name__ == "__main__":
    cmd = sys.argv[1]
    if cmd == "make":
        make(sys.argv[2], sys.argv[3], sys.argv[4:])
    elif cmd == "strings":
        print(json.dumps(strings(int(sys.argv[2]), int(sys.argv[3]))))
    elif cmd == "encode":
        encode(sys.argv[2], sys.argv[3])
    elif cmd == "hf":
        hf(sys.argv[2], sys.argv[3])
    else:
        raise SystemExit(__doc__)
