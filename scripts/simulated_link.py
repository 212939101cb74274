"""A simulated EP link for `scripts/bench.py --simulated-link-ms`: a process group of one rank whose all-to-all of
token rows takes as long as a real one between GPUs and occupies as many SMs, so that one GPU shows how much of the
exchange a schedule hides.

It is a real torch.distributed group (a Python `ProcessGroup`), so the exchange stays the functional collective that
torch.compile traces and schedules (`dsv3.dispatch.exchange`): the copy and a kernel that holds `sms` SMs (one block
each, all of their shared memory) for `ms` run on a stream of the group's own, and the exchange's wait makes the
waiting stream wait for them, as NCCL's does. Narrow exchanges (the split sizes, each token's top-k and gate
weights: DeepEP sends those inside its token kernels) are copied at once.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import _register_process_group

_SPIN = r"""
extern "C" __global__ void simulated_link(int ns) {
    extern __shared__ unsigned char held[];  // the block's shared memory: no other block shares its SM
    unsigned long long start, now;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
    do {
        __nanosleep(256);
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
    } while (now - start < (unsigned long long)ns);
    if (threadIdx.x == 0) held[0] = 1;
}
"""
THREADS = 768  # per block, as DeepEP's intranode kernels launch
TOKEN_ROW_BYTES = 1024  # a token's hidden state is ≥ 1 KB (dim ≥ 512 in bf16); its top-k and weights are far less


class _LinkWork(dist.Work):
    def __init__(self, output: torch.Tensor, done: torch.cuda.Event):
        super().__init__()
        self.done = done
        self.future = torch.futures.Future()
        self.future.set_result([output])

    def wait(self, timeout=None) -> bool:
        torch.cuda.current_stream().wait_event(self.done)
        return True

    def get_future(self) -> torch.futures.Future:
        return self.future


class SimulatedLink(dist.ProcessGroup):
    """One rank; `alltoall_base` of token rows (2-D, at least `TOKEN_ROW_BYTES` wide) takes `ms` on `sms` SMs of its
    own stream."""

    def __init__(self, ms: float, sms: int, device: torch.device):
        super().__init__(0, 1)
        self.ns, self.sms, self.calls = int(ms * 1e6), sms, 0
        self.stream = torch.cuda.Stream(device)
        self.spin = torch.cuda._compile_kernel(_SPIN, "simulated_link")
        self.shared_bytes = torch.cuda.get_device_properties(device).shared_memory_per_block_optin
        self.spin.set_shared_memory_config(self.shared_bytes)

    def alltoall_base(self, output, input, output_split_sizes, input_split_sizes, opts):
        self.stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.stream):
            output.copy_(input)
            if input.dim() == 2 and input.size(1) * input.element_size() >= TOKEN_ROW_BYTES:
                self.calls += 1
                self.spin(grid=(self.sms, 1, 1), block=(THREADS, 1, 1), args=[self.ns],
                          shared_mem=self.shared_bytes, stream=self.stream)
            done = torch.cuda.Event()
            done.record(self.stream)
        input.record_stream(self.stream)
        output.record_stream(self.stream)
        return _LinkWork(output, done)

    @property
    def group_name(self) -> str:  # the name functional collectives find the group by
        return "simulated_link"


def simulated_link(ms: float, sms: int, device: torch.device) -> SimulatedLink:
    """The link as a group that `dsv3.dispatch.AllToAllDispatcher` can exchange over (registered by `group_name`)."""
    link = SimulatedLink(ms, sms, device)
    _register_process_group(link.group_name, link)
    return link
