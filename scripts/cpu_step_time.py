"""CPU step time by token budget, for BENCHMARKS.md: the slowest step of a 2048-token prompt (best of 2)
for a SmolLM2-135M-shaped model with random weights. usage: taskset -c 0,1 python scripts/cpu_step_time.py
TOKENIZER_FOLDER [BUDGETS, e.g. 2048,512,64]"""
import json
import shutil
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch

torch.set_num_threads(2)
from mmserve.entrypoints.llm import LLM
from mmserve.params import SamplingParams

folder = Path(tempfile.mkdtemp()) / "smollm2-shape"
folder.mkdir()
cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 576,
       "intermediate_size": 1536, "num_hidden_layers": 30, "num_attention_heads": 9,
       "num_key_value_heads": 3, "vocab_size": 49152, "max_position_embeddings": 8192,
       "rms_norm_eps": 1e-5, "rope_theta": 100000.0, "tie_word_embeddings": True,
       "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "float32"}
(folder / "config.json").write_text(json.dumps(cfg))
src = Path(sys.argv[1])
for name in ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json"):
    for p in src.rglob(name):
        shutil.copy(p, folder / name); break
llm = LLM(str(folder), device="cpu", load_format="dummy", num_kv_blocks=600,
          enable_prefix_caching=False, max_num_batched_tokens=2048)
fe = llm.frontend
for budget in [int(b) for b in (sys.argv[2] if len(sys.argv) > 2 else "2048,1024,512,256").split(",")]:
    fe.core.scheduler.config = replace(fe.core.scheduler.config, max_num_batched_tokens=budget)
    slowest = []
    for rep in range(2):
        ids = [(i * 7919 + rep) % 30000 + 100 for i in range(2048)]
        fe.add_request(f"r{budget}-{rep}", ids, SamplingParams(max_tokens=4, ignore_eos=True))
        steps = []
        while fe.has_unfinished:
            t = time.perf_counter(); fe.step(); steps.append(time.perf_counter() - t)
        slowest.append(max(steps))
    print(json.dumps({"budget": budget, "slowest_step_ms": round(min(slowest) * 1e3)}), flush=True)
