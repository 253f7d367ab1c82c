"""Reference outputs of group beam search (diverse beam search) from transformers 4.52.4.

transformers 5 removed group beam search from its core, and 4.57 only forwards it to a
hub repository (unreachable offline), so the reference is 4.52.4, the last release with
``_group_beam_search`` in the library. Run once, in an environment with that version:

    python -m venv /tmp/hf452 && /tmp/hf452/bin/pip install torch==2.13.0 transformers==4.52.4
    /tmp/hf452/bin/python tests/reference/make_group_beam_reference.py

It writes the tiny random checkpoint (``tiny_llama/``) and ``group_beam.json`` beside this
script; ``tests/test_beam_search.py`` runs kvgen on the same checkpoint and settings.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import transformers
from transformers import LlamaConfig, LlamaForCausalLM

HERE = Path(__file__).parent
CASES = [
    {"num_beams": 4, "num_beam_groups": 2, "diversity_penalty": 1.0},
    {"num_beams": 6, "num_beam_groups": 3, "diversity_penalty": 0.5, "num_return_sequences": 4},
    {"num_beams": 4, "num_beam_groups": 4, "diversity_penalty": 2.0, "early_stopping": True, "length_penalty": 0.7},
    {"num_beams": 4, "num_beam_groups": 2, "diversity_penalty": 1.0, "early_stopping": "never",
     "length_penalty": -0.5},
    {"num_beams": 8, "num_beam_groups": 8, "diversity_penalty": 1.0, "num_return_sequences": 8,
     "early_stopping": True},  # the seeds' shape: one beam per group
    {"num_beams": 4, "num_beam_groups": 2, "diversity_penalty": 1.0, "repetition_penalty": 1.3},
]


def main() -> None:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                         bos_token_id=1, eos_token_id=46, pad_token_id=2)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():  # a peaked output layer, with EOS (id 46) one of the likelier tokens
        model.lm_head.weight.mul_(8.0)
    model.save_pretrained(HERE / "tiny_llama")
    prompts = torch.tensor([[2, 2, 17, 40, 9, 33], [11, 5, 60, 21, 8, 45]])  # the first row left-padded
    mask = (prompts != 2).long()
    results = []
    for case in CASES:
        out = model.generate(prompts, attention_mask=mask, max_new_tokens=10, do_sample=False,
                             return_dict_in_generate=True, output_scores=True, **case)
        results.append({"settings": case, "sequences": out.sequences.tolist(),
                        "sequences_scores": out.sequences_scores.tolist()})
    payload = {"transformers": transformers.__version__, "torch": torch.__version__,
               "prompts": prompts.tolist(), "attention_mask": mask.tolist(), "max_new_tokens": 10,
               "cases": results}
    (HERE / "group_beam.json").write_text(json.dumps(payload, indent=1) + "\n")


if __name__ == "__main__":
    main()
