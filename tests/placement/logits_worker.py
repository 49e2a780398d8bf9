"""torchrun worker: the independent check of the maps' conversion. In fp32, megatron-core's
forward (TP/PP, pipeline schedule) and transformers' LlamaForCausalLM forward on the dense
export give the same logits on the same tokens. Prints "max abs diff X" on one rank."""

from __future__ import annotations

import argparse
import warnings

import torch
import torch.distributed as dist

warnings.filterwarnings("ignore")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--pp", type=int, default=1)
    ap.add_argument("--groups", type=int, default=2)
    ap.add_argument("--tie", action="store_true")
    ap.add_argument("--tol", type=float, default=1e-4)
    a = ap.parse_args()
    from nemo_dcr_callback.testing import megatron_cpu

    megatron_cpu.enable()
    import datetime

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=300))
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func

    ps.initialize_model_parallel(a.tp, a.pp)
    from nemo_dcr_callback.placement import LLAMA, dense_export
    from nemo_dcr_callback.testing.megatron_model import TinyGPTConfig, build_model, hf_config

    cfg = TinyGPTConfig(params_dtype="float32", num_query_groups=a.groups, tie_word_embeddings=a.tie,
                        init_method_std=0.2)
    model = build_model(cfg)
    model.eval()
    b, s = 2, 16
    tokens = torch.randint(0, cfg.vocab_size, (b, s), generator=torch.Generator().manual_seed(0))
    pos = torch.arange(s).unsqueeze(0).expand(b, -1)
    got = {}

    def fwd(it, m):
        out = m(next(it), pos, None)

        def loss(o):
            got["logits"] = o.detach()
            return o.sum() * 0, {}

        return out, loss

    with torch.no_grad():
        get_forward_backward_func()(forward_step_func=fwd, data_iterator=iter([tokens]), model=[model],
                                    num_microbatches=1, seq_length=s, micro_batch_size=b, forward_only=True)
    # The last stage's TP ranks hold vocab slices of the logits; gather them on its TP rank 0.
    last_tp0 = dist.get_world_size() - a.tp  # rank order is stage-major: the last stage's first rank
    logits = None
    if ps.is_pipeline_last_stage():
        part = got["logits"].contiguous()
        parts = [torch.empty_like(part) for _ in range(a.tp)]
        dist.all_gather(parts, part, group=ps.get_tensor_model_parallel_group())
        logits = torch.cat(parts, dim=-1)[..., :cfg.vocab_size]
    export = dense_export(model, LLAMA, cfg.vocab_size, dtype=torch.float32, dst=last_tp0)
    if dist.get_rank() == last_tp0:
        from transformers import LlamaForCausalLM

        hf = LlamaForCausalLM(hf_config(cfg)).to(torch.float32)
        missing, unexpected = hf.load_state_dict(export, strict=False)
        assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
        if a.tie:
            hf.tie_weights()
        with torch.no_grad():
            ref = hf(tokens).logits
        diff = float((ref - logits).abs().max())
        print(f"max abs diff {diff:.3e} (logits scale {float(ref.abs().max()):.3f})", flush=True)
        if not diff < a.tol:
            print("FAIL: logits differ")
            dist.barrier()
            return 1
    dist.barrier()
    return 0


if __name__ == "__main__":
    from nemo_dcr_callback.testing.megatron_cpu import exit_worker

    exit_worker(main())
