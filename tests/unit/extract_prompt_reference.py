"""Reference side of PreferenceRecords.ImplicitPromptMatchesTrlExtractPrompt: TRL's own
extract_prompt (trl/data_utils.py) on each case.

  extract_prompt_reference.py CASES_JSON
      CASES_JSON: [{"chosen", "rejected"}, ...] (both text or both message lists); prints
      [{"prompt", "chosen", "rejected"}, ...] as JSON, one per case, in order.
"""
import json
import sys

from trl.data_utils import extract_prompt

if __name__ == "__main__":
    with open(sys.argv[1], encoding="utf-8") as f:
        cases = json.load(f)
    print(json.dumps([extract_prompt(c) for c in cases], ensure_ascii=False))
