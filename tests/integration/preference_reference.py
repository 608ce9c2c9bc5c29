"""Reference side of test_preference_trl: TRL's own trainers on pre-tokenized preference pairs.

  preference_reference.py setup BASE_DIR ADAPTER_DIR MERGED_DIR CORPUS
      the test's files in one process: hf_reference.py's tiny Llama and its tokenizer (trained
      on CORPUS) in BASE_DIR, then `adapter` into ADAPTER_DIR and `merge` into MERGED_DIR
  preference_reference.py adapter BASE_DIR OUT_DIR
      saves a PEFT LoRA adapter of BASE_DIR (rank 4 on every projection, random A and B, no
      dropout) into OUT_DIR
  preference_reference.py dpo BASE_DIR ADAPTER_DIR PAIRS_JSON CONFIG_JSON
      one DPOTrainer loss on every pair at once (PeftModel(base, adapter); the reference the
      base with the adapter off, as TRL has it for a new adapter), its backward, and prints {"loss", "metrics", "grads"} as JSON:
      TRL's logged metrics and the adapter's gradients by their PEFT names. CONFIG_JSON holds
      DPOConfig's beta, loss_type (a list), loss_weights and label_smoothing.
  preference_reference.py dpo_eval BASE_DIR ADAPTER_DIR PAIRS_JSON CONFIG_JSON
      DPOTrainer.evaluate() with the pairs as its eval set, in one batch: prints {"loss",
      "metrics"}, the eval_loss and TRL's eval_ metrics without their prefix. CONFIG_JSON holds
      beta and loss_type.
  preference_reference.py merge BASE_DIR ADAPTER_DIR OUT_DIR
      saves BASE_DIR with the adapter merged into its weights (the full fine-tuning policy)
  preference_reference.py dpo_full BASE_DIR POLICY_DIR PAIRS_JSON CONFIG_JSON
      full fine-tuning: DPOTrainer on the POLICY_DIR model with the BASE_DIR model as ref_model
      and precompute_ref_log_probs=True (the reference sums computed into the data set before
      training), one loss and backward as for dpo; the grads are every parameter's, by the
      transformers names. CONFIG_JSON holds beta and loss_type.
  preference_reference.py dpo_text BASE_DIR ADAPTER_DIR RECORDS_JSON CONFIG_JSON
      as dpo, on TRL preference records of text ({"prompt", "chosen", "rejected"}, or without
      "prompt": TRL extracts it) through DPOTrainer's own preparation (the prompt's extraction,
      eos, tokenization with BASE_DIR's tokenizer.json); also prints "tokenized": each record's
      prompt_ids, chosen_ids and rejected_ids as DPOTrainer made them.
  preference_reference.py simpo BASE_DIR ADAPTER_DIR PAIRS_JSON CONFIG_JSON
      the same through trl.experimental.cpo's CPOTrainer (loss_type "simpo", cpo_alpha 0), its
      tokenization included (the ids written as the stand-in tokenizer's words): CONFIG_JSON
      holds beta and simpo_gamma.
PAIRS_JSON: [{"prompt_ids", "chosen_ids", "rejected_ids"}, ...]. The trainers' own tokenization
is bypassed for DPO (the pairs are already token ids), everything after it (collation, the
loss, the metrics) is theirs.
"""
import json
import os
import sys
import tempfile

import torch
from datasets import Dataset
from peft import LoraConfig, PeftModel, get_peft_model
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def tokenizer(vocab_size):
    # A word-level stand-in: the pairs are ids already; the trainers only read its special ids.
    # Words "<i>": no word contains another (the special tokens match inside words first).
    vocab = {f"<{i}>": i for i in range(vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<0>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<1>", pad_token="<0>")


def load(base, adapter):
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    model.config.pad_token_id = 0
    return PeftModel.from_pretrained(model, adapter, is_trainable=True)


def save_adapter(base, out):
    torch.manual_seed(11)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    cfg = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=TARGETS,
                     init_lora_weights=False)
    peft = get_peft_model(model, cfg)
    with torch.no_grad():  # B large enough that the policy is not the reference
        for name, p in peft.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.3)
    peft.save_pretrained(out)


def grads(model):
    out = {}
    for name, p in model.named_parameters():
        if p.requires_grad and p.grad is not None:
            out[name.replace(".default", "")] = p.grad.flatten().tolist()
    return out


def one_batch(trainer, pairs):
    batch = trainer.data_collator([dict(p) for p in pairs])
    trainer.model.train()
    loss = trainer.compute_loss(trainer.model, batch)
    loss.backward()
    return loss


def dpo(base, adapter, pairs, cfg):
    from trl import DPOConfig, DPOTrainer

    class Pretokenized(DPOTrainer):
        def _prepare_dataset(self, dataset, *args, **kwargs):
            return dataset

    model = load(base, adapter)
    with tempfile.TemporaryDirectory() as out:
        args = DPOConfig(output_dir=out, per_device_train_batch_size=len(pairs), max_length=None,
                         report_to=[], use_cpu=True, beta=cfg["beta"], loss_type=cfg["loss_type"],
                         loss_weights=cfg.get("loss_weights"),
                         label_smoothing=cfg.get("label_smoothing", 0.0))
        trainer = Pretokenized(model=model, args=args, train_dataset=Dataset.from_list(pairs),
                               processing_class=tokenizer(model.config.vocab_size))
        # A loaded adapter gets a "ref" copy as its reference; without it TRL's reference is the
        # base with the adapters off (its path for a new adapter), shardlm's reference.
        if "ref" in model.peft_config:
            model.delete_adapter("ref")
        loss = one_batch(trainer, pairs)
        metrics = {k: v[-1] for k, v in trainer._metrics["train"].items() if v}
    return {"loss": loss.item(), "metrics": metrics, "grads": grads(model)}


def dpo_eval(base, adapter, pairs, cfg):
    # DPOTrainer.evaluate() on the pairs as the eval set, in one batch (TRL averages its metrics
    # over the batches): eval mode, the adapter on for the policy and off for the reference.
    from trl import DPOConfig, DPOTrainer

    class Pretokenized(DPOTrainer):
        def _prepare_dataset(self, dataset, *args, **kwargs):
            return dataset

    model = load(base, adapter)
    data = Dataset.from_list(pairs)
    with tempfile.TemporaryDirectory() as out:
        args = DPOConfig(output_dir=out, per_device_eval_batch_size=len(pairs), max_length=None,
                         report_to=[], use_cpu=True, beta=cfg["beta"], loss_type=cfg["loss_type"])
        trainer = Pretokenized(model=model, args=args, train_dataset=data, eval_dataset=data,
                               processing_class=tokenizer(model.config.vocab_size))
        if "ref" in model.peft_config:
            model.delete_adapter("ref")
        logged = trainer.evaluate()
    # TRL's log() adds its eval_ metrics to the dict evaluate() returns.
    metrics = {k[len("eval_"):]: v for k, v in logged.items() if k.startswith("eval_")}
    return {"loss": logged["eval_loss"], "metrics": metrics}


def merge(base, adapter, out):
    # The policy of the full fine-tuning case: the base with the adapter merged into its weights.
    load(base, adapter).merge_and_unload().save_pretrained(out)


def dpo_full(base, policy, pairs, cfg):
    from trl import DPOConfig, DPOTrainer

    class Pretokenized(DPOTrainer):
        def _prepare_dataset(self, dataset, *args, **kwargs):
            return dataset

    model = AutoModelForCausalLM.from_pretrained(policy, dtype=torch.float32)
    ref = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    for m in (model, ref):
        m.config.pad_token_id = 0
    # The embedding's padding_idx (config.json's pad_token_id) keeps that row's gradient at 0; the
    # pairs hold token 0 as a real token, whose row full fine-tuning trains.
    model.get_input_embeddings().padding_idx = None
    with tempfile.TemporaryDirectory() as out:
        # Full fine-tuning with the reference's log-probabilities computed before training into
        # the data set's ref_chosen_logps / ref_rejected_logps columns, which the loss then reads.
        args = DPOConfig(output_dir=out, per_device_train_batch_size=len(pairs), max_length=None,
                         report_to=[], use_cpu=True, beta=cfg["beta"], loss_type=cfg["loss_type"],
                         precompute_ref_log_probs=True)
        trainer = Pretokenized(model=model, ref_model=ref, args=args,
                               train_dataset=Dataset.from_list(pairs),
                               processing_class=tokenizer(model.config.vocab_size))
        rows = [dict(trainer.train_dataset[i]) for i in range(len(pairs))]
        assert all("ref_chosen_logps" in r for r in rows), "no precomputed reference"
        loss = one_batch(trainer, rows)
        metrics = {k: v[-1] for k, v in trainer._metrics["train"].items() if v}
    return {"loss": loss.item(), "metrics": metrics, "grads": grads(model)}


def dpo_text(base, adapter, records, cfg):
    from trl import DPOConfig, DPOTrainer

    # The base directory's own BPE tokenizer (hf_reference.py tokenizer), which shardlm reads too.
    tok = PreTrainedTokenizerFast(tokenizer_file=f"{base}/tokenizer.json",
                                  eos_token="<|endoftext|>", pad_token="<|endoftext|>")
    model = load(base, adapter)
    with tempfile.TemporaryDirectory() as out:
        args = DPOConfig(output_dir=out, per_device_train_batch_size=len(records), max_length=None,
                         report_to=[], use_cpu=True, beta=cfg["beta"], loss_type=cfg["loss_type"])
        trainer = DPOTrainer(model=model, args=args, train_dataset=Dataset.from_list(records),
                             processing_class=tok)
        if "ref" in model.peft_config:
            model.delete_adapter("ref")
        rows = [dict(trainer.train_dataset[i]) for i in range(len(records))]
        tokenized = [{k: r[k] for k in ("prompt_ids", "chosen_ids", "rejected_ids")} for r in rows]
        loss = one_batch(trainer, rows)
        metrics = {k: v[-1] for k, v in trainer._metrics["train"].items() if v}
    return {"loss": loss.item(), "metrics": metrics, "grads": grads(model),
            "tokenized": tokenized}


def simpo(base, adapter, pairs, cfg):
    from trl.experimental.cpo import CPOConfig, CPOTrainer

    model = load(base, adapter)
    # CPOTrainer tokenizes text itself: the ids as words of the stand-in tokenizer, which it
    # tokenizes back into the same ids (no bos: the tokenizer has none; eos ends each answer).
    def words(ids):
        return " ".join(f"<{i}>" for i in ids)

    rows = [{"prompt": words(p["prompt_ids"]), "chosen": " " + words(p["chosen_ids"]),
             "rejected": " " + words(p["rejected_ids"])} for p in pairs]
    with tempfile.TemporaryDirectory() as out:
        args = CPOConfig(output_dir=out, per_device_train_batch_size=len(pairs), report_to=[],
                         use_cpu=True, loss_type="simpo", cpo_alpha=0.0, beta=cfg["beta"],
                         simpo_gamma=cfg["simpo_gamma"])
        trainer = CPOTrainer(model=model, args=args, train_dataset=Dataset.from_list(rows),
                             processing_class=tokenizer(model.config.vocab_size))
        batch = trainer.data_collator([trainer.train_dataset[i] for i in range(len(rows))])
        trainer.model.train()
        loss, metrics = trainer.get_batch_loss_metrics(trainer.model, batch)
        loss.backward()
    return {"loss": loss.item(), "metrics": metrics, "grads": grads(model)}


if __name__ == "__main__":
    if sys.argv[1] == "setup":
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        import hf_reference
        hf_reference.make(sys.argv[2], "llama")
        save_adapter(sys.argv[2], sys.argv[3])
        hf_reference.tokenizer(sys.argv[2], sys.argv[5])
        merge(sys.argv[2], sys.argv[3], sys.argv[4])
    elif sys.argv[1] == "adapter":
        save_adapter(sys.argv[2], sys.argv[3])
    elif sys.argv[1] == "merge":
        merge(sys.argv[2], sys.argv[3], sys.argv[4])
    else:
        run = {"dpo": dpo, "dpo_eval": dpo_eval, "dpo_full": dpo_full, "dpo_text": dpo_text,
               "simpo": simpo}[sys.argv[1]]
        with open(sys.argv[4]) as f:
            pairs = json.load(f)
        print(json.dumps(run(sys.argv[2], sys.argv[3], pairs, json.loads(sys.argv[5]))))
