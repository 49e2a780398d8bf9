"""The dense oracle for test_trl.py, in a process of its own (the trainer's process builds no
vLLM engine): vLLM's own load of each version's `save_pretrained` export, as the checksums
vLLM's `/weight_checker` computes (SHA-256 of every parameter the engine holds).

One engine instead of one per version (each start costs 30-60 s on 2 cores): it starts fresh
from the last version, then loads every version through vLLM's dense reload
(`reload_weights(weights_path=...)`: the loader and `process_weights_after_loading` a start
runs), and the last one again, which must give the fresh start's checksums.

    python -m tests.integrations.trl.oracle OUT.json DIR...
"""

from __future__ import annotations

import json
import sys


def _checksums(llm) -> dict[str, str]:
    out: dict[str, str] = {}
    for part in llm.collective_rpc("compute_weight_checksums"):
        out.update(part)
    return out


def main(out: str, dirs: list[str]) -> None:
    import vllm

    llm = vllm.LLM(model=dirs[-1], skip_tokenizer_init=True, dtype="bfloat16", enforce_eager=True, max_model_len=256,
                   seed=0)
    fresh = _checksums(llm)
    sums = {}
    for d in dirs:
        llm.collective_rpc("reload_weights", kwargs={"weights_path": d})
        sums[d] = _checksums(llm)
    if sums[dirs[-1]] != fresh:
        raise SystemExit("oracle: vLLM's dense reload does not give a fresh load's checksums")
    with open(out, "w") as f:
        json.dump(sums, f)
    llm.llm_engine.engine_core.shutdown()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
