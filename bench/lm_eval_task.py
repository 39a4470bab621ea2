"""Write a small multiple-choice task for lm-eval into a folder (no download): tiny_mc.yaml + mc.jsonl.

    python bench/lm_eval_task.py /tmp/tiny_mc
    lm_eval --model local-completions --tasks tiny_mc --include_path /tmp/tiny_mc --batch_size 4 \\
        --model_args model=demo,base_url=http://127.0.0.1:8000/v1/completions,tokenizer=DIR,tokenized_requests=True

(DIR: the served checkpoint, for lm-eval's tokenizer.) Prints the folder.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

DOCS = [
    ("The sky on a clear day is", ["blue", "green", "red"], 0),
    ("Two plus two is", ["four", "five", "three"], 0),
    ("Fire is", ["cold", "hot"], 1),
    ("Ice is made of", ["water", "sand", "iron"], 0),
    ("The opposite of up is", ["left", "down", "over"], 1),
    ("A week has seven", ["days", "hours", "years"], 0),
    ("Cats say", ["woof", "meow", "moo"], 1),
    ("The sun rises in the", ["west", "north", "east"], 2),
    ("Paris is the capital of", ["France", "Spain", "Italy"], 0),
    ("Snow is", ["black", "white", "green"], 1),
]

TASK = """task: tiny_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
  - metric: acc_norm
    aggregation: mean
    higher_is_better: true
"""


def main() -> None:
    out = Path(sys.argv[1] if len(sys.argv) > 1 else "tiny_mc")
    out.mkdir(parents=True, exist_ok=True)
    data = out / "mc.jsonl"
    data.write_text(
        "".join(json.dumps({"question": q, "choices": c, "answer": a}) + "\n" for q, c, a in DOCS)
    )
    (out / "tiny_mc.yaml").write_text(TASK.format(data=data.resolve()))
    print(out.resolve())


if __name__ == "__main__":
    main()
