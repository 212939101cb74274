"""scripts/bench.py's per-layer timing on the CPU: every block timed once per forward and backward, in the
order autograd runs them, the model left as it was; and the same under FSDP2 + EP on two gloo ranks."""

import contextlib
import json
import math
import sys

import pytest
import torch
import torch.multiprocessing as mp
from conftest import free_port, leave_process_group, torchrun_env

import train
from dsv3 import parallel
from dsv3.config import load_config
from scripts import bench
from scripts.bench import expert_rows_vs_mean, layer_times, phase_of, timed_blocks, uniform_topk


@pytest.fixture
def debug_run():
    cfg = load_config("configs/debug.toml", ["--train.global_batch=2", "--train.micro_batch=2", "--train.seq_len=32",
                                             "--model.n_layers=3", "--model.n_mtp_layers=1"])
    model, copies = train.build_model(cfg, 1, torch.device("cpu"))
    optimizer = train.build_optimizer(model, cfg.train, torch.device("cpu"), copies)
    batch = torch.randint(0, cfg.model_config().vocab_size, (2, 33), generator=torch.Generator().manual_seed(0))

    def step(i: int) -> None:
        train.train_step(model, optimizer, batch, cfg.train, i)

    return cfg, model, step


def test_every_block_is_timed_forward_then_backward_in_reverse_order(debug_run):
    cfg, model, step = debug_run
    blocks = model.blocks()
    with timed_blocks(model, torch.device("cpu")) as timed:
        assert model.blocks() == timed and len(model.routers()) == 3  # 2 MoE layers + the MTP block's
        step(1)
    assert model.blocks() == blocks  # the blocks themselves again, the wrappers gone
    for wrapper in timed:
        assert len(wrapper.forward_marks) == len(wrapper.backward_starts) == len(wrapper.backward_ends) == 1
        (forward_start, forward_end), = wrapper.forward_marks
        assert forward_start < forward_end < wrapper.backward_starts[0] < wrapper.backward_ends[0]
    main = timed[:cfg.model_config().n_layers]
    for later, earlier in zip(main[1:], main[:-1]):  # backward runs the layers last to first
        # later's input is earlier's output: one gradient ends later's backward and starts earlier's
        assert later.backward_starts[0] < earlier.backward_starts[0]
        assert later.backward_ends[0] < earlier.backward_ends[0]
        assert earlier.forward_marks[0][1] <= later.forward_marks[0][0]


def test_layer_times_split_dense_and_moe_layers(debug_run):
    cfg, model, step = debug_run
    result = layer_times(model, step, 2, torch.device("cpu"), tokens=64, seq_len=32, peak=1e12)
    mc = cfg.model_config()
    assert result["dense"]["layers"] == mc.n_dense_layers and result["moe"]["layers"] == mc.n_layers - mc.n_dense_layers
    for kind in result.values():
        assert kind["forward_ms"] > 0 and kind["backward_ms"] > 0 and 0 < kind["mfu"] < 1
        assert kind["ms"] == pytest.approx(kind["forward_ms"] + kind["backward_ms"])


def _sharded_worker(rank: int, world: int, port: int, out) -> None:
    torchrun_env(rank, world, port)
    rank, world, device = parallel.init_distributed("cpu")
    cfg = load_config("configs/debug.toml", ["--train.global_batch=4", "--train.micro_batch=2", "--train.seq_len=32",
                                             "--model.n_layers=3", "--parallel.ep=2"])
    model, copies = train.build_model(cfg, world, device)  # FSDP2 + EP 2 over gloo
    optimizer = train.build_optimizer(model, cfg.train, device, copies)
    batch = torch.randint(0, cfg.model_config().vocab_size, (2, 33), generator=torch.Generator().manual_seed(rank))
    bias_before = model.routers()[0].expert_bias.clone()

    def step(i: int) -> None:
        train.train_step(model, optimizer, batch, cfg.train, i)

    result = layer_times(model, step, 1, device, tokens=64, seq_len=32, peak=None)
    counts = {kind: (t["layers"], t["forward_ms"] > 0, t["backward_ms"] > 0) for kind, t in result.items()}
    moved = not torch.equal(model.routers()[0].expert_bias, bias_before)  # the step ran to its end, bias update too
    torch.save((counts, moved), out / f"rank-{rank}.pt")
    leave_process_group()


@pytest.mark.slow
def test_layers_are_timed_under_fsdp2_and_expert_parallelism(tmp_path):
    mp.spawn(_sharded_worker, args=(2, free_port(), tmp_path), nprocs=2)
    for rank in range(2):
        counts, moved = torch.load(tmp_path / f"rank-{rank}.pt")
        assert counts == {"dense": (1, True, True), "moe": (2, True, True)} and moved


def _bench_worker(rank: int, world: int, port: int, out, overrides: list[str]) -> None:
    torchrun_env(rank, world, port)
    sys.argv = ["bench.py", "--config", "configs/debug.toml", "--steps=2", "--warmup=1", "--layer-steps=1", "--json",
                "--train.global_batch=4", "--train.micro_batch=2", "--train.seq_len=32", *overrides]
    with open(out / f"rank-{rank}.json", "w") as f, contextlib.redirect_stdout(f):
        bench.main()
    leave_process_group()  # bench.main left the group; this exits before gloo's threads can abort the process


@pytest.mark.parametrize("overrides, moe", [(["--parallel.ep=2"], True),
                                            (["--parallel.ep=2", "--model.n_dense_layers=3", "--model.n_mtp_layers=0"],
                                             False)], ids=["moe", "dense-only"])
@pytest.mark.slow
def test_bench_at_ep_2_reports_the_ep_share_where_tokens_are_routed(tmp_path, overrides, moe):
    mp.spawn(_bench_worker, args=(2, free_port(), tmp_path, overrides), nprocs=2)
    result = json.loads((tmp_path / "rank-0.json").read_text())
    assert result["world"] == 2 and ("ep_rank_share_min_max" in result) == moe
    assert (tmp_path / "rank-1.json").read_text() == ""  # one rank prints


def test_expert_rows_vs_mean_spans_every_layer_and_step_and_is_none_without_moe_layers():
    loads = [torch.tensor([[2, 6], [4, 4]]), torch.tensor([[4, 4], [1, 7]])]  # 2 steps, 2 layers, 2 experts
    assert expert_rows_vs_mean(loads) == [0.25, 1.75]
    assert expert_rows_vs_mean([torch.zeros(0, 2, dtype=torch.long)] * 2) is None  # no MoE layer: nothing routed


@pytest.mark.parametrize("kernel, phase", [
    # CUTLASS's grouped GEMMs, bf16 and FP8 (torch._grouped_mm, torch._scaled_grouped_mm), cut short
    ("_ZN7cutlass13device_kernelIN2at4cuda6detail25enable_3x_kernel_for_sm9xINS_4gemm6kernel13GemmUniversalINS5_17Group"
     "ProblemShape", "expert GEMMs"),
    ("_ZN7cutlass13device_kernelINS_4gemm6kernel13GemmUniversalINS1_17GroupProblemShapeIN4cute5tupleIJiiiEEEEENS1_10"
     "collective13CollectiveMmaINS1_39MainloopSm90ArrayTmaGmmaWarpSpecializedILi4E", "expert GEMMs"),
    ("nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_NNT", "dense GEMMs"),
    # inductor's kernels that make the grouped GEMM's FP8 operands (SwiGLU and its backward fused in): not GEMMs
    ("triton_red_fused__scaled_grouped_mm__to_copy_abs_amax_clamp_exp2_floor_log2_mul_reciprocal_silu_silu_backward_"
     "split_unsqueeze_15", "fp8 quantize"),
    ("triton_poi_fused__scaled_grouped_mm__to_copy_clamp_exp2_floor_log2_mul_reciprocal_squeeze_unsqueeze_4",
     "fp8 quantize"),
    ("triton_poi_fused__fused_rms_norm__scaled_mm__to_copy_add_clamp_clone_mul_reciprocal_silu_silu_backward_t_view_10",
     "fp8 quantize"),
    # DeepGEMM's grouped GEMM (--train.expert_precision=fp8-blockwise), and inductor's kernels that feed it
    ("void deep_gemm::sm90_fp8_gemm_1d2d_impl<(cute::UMMA::Major)0, 0u, 7168u, 4096u, 32u, 128u, 192u, 128u>",
     "expert GEMMs"),
    ("triton_poi_fused__to_copy_clamp_clone_exp2_floor_fp8_block_grouped_mm_log2_mul_reciprocal_silu_split_t_"
     "unsqueeze_view_37", "fp8 quantize"),
    ("triton_red_fused__fused_rms_norm__to_copy_abs_add_amax_clamp_clone_exp2_floor_floor_divide_fp8_block_grouped_"
     "mm_ge_index_log2_mul_reciprocal_scalar_tensor_t_unsqueeze_view_where_33", "fp8 quantize"),
    ("_triton_fp8_per_group_colwise_scales_dual_kernel", "fp8 quantize"),
    ("_fp8_weight_rows_kernel", "fp8 quantize"),
    ("_fp8_weight_cols_kernel", "fp8 quantize"),
    ("_fp8_group_cols_kernel", "fp8 quantize"),
    ("_gather_rows_kernel", "routing + permutation"),  # EP's received tokens (dsv3.token_copies_kernels)
    ("_combine_rows_backward_kernel", "routing + permutation"),
    ("_sum_rows_kernel", "routing + permutation"),
    ("triton_red_fused__to_copy_arange_eq_exp_logsumexp_mul_sub_unsqueeze_0", "loss"),
    ("triton_poi_fused_cat_mul_silu_silu_backward_split_5", "other"),
])
def test_kernels_are_split_into_the_phases_they_belong_to(kernel, phase):
    assert phase_of(kernel) == phase


def test_uniform_topk_draws_uniform_k_subsets_that_fan_out_as_random_ones():
    """Balanced routing (--balanced-routing): distinct experts per token, every expert its share, a token's copies
    spread over EP ranks as a uniform K-subset's are (not round-robin, which keeps a token on ~1 rank), the same
    routing for the same seed (the recompute) and another for another seed."""
    T, E, K, ep = 20000, 64, 6, 4
    idx = uniform_topk(torch.tensor(7), T, E, K)
    assert idx.shape == (T, K) and (idx.sort(-1).values.diff(dim=-1) > 0).all()
    counts = torch.bincount(idx.flatten(), minlength=E).float()
    assert (counts / counts.mean() - 1).abs().max() < 0.1
    ranks_per_token = torch.stack([(idx // (E // ep) == r).any(-1) for r in range(ep)]).sum(0).float().mean()
    expected = ep * (1 - math.comb(E - E // ep, K) / math.comb(E, K))
    assert abs(ranks_per_token - expected) < 0.02 * expected
    assert torch.equal(uniform_topk(torch.tensor(7), T, E, K), idx)
    assert (uniform_topk(torch.tensor(8), T, E, K) != idx).any(-1).float().mean() > 0.9


def test_balanced_routing_gives_every_expert_its_share_in_a_training_step():
    """install_balanced_routing through train_step (and activation checkpointing, whose recompute must route as the
    forward did): each MoE layer's experts get near-equal rows, the routers still learn their gate weights, and the
    checkpoint holds what a plain run's does; without it, the learned router's rows are uneven."""
    rows, keys = {}, {}
    for balanced in (False, True):
        cfg = load_config("configs/debug.toml", ["--train.global_batch=8", "--train.micro_batch=4",
                                                 "--train.seq_len=256", "--train.activation_checkpoint=full"])
        model, copies = train.build_model(cfg, 1, torch.device("cpu"))
        if balanced:
            bench.install_balanced_routing(model)
        optimizer = train.build_optimizer(model, cfg.train, torch.device("cpu"), copies)
        batch = torch.randint(0, 50, (8, 257), generator=torch.Generator().manual_seed(0))  # a narrow vocabulary
        before = [r.weight.detach().clone() for r in model.routers()]
        values, tokens_per_expert = train.train_step(model, optimizer, batch, cfg.train, 1)
        assert torch.isfinite(values).all()
        assert all(not torch.equal(b, r.weight) for b, r in zip(before, model.routers()))
        rows[balanced] = expert_rows_vs_mean([tokens_per_expert])
        keys[balanced] = set(model.state_dict())
    low, high = rows[True]
    assert 0.85 < low and high < 1.15, rows
    assert rows[False][1] - rows[False][0] > high - low, rows
    assert keys[True] == keys[False]


def test_profiled_times_split_idle_exposed_communication_and_host_waits():
    """Two steps: compute kernels [0, 4) and [6, 9), an exchange [3, 8) (hidden 3-4 and 6-8, exposed 4-6), nothing
    9-10, the host from 0 to 3, waiting 2 units of it: in a sync, and in a copy to host memory (which waits for the
    work queued before it, as EP's split sizes do). Times in µs, per step in ms."""
    from types import SimpleNamespace

    def event(name, start, end, device):
        return SimpleNamespace(name=name, time_range=SimpleNamespace(start=start * 1e3, end=end * 1e3),
                               device_type=device)

    gpu, cpu = torch.autograd.DeviceType.CUDA, torch.autograd.DeviceType.CPU
    kernels = [event("nvjet_gemm", 0, 4, gpu), event("ncclDevKernel_AllToAll", 3, 8, gpu),
               event("nvjet_gemm", 6, 9, gpu), event("flash_fwd", 10, 12, gpu)]
    events = kernels + [event("cudaStreamSynchronize", 1, 2, cpu), event("cudaMemcpyAsync", 2, 3, cpu),
                        event("aten::mm", 0, 1, cpu)]
    times = bench.gpu_times(kernels, steps=2) | bench.host_times(events, steps=2)
    assert times == {"gpu_idle": 0.5, "exposed_communication": 1.0, "host_sync_wait": 1.0, "host_busy": 0.5}


def test_profile_steps_records_the_steps_after_one_warm_up_call():
    calls = []

    def step(i):
        calls.append(i)
        with torch.profiler.record_function(f"bench step {i}"):
            torch.ones(8).sum()

    events = bench.profile_steps(step, 2, [torch.profiler.ProfilerActivity.CPU], torch.device("cpu"))
    recorded = sorted(e.name for e in events if e.name.startswith("bench step"))
    assert calls == [1, 2, 3] and recorded == ["bench step 2", "bench step 3"]


def test_one_rank_exchange_is_refused_where_it_cannot_run(monkeypatch):
    """--one-rank-exchange needs one GPU (its NCCL group of one): elsewhere one error that says so, before any model."""
    monkeypatch.setattr(sys, "argv", ["bench.py", "--config", "configs/debug.toml", "--train.device=cpu",
                                      "--one-rank-exchange"])
    monkeypatch.setattr(train, "build_model", lambda *a, **k: pytest.fail("built a model"))
    with pytest.raises(bench.UserError, match="--one-rank-exchange measures EP's code path on one GPU"):
        bench.main()


def test_a_simulated_link_needs_the_one_rank_exchange(monkeypatch):
    monkeypatch.setattr(sys, "argv", ["bench.py", "--config", "configs/debug.toml", "--train.device=cpu",
                                      "--simulated-link-ms", "1"])
    monkeypatch.setattr(train, "build_model", lambda *a, **k: pytest.fail("built a model"))
    with pytest.raises(bench.UserError, match="--simulated-link-ms simulates EP's link under --one-rank-exchange"):
        bench.main()


@pytest.mark.gpu
def test_the_simulated_link_delivers_the_rows_after_its_delay_and_leaves_the_stream_free_meanwhile():
    """An exchange of token rows over the link: the rows arrive unchanged, no sooner than the delay; the stream that
    started it runs on meanwhile (its own work is not delayed) until it waits; the counts' exchange is not delayed."""
    from scripts.simulated_link import simulated_link

    link = simulated_link(ms=5.0, sms=24, device=torch.device("cuda"))
    rows, counts = torch.randn(4096, 512, device="cuda"), torch.arange(8, device="cuda")
    clock = [torch.cuda.Event(enable_timing=True) for _ in range(4)]
    clock[0].record()
    got = torch.ops._c10d_functional.all_to_all_single(rows, [4096], [4096], link.group_name)
    clock[1].record()  # before the wait: the stream was not held
    got = torch.ops._c10d_functional.wait_tensor(got)
    clock[2].record()
    got_counts = torch.ops._c10d_functional.wait_tensor(
        torch.ops._c10d_functional.all_to_all_single(counts, [8], [8], link.group_name))
    clock[3].record()
    torch.cuda.synchronize()
    assert torch.equal(got, rows) and torch.equal(got_counts, counts)
    # held, the stream would show the 5 ms delay; what it shows is the host's first call (1.0 ms seen on an H200)
    assert clock[0].elapsed_time(clock[1]) < 2.5
    assert clock[0].elapsed_time(clock[2]) >= 5.0
    assert clock[2].elapsed_time(clock[3]) < 2.5
    assert link.calls == 1
