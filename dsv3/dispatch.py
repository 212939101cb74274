"""The expert-parallel dispatchers that `dsv3.parallel.apply_expert_parallel` hands each MoE layer
(`parallel.ep_backend`): `AllToAllDispatcher` over torch's all_to_all_single, `DeepEPDispatcher` over DeepEP's
NVLink kernels (normal mode, intranode: every EP rank on one host, ep ∈ {2, 4, 8}).

    count → dispatch → expand to expert rows → grouped GEMM → weight and reduce → combine → sum over ranks

Both send each token to a rank once, however many of its experts live there: `recv_x` [R, D] holds each received
token once, `recv_idx` [R, K] its top-k as *local* expert ids (−1: an expert on another rank). The expert side
expands that to rows, one per (token, local expert), sorted by local expert (`expert_rows`), and the experts sum a
token's rows back into one with the gate weights (`token_copies.TokenCopies.weights`); the combine returns that row
to the token's rank, which sums its ranks' rows: y_t = Σ_ranks Σ_{k on that rank} g_t,k · FFN_k(x_t). Both pad
groups to `align` (`pad_order`). The autograd ops, the one host sync, the overlaps, the buffer and what compiles:
docs/deepep.md#how-the-dispatcher-works.
"""

from __future__ import annotations

import atexit
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from dsv3.config import UserError
from dsv3.token_copies import (
    TokenCopies,
    argsort_small,
    gather_token_copies,
    pad_order,
    pads_groups,
    sum_token_copies,
)


def exchange(x: torch.Tensor, out_splits: list[int], in_splits: list[int],
             group: dist.ProcessGroup) -> torch.Tensor:
    """all_to_all_single as a functional collective (a new output tensor, not a filled buffer), an op that
    selective AC can keep (recompute does not exchange again) and that torch.compile traces. Differentiable: its
    backward is the reverse exchange. Under compile the splits may be unbacked SymInts (`host_splits`)."""
    out = torch.ops._c10d_functional_autograd.all_to_all_single(x.contiguous(), out_splits, in_splits,
                                                               group.group_name)
    return torch.ops._c10d_functional.wait_tensor(out)


# The split sizes' copy to the host as two ops, so that the GPU has work queued between them (the shared experts):
# the host waits for the copy, and the GPU does not idle while the host, woken, launches the block's next kernels.
_copies_to_host: dict[int, torch.cuda.Event] = {}  # the pinned buffer's address → the event after its copy


@torch.library.custom_op("dsv3::start_copy_to_host", mutates_args=())
def start_copy_to_host(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`values` copying into pinned host memory, not yet readable (`host_splits` waits for them), and a zero on
    their device made after the copy's start: work that adds it is queued behind the copy (`run_during_copy`)."""
    zero = values.new_zeros((), dtype=torch.float32)
    if not values.is_cuda:
        return values.clone(), zero
    host = torch.empty(values.shape, dtype=values.dtype, pin_memory=True)
    host.copy_(values, non_blocking=True)
    done = torch.cuda.Event()
    done.record()
    _copies_to_host[host.data_ptr()] = done
    return host, zero


@start_copy_to_host.register_fake
def _(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.empty(values.shape, dtype=values.dtype, device="cpu"), values.new_empty((), dtype=torch.float32)


@torch.library.custom_op("dsv3::finish_copy_to_host", mutates_args=())
def finish_copy_to_host(host: torch.Tensor, after: list[torch.Tensor]) -> torch.Tensor:
    """Wait for `host`'s copy; `after`: tensors the wait takes only so that the compiler queues their work first."""
    done = _copies_to_host.pop(host.data_ptr(), None)
    if done is not None:
        done.synchronize()
    return host.clone()


@finish_copy_to_host.register_fake
def _(host: torch.Tensor, after: list[torch.Tensor]) -> torch.Tensor:
    return torch.empty_like(host)


def host_splits(copying: torch.Tensor, after: list[torch.Tensor]) -> list[int]:
    """The split sizes on the host (`start_copy_to_host`'s): the one device→host sync of a MoE layer, after the
    work of `after` is queued. Under torch.compile (with `capture_scalar_outputs`) they are unbacked SymInts, so the
    block stays one graph and no count recompiles."""
    sizes = torch.ops.dsv3.finish_copy_to_host(copying, after).tolist()
    for size in sizes:
        torch._check(size >= 0)
    return sizes


class SplitSizesStarted(NamedTuple):
    """What `AllToAllDispatcher.start` begun: the split sizes on their way to the host, and the send order."""
    copying: torch.Tensor  # the split sizes' pinned host buffer, still filling (`host_splits` waits for it)
    order: torch.Tensor  # the pairs (token, rank) in the order sent
    after_copy: torch.Tensor  # a zero made after the copy's start: work that adds it is queued behind the copy
    after: list[torch.Tensor]  # outputs the host's wait takes, so that their work is queued first (`run_during_copy`)


class AllToAllDispatcher:
    """Expert parallelism over `group`, rank r holding experts [r·E_local, (r+1)·E_local), the way DeepEP exchanges:
    each token sent once to each rank that holds one of its experts, with its top-k as that rank's local expert ids
    (−1: another rank's) and its gate weights; the experts there sum its rows (`TokenCopies.weights`) and the combine
    sums its ranks' (`sum_token_copies`). The split sizes reach the host once (`host_splits`); `align` > 1 pads each
    local expert's group (`pad_order`)."""

    shared_experts_first = True  # they run while the split sizes travel to the host (`run_during_copy`)

    def __init__(self, group: dist.ProcessGroup, n_experts: int, align: int = 1):
        self.group = group
        self.ep, self.rank = group.size(), group.rank()  # any group of one: bench.py's simulated link
        self.n_local = n_experts // self.ep
        self.align = align

    def start(self, topk_idx: torch.Tensor, tokens_per_expert: torch.Tensor) -> SplitSizesStarted:
        """Exchange the counts, start their copy to the host and compute the order of the pairs sent."""
        ep, n_local, device = self.ep, self.n_local, topk_idx.device
        in_rank = torch.zeros(topk_idx.size(0), ep, dtype=torch.bool, device=device)
        in_rank.scatter_(1, topk_idx // n_local, True)  # [T, ep]: token t has an expert on rank s
        # pairs (t, s) = t·ep + s, token t for rank s, sorted by rank, then token. Each rank also sends itself a zero
        # row (pair −1) that one of its experts computes: no size is ever 0, no branch reads a count (one graph)
        ranks = torch.arange(ep, device=device)
        key = torch.where(in_rank, 2 * ranks, 2 * ep).flatten()  # [T·ep], pairs not sent last
        order = argsort_small(torch.cat([key, key.new_full((1,), 2 * self.rank + 1)]))
        phantom = (ranks == self.rank).long()  # [ep]
        # counts[s]: our copies for each of rank s's experts, and the tokens we send it; received[src]: theirs for us
        counts = torch.cat([tokens_per_expert.view(ep, n_local), (in_rank.sum(0) + phantom)[:, None]], dim=1)
        even = [n_local + 1] * ep
        received = exchange(counts.flatten(), even, even, self.group).view(ep, n_local + 1)
        sizes = torch.cat([counts[:, n_local], received[:, n_local], received[:, :n_local].sum()[None]])
        copying, after_copy = torch.ops.dsv3.start_copy_to_host(sizes)
        return SplitSizesStarted(copying, order, after_copy, [])

    def run_during_copy(self, fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor,
                        started: SplitSizesStarted) -> tuple[torch.Tensor, SplitSizesStarted]:
        """fn(x), queued on the GPU between the split sizes' copy to the host and the host's wait for them, however
        the compiler orders the block: its input waits for the copy's start (+ 0), the host's wait for its output.
        So the GPU computes while the host waits, and while the woken host launches the dispatch's small kernels."""
        y = fn(x + started.after_copy.to(x.dtype))
        return y, started._replace(after=[*started.after, y])

    def dispatch(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
                 started: SplitSizesStarted) -> tuple[TokenCopies, torch.Tensor, Any]:
        (n_tokens, topk), ep, n_local, device = topk_idx.shape, self.ep, self.n_local, x.device
        order = started.order
        splits = host_splits(started.copying, [order, *started.after])  # the send order computed before the wait
        sent, got, n_rows = splits[:ep], splits[ep:2 * ep], splits[2 * ep] + 1  # + the zero row's
        n_sent = sum(sent)
        torch._check(sent[self.rank] >= 1)  # the zero row: for the compiler, no row count is 0
        torch._check(got[self.rank] >= 1)
        torch._check(n_sent <= n_tokens * ep + 1)
        order = order[:n_sent]
        order = torch.where(order < n_tokens * ep, order, -1)  # pair −1: the zero row
        recv_x = exchange(gather_token_copies(x, order, ep), got, sent, self.group)
        token, rank = order // ep, order % ep
        token_topk = topk_idx[token]  # [n_sent, K]
        local_idx = torch.where(token_topk // n_local == rank[:, None], token_topk - n_local * rank[:, None], -1)
        zero_row_idx = torch.full((topk,), -1, device=device)
        zero_row_idx[0] = n_local - 1  # our last expert computes the zero row
        send_idx = torch.where((order >= 0)[:, None], local_idx, zero_row_idx)
        send_weights = gather_token_copies(topk_weights, order, ep)  # the zero row's 0
        # the top-k travel beside their weights as floats (exact: E < 2^24), so that they are one exchange
        recv_topk = exchange(torch.cat([send_weights, send_idx.to(send_weights.dtype)], dim=1), got, sent, self.group)
        recv_weights, recv_idx = recv_topk[:, :topk], recv_topk[:, topk:].long()
        torch._check(n_rows <= recv_idx.numel())  # expert_rows' slice: exactly n_rows, no new unknown size
        rows, expert_of_row, tokens_per_local_expert = expert_rows(recv_idx, n_local, n_rows)
        if pads_groups(self.align, device):  # N varies by step: few buffer sizes (bucket)
            rows, tokens_per_local_expert = pad_order(rows, expert_of_row, tokens_per_local_expert, self.align,
                                                      bucket=True)
        return (TokenCopies(recv_x, rows, topk, recv_weights, received=True), tokens_per_local_expert,
                (order, sent, got, n_tokens))

    def combine(self, token_y: torch.Tensor, ctx: Any) -> torch.Tensor:
        """token_y [R, D]: the experts' sums per received token → y [T, D], each token's sum over its ranks."""
        order, sent, got, n_tokens = ctx
        pair_y = exchange(token_y, sent, got, self.group)  # [n_sent, D] in the order sent
        return sum_token_copies(pair_y, order, self.ep, n_tokens, received=True)

    def wait(self, y: torch.Tensor) -> torch.Tensor:
        return y


SUPPORTED_EP = (2, 4, 8)  # DeepEP's intranode (NVLink) kernels; more ranks need its NVSHMEM internode build
_buffer = None  # the process's deep_ep.Buffer


def check(ep: int, device: torch.device, num_sms: int = 24, local_world: int | None = None) -> None:
    """Fail at start-up, before the model is built, if `parallel.ep_backend=deepep` cannot run here
    (`local_world`: processes per host, when known)."""
    fallback = "or use --parallel.ep_backend=all_to_all"
    if device.type != "cuda":
        raise UserError(f"parallel.ep_backend=deepep needs CUDA GPUs joined by NVLink, not {device.type}: {fallback}")
    if ep not in SUPPORTED_EP:
        raise UserError(f"parallel.ep_backend=deepep runs DeepEP's intranode kernels, which support an EP size of "
                        f"{', '.join(map(str, SUPPORTED_EP))} (all on one host), not parallel.ep={ep}: set "
                        f"--parallel.ep to one of those, {fallback}")
    if local_world is not None and local_world % ep:
        raise UserError(f"parallel.ep_backend=deepep needs each EP group on one host, but parallel.ep={ep} does not "
                        f"divide the {local_world} processes per host: pick an ep that does, {fallback}")
    if num_sms <= 0 or num_sms % 2:
        raise UserError(f"parallel.deepep_sms must be a positive even number, got {num_sms}")
    try:
        import deep_ep  # noqa: F401
    except ImportError as e:
        raise ImportError(f"parallel.ep_backend=deepep needs DeepEP, which did not import ({e}): build it from "
                          "source as docs/deepep.md says (an intranode-only build, no NVSHMEM), "
                          f"{fallback}") from e


def get_buffer(group: dist.ProcessGroup, dim: int, num_sms: int = 24):
    """The process's one DeepEP buffer for tokens of `dim` bf16 values, NVLink part only (`num_rdma_bytes=0`):
    sized from DeepEP's own hints for its dispatch and combine configs. Never ask for RDMA hints: an intranode
    build cannot serve them."""
    global _buffer
    from deep_ep import Buffer

    ep = group.size()
    if _buffer is None:
        Buffer.set_num_sms(num_sms)  # a class setting, read by the get_*_config calls below and at each call
        hidden_bytes = dim * 2  # bf16
        configs = (Buffer.get_dispatch_config(ep), Buffer.get_combine_config(ep))
        num_nvl_bytes = max(c.get_nvl_buffer_size_hint(hidden_bytes, ep) for c in configs)
        _buffer = Buffer(group, num_nvl_bytes=num_nvl_bytes, num_rdma_bytes=0, explicitly_destroy=True)
        atexit.register(close)
    elif _buffer.group_size != ep:
        raise ValueError(f"one DeepEP buffer per process: it serves an EP group of {_buffer.group_size}, not {ep}")
    return _buffer


def close() -> None:
    """Free the DeepEP buffer (every EP rank must call it: it ends in a barrier). Safe to call twice."""
    global _buffer
    if _buffer is not None:
        _buffers.pop(id(_buffer), None)
        _buffer.destroy()
        _buffer = None


def expert_rows(recv_topk_idx: torch.Tensor, n_local: int, n_rows: int
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """recv_topk_idx [R, K] (local expert ids, −1 on another rank; n_rows of them ≥ 0, already on the host) →
    (`order` [n_rows], the slot of each row sorted by local expert; expert_of_row [n_rows];
    tokens_per_local_expert [n_local]), with no host sync."""
    local = recv_topk_idx.flatten()
    local = torch.where(local >= 0, local, n_local)  # other ranks' experts sort after ours
    order = argsort_small(local)[:n_rows]  # by local expert, then by received token
    counts = torch.zeros(n_local + 1, dtype=torch.int64, device=local.device)
    counts.scatter_add_(0, local, torch.ones_like(local))
    return order, local[order], counts[:n_local]


# DeepEP's exchange as two torch.library ops, so that selective AC keeps their outputs (`parallel._EXCHANGE_OPS`): the
# recompute neither exchanges again nor waits for the receive counts. An op passes only tensors, so the handle is its
# six tensors (intranode), and the buffer is named by a key into `_buffers`.
_buffers: dict[int, Any] = {}  # id(buffer) → the deep_ep.Buffer (or a test's stand-in) the ops run on


@torch.library.custom_op("dsv3::deepep_dispatch", mutates_args=())
def deepep_dispatch(x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor, n_experts: int,
                    buffer_key: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                                              torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """buffer.dispatch of tokens and gate weights → (recv_x [R, D], recv_weights [R, K], recv_idx [R, K], the rows
    received (one per token and local expert) as a host tensor [1], *handle). The host waits for the receive counts."""
    buffer = _buffers[buffer_key]
    per_rank, _, per_expert, in_rank, _ = buffer.get_dispatch_layout(topk_idx, n_experts)
    recv_x, recv_idx, recv_weights, recv_counts, handle, _ = buffer.dispatch(
        x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
        topk_idx=topk_idx, topk_weights=topk_weights)
    return recv_x, recv_weights, recv_idx, torch.tensor([sum(recv_counts)], dtype=torch.int64), *handle


@deepep_dispatch.register_fake
def _(x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor, n_experts: int, buffer_key: int):
    """Traced, the received count R is an unbacked size; the handle's shapes are DeepEP's intranode ones."""
    buffer = _buffers[buffer_key]
    ep, channels = buffer.group_size, type(buffer).num_sms // 2  # the dispatch config's channels: one per 2 SMs
    (n_tokens, topk), received = topk_idx.shape, torch.library.get_ctx().new_dynamic_size()

    def int32(*shape: Any) -> torch.Tensor:
        return x.new_empty(shape, dtype=torch.int32)

    return (x.new_empty(received, x.size(1)), topk_weights.new_empty(received, topk),
            topk_idx.new_empty(received, topk), torch.empty(1, dtype=torch.int64),
            int32(ep, ep), int32(ep, channels), int32(ep, channels), int32(received),  # rank/channel prefixes, source
            x.new_empty(n_tokens, ep, dtype=torch.bool), int32(n_tokens, ep))  # token in rank, send head


def _dispatch_setup(ctx, inputs, output) -> None:
    ctx.buffer_key, ctx.handle, ctx.topk = inputs[4], output[4:], inputs[1].size(1)


def _dispatch_backward(ctx, grad_recv_x, grad_recv_weights, *_):
    """A combine of both gradients (an op: the compiler traces this backward)."""
    weights = grad_recv_weights.float() if grad_recv_weights is not None else grad_recv_x.new_zeros(
        grad_recv_x.size(0), ctx.topk, dtype=torch.float32)
    grad_x, grad_weights = torch.ops.dsv3.deepep_combine_gradients(grad_recv_x, weights, ctx.buffer_key, *ctx.handle)
    return grad_x, None, grad_weights, None, None


deepep_dispatch.register_autograd(_dispatch_backward, setup_context=_dispatch_setup)


@torch.library.custom_op("dsv3::deepep_combine_gradients", mutates_args=())
def deepep_combine_gradients(grad_recv_x: torch.Tensor, grad_recv_weights: torch.Tensor, buffer_key: int,
                             handle0: torch.Tensor, handle1: torch.Tensor, handle2: torch.Tensor,
                             handle3: torch.Tensor, handle4: torch.Tensor,
                             handle5: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """buffer.combine of the received tokens' gradients and their gate weights' → (∂x [T, D], ∂weights [T, K])."""
    grad_x, grad_weights, _ = _buffers[buffer_key].combine(
        grad_recv_x.contiguous(), (handle0, handle1, handle2, handle3, handle4, handle5),
        topk_weights=grad_recv_weights.contiguous())
    return grad_x, grad_weights


@deepep_combine_gradients.register_fake
def _(grad_recv_x, grad_recv_weights, buffer_key, handle0, handle1, handle2, handle3, handle4, handle5):
    n_tokens = handle5.size(0)  # send_head [T, ep], whose rows DeepEP's combine returns
    return (grad_recv_x.new_empty(n_tokens, grad_recv_x.size(1)),
            grad_recv_weights.new_empty(n_tokens, grad_recv_weights.size(1)))

_pending_combine = None  # the event of the combine in flight (an op returns only tensors)


@torch.library.custom_op("dsv3::deepep_combine", mutates_args=())
def deepep_combine(token_y: torch.Tensor, buffer_key: int, handle0: torch.Tensor, handle1: torch.Tensor,
                   handle2: torch.Tensor, handle3: torch.Tensor, handle4: torch.Tensor,
                   handle5: torch.Tensor) -> torch.Tensor:
    """buffer.combine, left running on DeepEP's stream: `DeepEPDispatcher.wait` joins it."""
    global _pending_combine
    y, _, _pending_combine = _buffers[buffer_key].combine(
        token_y, (handle0, handle1, handle2, handle3, handle4, handle5), async_finish=True)
    return y


def _combine_setup(ctx, inputs, output) -> None:
    ctx.buffer_key, ctx.handle = inputs[1], inputs[2:]


def _combine_backward(ctx, grad_y):
    """A dispatch of the gradient with the cached handle."""
    grad_token_y, *_ = _buffers[ctx.buffer_key].dispatch(grad_y.contiguous(), handle=ctx.handle)
    return (grad_token_y,) + (None,) * 7


deepep_combine.register_autograd(_combine_backward, setup_context=_combine_setup)


class DeepEPDispatcher:
    """Expert parallelism over `buffer` (a deep_ep.Buffer of the EP group): rank r holds experts
    [r·E_local, (r+1)·E_local), as with AllToAllDispatcher. Tokens must be bf16, the only dtype DeepEP sends
    (on CUDA they are: FSDP computes in bf16); topk_idx int64 and weights fp32, as the router makes them."""

    shared_experts_first = False  # they run under its asynchronous combine

    def __init__(self, buffer, n_experts: int, align: int = 1):
        self.buffer_key = id(buffer)
        _buffers[self.buffer_key] = buffer
        self.n_experts = n_experts
        self.ep = buffer.group_size
        self.n_local = n_experts // self.ep
        self.align = align

    def start(self, topk_idx: torch.Tensor, tokens_per_expert: torch.Tensor) -> None:
        return None  # DeepEP counts inside its dispatch

    def dispatch(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
                 started: None = None) -> tuple[TokenCopies, torch.Tensor, Any]:
        recv_x, recv_weights, recv_idx, n_rows, handle = self._exchange(x, topk_idx, topk_weights)
        # after what was received, a zero row of our own that our last expert computes (weight 0), as all_to_all
        # sends itself one: no size is ever 0 (R may be), so nothing branches on a count (traced, R is unbacked)
        topk = recv_idx.size(1)
        zero_row_idx = torch.full((1, topk), -1, dtype=recv_idx.dtype, device=recv_idx.device)
        zero_row_idx[0, 0] = self.n_local - 1
        recv_x = torch.cat([recv_x, recv_x.new_zeros(1, recv_x.size(1))])
        recv_idx = torch.cat([recv_idx, zero_row_idx])
        recv_weights = torch.cat([recv_weights, recv_weights.new_zeros(1, topk)])
        order, expert_of_row, tokens_per_local_expert = expert_rows(recv_idx, self.n_local, n_rows + 1)
        if pads_groups(self.align, x.device):  # N varies by step: few buffer sizes (bucket)
            order, tokens_per_local_expert = pad_order(order, expert_of_row, tokens_per_local_expert, self.align,
                                                       bucket=True)
        # the experts sum each received token's rows (`TokenCopies.weights`) into one row per received token
        copies = TokenCopies(recv_x, order, topk, recv_weights, received=True)
        return copies, tokens_per_local_expert, handle

    @torch.compiler.disable
    def combine(self, token_y: torch.Tensor, handle: tuple[torch.Tensor, ...]) -> torch.Tensor:
        """token_y [R + 1, D]: the experts' sums per received token and the zero row's. Starts the exchange and
        returns y before it has arrived: call `wait(y)` before reading y. (Selective AC's recompute returns the saved
        y at once.)"""
        return torch.ops.dsv3.deepep_combine(token_y[:-1], self.buffer_key, *handle)

    @torch.compiler.disable
    def wait(self, y: torch.Tensor) -> torch.Tensor:
        """Make the current stream wait for the combine in flight (what ran since overlapped it)."""
        global _pending_combine
        event, _pending_combine = _pending_combine, None
        if event is not None:
            event.current_stream_wait()
        return y

    def _exchange(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor):
        """The dispatch, traced: under torch.compile (with `capture_scalar_outputs`) the received tokens and rows
        are unbacked SymInts, as all_to_all's split sizes are."""
        recv_x, recv_weights, recv_idx, n_rows, *handle = torch.ops.dsv3.deepep_dispatch(
            x, topk_idx, topk_weights, self.n_experts, self.buffer_key)
        n_rows = n_rows.item()
        torch._check(n_rows >= 0)
        torch._check(n_rows <= recv_idx.numel())  # expert_rows' slice: exactly n_rows, no new unknown size
        return recv_x, recv_weights, recv_idx, n_rows, tuple(handle)
