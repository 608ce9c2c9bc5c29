"""Reference side of test_bpe: byte-level BPE tokenizers built and run by Hugging Face `tokenizers`.

  bpe_reference.py make DIR KIND            gpt2 | llama3 | qwen2 | qwen3 | chatml | glm4: train
                                            a small tokenizer, save DIR/tokenizer.json (qwen3:
                                            Qwen2's pipeline and Qwen3's added tokens, the
                                            think and tool-call markers not special; glm4:
                                            Llama 3's split and GLM-4's special tokens)
  bpe_reference.py strings N SEED           N varied test strings as a JSON list
  bpe_reference.py encode DIR STRINGS_JSON  the ids of each string (no special tokens added)
  bpe_reference.py vocabmerges DIR          DIR/tokenizer.json's model as vocab.json + merges.txt
  bpe_reference.py tiktoken DIR STRINGS_JSON  DIR/tokenizer.json's vocabulary as a tiktoken rank
                                            file DIR/ranks.tiktoken, and tiktoken's ids
  bpe_reference.py gpt2 RANKS STRINGS_JSON  tiktoken's ids with GPT-2's real ranks (a
                                            gpt2.tiktoken file), regex and <|endoftext|>
  bpe_reference.py chat DIR TEMPLATE MESSAGES_JSON  a chat rendered with the Llama-3 or ChatML
                                            template (Jinja, as transformers renders it), encoded
"""
import json
import random
import sys

from tokenizers import (AddedToken, Regex, Tokenizer, decoders, models, normalizers,
                        pre_tokenizers, processors, trainers)

QWEN2_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}|"
                 r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
LLAMA3_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|"
                  r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")

WORDS = ["the", "The", "tokenizer", "don't", "I'LL", "we've", "it's", "naïve", "café", "Straße",
         "中文", "字符", "日本語", "한국어", "Привет", "мир", "مرحبا", "😀", "👍🏽", "e\u0301", "ﬁ", "A\u030a", "\u212b", "n\u0303o",
         "123", "4567890", "3.14159", "1,000", "$5", "#tag", "@user", "<|endoftext|>",
         "<|begin_of_text|>", "<|eot_id|>", "<think>", "</think>", "hello_world", "C++", "->", "...", "\"quoted\""]
SPACES = [" ", "  ", "   ", "\t", "\n", "\n\n", " \n ", "\r\n", "\u00a0", "\u3000", ""]


def strings(n, seed):
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        k = rng.randint(0, 12)
        s = "".join(rng.choice(WORDS) + rng.choice(SPACES) for _ in range(k))
        if rng.random() < 0.2:
            s = s.upper()
        if rng.random() < 0.1:  # random code points, surrogates excluded
            s += "".join(chr(rng.choice([rng.randint(32, 0xd7ff), rng.randint(0xe000, 0x10ffff)]))
                         for _ in range(rng.randint(1, 5)))
        out.append(s)
    return out


def make(path, kind):
    corpus = strings(3000, 7) + [open(f).read() for f in sys.argv[4:]]
    chatml = kind in ("chatml", "qwen2", "qwen3")
    special = ["<|endoftext|>"] if kind == "gpt2" else [
        "<|endoftext|>", "<|im_start|>", "<|im_end|>"] if chatml else [
        "<|endoftext|>", "[MASK]", "[gMASK]", "[sMASK]", "<sop>", "<eop>", "<|system|>",
        "<|user|>", "<|assistant|>", "<|observation|>"] if kind == "glm4" else [
        "<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>", "<|start_header_id|>",
        "<|end_header_id|>"]
    if kind in ("gpt2", "chatml"):
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    else:
        tok = Tokenizer(models.BPE(ignore_merges=kind == "llama3"))
        if kind in ("qwen2", "qwen3"):
            tok.normalizer = normalizers.NFC()
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(LLAMA3_PATTERN if kind in ("llama3", "glm4")
                                       else QWEN2_PATTERN),
                                 behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
        if kind == "qwen3":
            tok.post_processor = processors.ByteLevel(trim_offsets=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=700, special_tokens=special, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus, trainer)
    if kind == "qwen3":  # as Qwen3's tokenizer.json: added, not special, not normalized
        tok.add_tokens([AddedToken(t, special=False, normalized=False)
                        for t in ("<tool_call>", "</tool_call>", "<think>", "</think>")])
    tok.save(path + "/tokenizer.json")


def encode(path, strings_file):
    tok = Tokenizer.from_file(path + "/tokenizer.json")
    texts = json.load(open(strings_file))
    norm = tok.normalizer.normalize_str if tok.normalizer else (lambda s: s)
    print(json.dumps({"ids": [tok.encode(s, add_special_tokens=False).ids for s in texts],
                      "normalized": [norm(s) for s in texts]}))


TEMPLATES = {
    # Llama-3's template: the bos token, then each message with its header, content trimmed.
    "llama3": ("{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}"
               "<|end_header_id|>\n\n{{ m['content'] | trim }}<|eot_id|>{% endfor %}"),
    # ChatML (Qwen).
    "chatml": ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
               "<|im_end|>\n{% endfor %}"),
}


def vocabmerges(path):
    Tokenizer.from_file(path + "/tokenizer.json").model.save(path)


def byte_decoder():
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(0xa1, 0xac + 1)) + \
        list(range(0xae, 0xff + 1))
    chars, n = {}, 0
    for b in range(256):
        if b in keep:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + n)
            n += 1
    return {c: b for b, c in chars.items()}


def tiktoken_ranks(path, strings_file):
    import base64
    import tiktoken
    doc = json.load(open(path + "/tokenizer.json"))
    specials = {a["id"] for a in doc["added_tokens"]}
    dec = byte_decoder()
    ranks = {bytes(dec[c] for c in tok): i for tok, i in doc["model"]["vocab"].items()
             if i not in specials}
    with open(path + "/ranks.tiktoken", "w") as f:
        for b, i in sorted(ranks.items(), key=lambda kv: kv[1]):
            f.write(base64.b64encode(b).decode() + " " + str(i) + "\n")
    gpt2 = (r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+""")
    enc = tiktoken.Encoding("test", pat_str=gpt2, mergeable_ranks=ranks, special_tokens={})
    texts = json.load(open(strings_file))
    print(json.dumps([enc.encode(s, disallowed_special=()) for s in texts]))


def chat(path, template, messages_file):
    import jinja2
    tok = Tokenizer.from_file(path + "/tokenizer.json")
    messages = json.load(open(messages_file))
    text = jinja2.Environment().from_string(TEMPLATES[template]).render(
        messages=messages, bos_token="<|begin_of_text|>")
    print(json.dumps(tok.encode(text, add_special_tokens=False).ids))


def gpt2(ranks_file, strings_file):
    import tiktoken
    from tiktoken.load import load_tiktoken_bpe
    pattern = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
    enc = tiktoken.Encoding("gpt2", pat_str=pattern, mergeable_ranks=load_tiktoken_bpe(ranks_file),
                            special_tokens={"<|endoftext|>": 50256})
    texts = json.load(open(strings_file))
    print(json.dumps([enc.encode(s, allowed_special="all") for s in texts]))


if __name__ == "__main__":
    if sys.argv[1] == "make":
        make(sys.argv[2], sys.argv[3])
    elif sys.argv[1] == "vocabmerges":
        vocabmerges(sys.argv[2])
    elif sys.argv[1] == "tiktoken":
        tiktoken_ranks(sys.argv[2], sys.argv[3])
    elif sys.argv[1] == "gpt2":
        gpt2(sys.argv[2], sys.argv[3])
    elif sys.argv[1] == "chat":
        chat(sys.argv[2], sys.argv[3], sys.argv[4])
    elif sys.argv[1] == "strings":
        print(json.dumps(strings(int(sys.argv[2]), int(sys.argv[3]))))
    else:
        encode(sys.argv[2], sys.argv[3])
