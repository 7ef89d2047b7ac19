"""Which CUDA kernels a flash_ext call runs (names from torch.profiler), and whether this GPU and build
have the sm90 kernels."""
import torch

import flash_ext


def sm90_expected():
    """A compute capability 9.0 GPU and a build with 90a: the sm90 kernels take the head dims they have."""
    return torch.cuda.get_device_capability() == (9, 0) and "90a" in flash_ext.info()["cuda_archs"]


def forward_kernel_names(*args, **kwargs):
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        flash_ext.attention(*args, **kwargs)
        torch.cuda.synchronize()
    return [event.key for event in prof.key_averages()]


def backward_kernel_names(q, k, v, **kwargs):
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        out = flash_ext.attention(q, k, v, **kwargs)
        out.backward(torch.randn_like(out))
        torch.cuda.synchronize()
    return [event.key for event in prof.key_averages()]
