"""StaticDecoder compaction on a GPU: wall time with `compact` off and on, alternated twice per batch shape,
the same seeded draws (Llama-3.2-1B shape, random bf16 weights, 128-token random prompts, one token in a
hundred a stop token). Writes $OUT/compact.json (benchmarks/results/decode-compaction/llama3.2-1b_bf16_h200_2026-12-03.json: H200, 2026-12-03).

    OUT=/tmp/out python benchmarks/scripts/decode_compaction.py      # on a CUDA machine
"""

import json
import os
import sys
import time
import traceback
import warnings
from pathlib import Path

import torch

from fastft.bench.harness import fastft_model, save_random_checkpoint
from fastft.runtime.model_state import model_state
from fastft.training.objectives.decode import StaticDecoder

out = Path(os.environ.get("OUT", "/tmp/out"))

results = []
folder = Path("/tmp/ckpt-1b")
save_random_checkpoint("meta-llama/Llama-3.2-1B-Instruct", folder)
model = fastft_model(str(folder), "bf16", 1024, "auto", torch.device("cuda"))
model.eval()
vocab = model.get_input_embeddings().weight.shape[0]
stops = set(range(3, vocab, 100))


def run(prompts, group, width, new, compact, seed=4):
    state = model_state(model)
    state.decode_graphs = True
    g = torch.Generator(device="cuda").manual_seed(seed)
    rng = torch.Generator().manual_seed(1)
    ids = torch.randint(3, vocab, (prompts, width), generator=rng).cuda()
    mask = torch.ones_like(ids)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        dec = StaticDecoder(
            model, prompts * group, width, new, stops, pad=0, generator=g, group=group, compact=compact
        )
        torch.cuda.synchronize()
        t = time.perf_counter()
        o = dec.decode(ids, mask)
        torch.cuda.synchronize()
        dt = time.perf_counter() - t
    ended = torch.isin(o, torch.tensor(sorted(stops), device=o.device))
    drawn = ((ended.cumsum(1) - ended.long()) == 0).sum(1)
    return o, dict(
        prompts=prompts,
        group=group,
        new=new,
        compact=compact,
        seconds=round(dt, 3),
        tokens=int(drawn.sum()),
        longest=int(drawn.max()),
        median=float(drawn.float().median()),
        stats=dec.stats,
        graphs_after=state.decode_graphs,
        warnings=[str(w.message)[:3000] for w in caught],
    )


torch.backends.cuda.matmul.allow_tf32 = True
for prompts, group, new in ((8, 8, 384), (32, 8, 384), (16, 16, 1024)):
    outs = {}
    for rep in range(2):
        for compact in (False, True):
            try:
                o, r = run(prompts, group, 128, new, compact)
                outs[compact] = o
                r["rep"] = rep
            except Exception:
                r = dict(prompts=prompts, compact=compact, error=traceback.format_exc()[-3000:])
            print(json.dumps(r))
            sys.stdout.flush()
            results.append(r)
    if len(outs) == 2:
        same = (outs[True] == outs[False]).float().mean().item()
        results.append(dict(prompts=prompts, group=group, same_tokens=same))
        print("same", same)
(out / "compact.json").write_text(json.dumps(results, indent=1))
