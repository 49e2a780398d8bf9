"""torchrun worker: the independent check of the maps' conversion. In fp32, megatron-core's
forward (TP/PP/EP, pipeline schedule) and the forward of the family's transformers model,
loaded by from_pretrained from the dense export, give the same logits on the same tokens.
Prints "max abs diff X" on one rank."""

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
    ap.add_argument("--family", default="llama")
    ap.add_argument("--ep", type=int, default=1)
    ap.add_argument("--experts", type=int, default=None)
    a = ap.parse_args()
    from refit_worker import hf_receiver, moe_config

    # the MoE settings of the refit tests (top-2, expert ffn 32; DeepSeek: MLA, shared expert,
    # a dense first layer, sigmoid scores with a bias and group-limited routing)
    a.topk, a.moe_ffn, a.etp = 2, 32, None
    ds = a.family == "deepseek_v3"
    a.shared, a.dense_first, a.mla = (32, 1, True) if ds else (None, 0, False)
    from nemo_dcr_callback.recipes import megatron_cpu

    megatron_cpu.enable()
    import datetime

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=300))
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func

    ps.initialize_model_parallel(a.tp, a.pp, expert_model_parallel_size=a.ep)
    from nemo_dcr_callback.placement import FAMILIES, dense_export
    from nemo_dcr_callback.recipes.megatron_model import TinyGPTConfig, build_model

    cfg = TinyGPTConfig(params_dtype="float32", num_query_groups=4 if ds else a.groups, tie_word_embeddings=a.tie,
                        init_method_std=0.2, **moe_config(a))
    model = build_model(cfg)
    if ds:  # a score-correction bias as training leaves it (it changes which experts are chosen)
        with torch.no_grad():
            for m in model.modules():
                if getattr(m, "expert_bias", None) is not None:
                    m.expert_bias.copy_(torch.linspace(-0.3, 0.3, m.expert_bias.numel()))
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
    export = dense_export(model, FAMILIES[a.family], cfg.vocab_size, dtype=torch.float32, dst=last_tp0)
    if dist.get_rank() == last_tp0:
        hf, names = hf_receiver(cfg, a.family, export, dtype=torch.float32)  # transformers' own loader
        assert set(export) == names, sorted(set(export) ^ names)
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
    from nemo_dcr_callback.recipes.megatron_cpu import exit_worker

    exit_worker(main())
