"""One MoE layer's expert-parallel exchange, timed alone: dispatch → (identity experts) → combine, forward and
backward, for each EP backend. `torchrun --nproc_per_node=2 scripts/bench_exchange.py [--tokens 16384 --dim 2048
--experts 64 --topk 6] [--backends all_to_all,deepep] [--sms 24]`

The defaults are one cut-16B MoE layer at local batch 4 × 4096; DeepEP's own intranode test uses
`--tokens 4096 --dim 7168 --experts 256 --topk 8`. Routing is a random top-k of a softmax (about uniform load).
Times are medians over CUDA events, in ms, on rank 0: the dispatcher's whole call (its permutation, host sync and
weighting included), not only the exchange kernels. As in training, dispatch and combine are compiled (only the
exchange itself runs eagerly); `--eager` times them uncompiled. With identity experts, combine must return
Σ_k g_k · x_t: the script checks that for every backend.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from dsv3 import dispatch, parallel  # noqa: E402
from dsv3.config import run_main  # noqa: E402


def time_layer(dispatcher, x0: torch.Tensor, topk_idx: torch.Tensor, weights0: torch.Tensor,
               tokens_per_expert: torch.Tensor, backward: bool, iters: int) -> tuple[list[float], torch.Tensor]:
    """Median ms of [dispatch, combine (+ wait), backward if asked] over `iters` calls after 5 warm-up calls,
    and the last call's output."""
    times = []
    for i in range(5 + iters):
        x, weights = x0.detach().requires_grad_(backward), weights0.detach().requires_grad_(backward)
        events = [torch.cuda.Event(enable_timing=True) for _ in range(4)]
        events[0].record()
        started = dispatcher.start(topk_idx, tokens_per_expert)
        copies, tokens_per_local_expert, ctx = dispatcher.dispatch(x, topk_idx, weights, started)
        expert_x = copies.gather()
        events[1].record()
        expert_y = expert_x * 1.0  # identity experts, whose output is a new tensor
        if copies.weights is not None:  # the experts sum each token's rows
            expert_y = copies.sum(expert_y)
        y = dispatcher.wait(dispatcher.combine(expert_y, ctx))
        events[2].record()
        if backward:
            y.float().sum().backward()
        events[3].record()
        torch.cuda.synchronize()
        if i >= 5:
            times.append([events[j].elapsed_time(events[j + 1]) for j in range(3 if backward else 2)])
    return torch.tensor(times).median(dim=0).values.tolist(), y.detach()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=16384, help="tokens per rank")
    parser.add_argument("--dim", type=int, default=2048)
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--topk", type=int, default=6)
    parser.add_argument("--backends", default="all_to_all,deepep")
    parser.add_argument("--sms", type=int, default=24, help="SMs DeepEP's kernels use (parallel.deepep_sms)")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--eager", action="store_true", help="do not torch.compile dispatch and combine")
    args = parser.parse_args()
    rank, world, device = parallel.init_distributed("cuda")
    backends = args.backends.split(",")
    for backend in backends:
        parallel.check_ep_backend(backend, world, device, args.sms)
    group = dist.new_group(list(range(world)))

    g = torch.Generator(device=device).manual_seed(rank)
    x = torch.randn(args.tokens, args.dim, device=device, dtype=torch.bfloat16, generator=g)
    scores = torch.randn(args.tokens, args.experts, device=device, generator=g).softmax(dim=-1)
    topk_weights, topk_idx = scores.topk(args.topk, dim=-1)
    tokens_per_expert = torch.bincount(topk_idx.flatten(), minlength=args.experts)
    expected = (x.float() * topk_weights.sum(dim=-1, keepdim=True)).bfloat16()

    results = {}
    for backend in backends:
        if backend == "deepep":
            dispatcher = dispatch.DeepEPDispatcher(dispatch.get_buffer(group, args.dim, args.sms), args.experts)
        else:
            dispatcher = dispatch.AllToAllDispatcher(group, args.experts)
        if not args.eager:
            dispatcher.dispatch, dispatcher.combine = map(torch.compile, (dispatcher.dispatch, dispatcher.combine))
        (dispatch_ms, combine_ms), y = time_layer(dispatcher, x, topk_idx, topk_weights, tokens_per_expert,
                                                  False, args.iters)
        (_, _, backward_ms), _ = time_layer(dispatcher, x, topk_idx, topk_weights, tokens_per_expert, True,
                                            args.iters)
        error = (y.float() - expected.float()).abs().max().item()
        results[backend] = {"dispatch_ms": round(dispatch_ms, 3), "combine_ms": round(combine_ms, 3),
                            "backward_ms": round(backward_ms, 3),
                            "total_ms": round(dispatch_ms + combine_ms + backward_ms, 3),
                            "max_abs_error": error}
        if error > 0.05 * expected.float().abs().max().item():
            raise RuntimeError(f"{backend}: combine(dispatch(x)) is off by {error} from Σ_k g_k · x")
    if rank == 0:
        print(json.dumps({"ep": world, "compiled": not args.eager, "tokens": args.tokens, "dim": args.dim,
                          "experts": args.experts, "topk": args.topk, **results}, indent=1))
    dispatch.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    run_main(main)
