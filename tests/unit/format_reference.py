"""Reference side of test_formats: instruction records tokenized the way the tools that define
their formats do, with a Qwen3-style tokenizer (bpe_reference.py make DIR qwen3) and Qwen3's
published chat template (chat_reference.py's QWEN3).

  format_reference.py render DIR CASES_JSON OUT_JSON
      CASES_JSON: a list of {"format": ..., "record": {...}}. Writes OUT_JSON (stdout carries
      the libraries' chatter), per case, {"ids", "mask"}:
        messages, alpaca, sharegpt: the record converted into chat messages as LLaMA-Factory's
          converters do (written out below), rendered by transformers' apply_chat_template; the
          mask is chat_reference.assistant_mask over those ids (the assistant turns).
        prompt_completion: TRL's SFTTrainer prepares a dataset of the record (its own code:
          eos appended to a text completion, the prompt's ids and the prompt + completion ids,
          the completion mask from where they part, folded into its labels); ids are its
          input_ids, the mask 1 where its labels are not -100.
"""
import json
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import chat_reference  # noqa: E402

EOS = "<|endoftext|>"  # shardlm's eos for this tokenizer (no tokenizer_config.json beside it)


def tokenizer(path):
    from transformers import PreTrainedTokenizerFast
    tok = PreTrainedTokenizerFast(tokenizer_file=os.path.join(path, "tokenizer.json"),
                                  eos_token=EOS, pad_token=EOS)
    tok.chat_template = chat_reference.QWEN3
    return tok


def alpaca(record):
    """LLaMA-Factory's AlpacaDatasetConverter with the default columns."""
    messages = []
    if record.get("system"):
        messages.append({"role": "system", "content": record["system"]})
    for old_prompt, old_response in record.get("history") or []:
        messages.append({"role": "user", "content": old_prompt})
        messages.append({"role": "assistant", "content": old_response})
    query = [record[k] for k in ("instruction", "input") if record.get(k)]
    messages.append({"role": "user", "content": "\n".join(query)})
    messages.append({"role": "assistant", "content": record["output"]})
    return messages


def sharegpt(record):
    """LLaMA-Factory's SharegptDatasetConverter with the default tags (human, gpt, system)."""
    turns = record.get("conversations", record.get("messages"))
    roles = {"human": "user", "gpt": "assistant"}
    system = record.get("system", "")
    if turns[0]["from"] == "system":
        system, turns = turns[0]["value"], turns[1:]
    assert len(turns) % 2 == 0, "LLaMA-Factory drops an odd number of turns"
    messages = [{"role": "system", "content": system}] if system else []
    for i, turn in enumerate(turns):
        assert turn["from"] == ("human", "gpt")[i % 2], "LLaMA-Factory drops turns out of order"
        messages.append({"role": roles[turn["from"]], "content": turn["value"]})
    return messages


def chat(tok, messages):
    ids = tok.apply_chat_template(messages, tokenize=True, return_dict=False)
    return {"ids": ids, "mask": chat_reference.assistant_mask(tok, ids, "<|im_start|>",
                                                              "<|im_end|>", "assistant")}


def trl_prompt_completion(tok, records):
    """input_ids and completion_mask of each record as TRL's SFTTrainer prepares them."""
    from datasets import Dataset
    from transformers import LlamaConfig, LlamaForCausalLM
    from trl import SFTConfig, SFTTrainer
    model = LlamaForCausalLM(LlamaConfig(vocab_size=len(tok), hidden_size=16,
                                         intermediate_size=32, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=2))
    with tempfile.TemporaryDirectory() as out:
        args = SFTConfig(output_dir=out, report_to=[], max_length=None, use_cpu=True)
        trainer = SFTTrainer(model=model, args=args, processing_class=tok,
                             train_dataset=Dataset.from_list(records))
        data = trainer.train_dataset
        # TRL folds its completion_mask into labels: -100 where the mask is 0.
        return [{"ids": data[i]["input_ids"], "mask": [int(x != -100) for x in data[i]["labels"]]}
                for i in range(len(records))]


def render(path, cases_file, out_file):
    tok = tokenizer(path)
    cases = json.load(open(cases_file, encoding="utf-8"))
    out = [None] * len(cases)
    converters = {"messages": lambda r: r["messages"], "alpaca": alpaca, "sharegpt": sharegpt}
    by_kind = {"text": [], "chat": []}  # TRL decides by the first record: one dataset each
    for i, case in enumerate(cases):
        if case["format"] in converters:
            out[i] = chat(tok, converters[case["format"]](case["record"]))
        else:
            kind = "chat" if isinstance(case["record"]["prompt"], list) else "text"
            by_kind[kind].append(i)
    for indices in by_kind.values():
        if indices:
            for i, result in zip(indices, trl_prompt_completion(
                    tok, [cases[i]["record"] for i in indices])):
                out[i] = result
    with open(out_file, "w", encoding="utf-8") as f:
        json.dump(out, f)


if __name__ == "__main__":
    if sys.argv[1] == "render":
        render(sys.argv[2], sys.argv[3], sys.argv[4])
    else:
        raise SystemExit(__doc__)
