"""Reference side of the chat-template tests: conversations rendered by transformers'
apply_chat_template with the families' published chat templates (their no-tools paths: the
tool-calling branches are left out of the Jinja below), tokenized by transformers.

  chat_reference.py render FAMILY DIR CASES_JSON
      FAMILY qwen3, glm4: DIR/tokenizer.json (bpe_reference.py make DIR qwen3 | glm4) as a
             fast tokenizer;
             gemma: DIR/tokenizer.model (sentencepiece_reference.py make DIR gemma) converted
             by transformers into its GemmaTokenizer, whose files it saves into DIR.
      CASES_JSON: a list of {"messages": [...], "generation_prompt": bool,
      "enable_thinking": bool (optional)}. Prints, per case, {"ids": [...], "mask": [...]}:
      the ids of the rendering and, independently of shardlm's template code, the assistant
      spans found in those ids: the tokens after an assistant (Gemma: model) header through
      the turn's end marker are 1, all others 0.
  chat_reference.py config FAMILY DIR   writes DIR/tokenizer_config.json with the published
      template as its chat_template (the signal a model directory carries).
"""
import json
import os
import sys

# Qwen3's template (Qwen3-0.6B ... Qwen3-32B), its no-tools paths: the first system message,
# reasoning_content (or a <think> block inside content) kept only on assistant turns after the
# last user query, the empty think block on the last turn, and enable_thinking=false's empty
# block after the generation prompt.
QWEN3 = (
    "{%- if messages[0].role == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}"
    "{%- for message in messages[::-1] %}"
    "{%- set index = (messages|length - 1) - loop.index0 %}"
    "{%- if ns.multi_step_tool and message.role == 'user' and message.content is string and "
    "not(message.content.startswith('<tool_response>') and "
    "message.content.endswith('</tool_response>')) %}"
    "{%- set ns.multi_step_tool = false %}"
    "{%- set ns.last_query_index = index %}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- for message in messages %}"
    "{%- if message.content is string %}{%- set content = message.content %}"
    "{%- else %}{%- set content = '' %}{%- endif %}"
    "{%- if (message.role == 'user') or (message.role == 'system' and not loop.first) %}"
    "{{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>' + '\\n' }}"
    "{%- elif message.role == 'assistant' %}"
    "{%- set reasoning_content = '' %}"
    "{%- if message.reasoning_content is string %}"
    "{%- set reasoning_content = message.reasoning_content %}"
    "{%- else %}"
    "{%- if '</think>' in content %}"
    "{%- set reasoning_content = "
    "content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') %}"
    "{%- set content = content.split('</think>')[-1].lstrip('\\n') %}"
    "{%- endif %}"
    "{%- endif %}"
    "{%- if loop.index0 > ns.last_query_index %}"
    "{%- if loop.last or (not loop.last and reasoning_content) %}"
    "{{- '<|im_start|>' + message.role + '\\n<think>\\n' + reasoning_content.strip('\\n') + "
    "'\\n</think>\\n\\n' + content.lstrip('\\n') }}"
    "{%- else %}"
    "{{- '<|im_start|>' + message.role + '\\n' + content }}"
    "{%- endif %}"
    "{%- else %}"
    "{{- '<|im_start|>' + message.role + '\\n' + content }}"
    "{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}"
    "{{- '<think>\\n\\n</think>\\n\\n' }}"
    "{%- endif %}"
    "{%- endif %}")

# Gemma 3's template (text content only; Gemma 2's is the same without the system message):
# <bos>, the system message folded into the first user turn, "assistant" as "model", content
# trimmed, roles alternating.
GEMMA = (
    "{{ bos_token }}"
    "{%- if messages[0]['role'] == 'system' -%}"
    "{%- set first_user_prefix = messages[0]['content'] + '\\n\\n' -%}"
    "{%- set loop_messages = messages[1:] -%}"
    "{%- else -%}"
    "{%- set first_user_prefix = \"\" -%}"
    "{%- set loop_messages = messages -%}"
    "{%- endif -%}"
    "{%- for message in loop_messages -%}"
    "{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{%- endif -%}"
    "{%- if (message['role'] == 'assistant') -%}{%- set role = \"model\" -%}"
    "{%- else -%}{%- set role = message['role'] -%}{%- endif -%}"
    "{{ '<start_of_turn>' + role + '\\n' + (first_user_prefix if loop.first else \"\") }}"
    "{{ message['content'] | trim }}"
    "{{ '<end_of_turn>\\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{'<start_of_turn>model\\n'}}{%- endif -%}")

# GLM-4's template (THUDM/glm-4-9b-chat-hf's tokenizer_config.json), its no-tools path:
# [gMASK]<sop>, then each message with content as <|role|>, its metadata (none here) and
# "\n" content; no end marker; the generation prompt is <|assistant|> alone.
GLM4 = (
    "[gMASK]<sop>"
    "{% for item in messages %}"
    "{% if item['content'] %}"
    "<|{{ item['role'] }}|>{{ item['metadata'] }}\n{{ item['content'] }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}")

GLM4_ROLES = ("<|system|>", "<|user|>", "<|assistant|>", "<|observation|>")

FAMILIES = {  # template, turn start, turn end, the assistant's role in the header
    "qwen3": (QWEN3, "<|im_start|>", "<|im_end|>", "assistant"),
    "gemma": (GEMMA, "<start_of_turn>", "<end_of_turn>", "model"),
    "glm4": (GLM4, "<|assistant|>", None, None),
}


def tokenizer(family, path):
    if family in ("qwen3", "glm4"):
        from transformers import PreTrainedTokenizerFast
        eos = "<|im_end|>" if family == "qwen3" else "<|endoftext|>"
        return PreTrainedTokenizerFast(tokenizer_file=os.path.join(path, "tokenizer.json"),
                                       eos_token=eos, pad_token="<|endoftext|>")
    from transformers import GemmaTokenizer
    from transformers.convert_slow_tokenizer import SentencePieceExtractor
    converted = SentencePieceExtractor(os.path.join(path, "tokenizer.model")).extract(None)
    tok = GemmaTokenizer(vocab=converted["vocab"], merges=converted["merges"])
    tok.add_special_tokens({"additional_special_tokens": ["<start_of_turn>", "<end_of_turn>"]})
    tok.save_pretrained(path)  # tokenizer.json beside tokenizer.model, as Gemma ships them
    return tok


def assistant_mask(tok, ids, start, end, role):
    """1 on the tokens after an assistant header (the turn start marker, then tokens up to and
    including the one that ends the header's line) through the turn's end marker."""
    start_id, end_id = tok.convert_tokens_to_ids(start), tok.convert_tokens_to_ids(end)
    mask, i = [0] * len(ids), 0
    while i < len(ids):
        if ids[i] != start_id:
            i += 1
            continue
        j = i + 1
        while j < len(ids) and "\n" not in tok.decode(ids[i + 1:j + 1]):
            j += 1
        header = tok.decode(ids[i + 1:j + 1])
        i = j + 1
        if header != role + "\n":
            continue
        while i < len(ids):
            mask[i] = 1
            i += 1
            if ids[i - 1] == end_id:
                break
    return mask


def glm4_mask(tok, ids):
    """1 on the tokens after each <|assistant|> through the next role token."""
    assistant = tok.convert_tokens_to_ids("<|assistant|>")
    roles = {tok.convert_tokens_to_ids(r) for r in GLM4_ROLES}
    mask, inside = [0] * len(ids), False
    for i, t in enumerate(ids):
        if inside:
            mask[i] = 1
            inside = t not in roles
        if t == assistant:
            inside = True
    return mask


def render(family, path, cases_file):
    template, start, end, role = FAMILIES[family]
    tok = tokenizer(family, path)
    out = []
    for case in json.load(open(cases_file, encoding="utf-8")):
        extra = {}
        if "enable_thinking" in case:
            extra["enable_thinking"] = case["enable_thinking"]
        ids = tok.apply_chat_template(case["messages"], chat_template=template, tokenize=True,
                                      return_dict=False,
                                      add_generation_prompt=case["generation_prompt"], **extra)
        mask = glm4_mask(tok, ids) if family == "glm4" else assistant_mask(tok, ids, start, end,
                                                                            role)
        out.append({"ids": ids, "mask": mask})
    print(json.dumps(out))


def config(family, path):
    with open(os.path.join(path, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump({"chat_template": FAMILIES[family][0]}, f)


if __name__ == "__main__":
    if sys.argv[1] == "render":
        render(sys.argv[2], sys.argv[3], sys.argv[4])
    elif sys.argv[1] == "config":
        config(sys.argv[2], sys.argv[3])
    else:
        raise SystemExit(__doc__)
