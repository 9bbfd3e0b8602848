"""The transformers modules' weights once the native forward runs the model: sampled, then released.

The native forward (engine/model/native/) holds every weight it needs in its own layout (the linears
packed once, engine/model/native/linear.py), so a model the runner loaded itself would otherwise hold
each matrix twice: the modules' parameters and the packed copy. `release` swaps every parameter for a
zero-byte placeholder (a broadcast scalar of the same shape and dtype, as a GGUF skeleton's are), so
the storage goes as soon as the native forward holds no view of it (the norms and an untied embedding
stay: the native forward reads those in place). The oracle the tests compare against is a model they
load themselves. What the cells' identity hashes (engine/core/state/identity.py: every tensor's name,
shape, dtype and a strided sample of its values) is taken first, by `weight_samples`.
"""

import torch

SAMPLE = 1024  # values sampled per tensor for the identity's fingerprint


def weight_samples(model) -> list[tuple[bytes, bytes]]:
    """(`name:shape:dtype`, an evenly strided sample of at most `SAMPLE` values as bytes) per tensor of the
    state dict, by name; a placeholder's or a meta tensor's sample is empty."""
    out = []
    for name, t in sorted(model.state_dict().items()):
        header = f"{name}:{tuple(t.shape)}:{t.dtype}".encode()
        sample = b""
        if t.device.type != "meta" and t.numel():
            flat = t.detach().reshape(-1)
            sample = flat[:: max(1, flat.numel() // SAMPLE)][:SAMPLE].contiguous().cpu().view(torch.uint8).numpy().tobytes()
        out.append((header, sample))
    return out


def release(model) -> int:
    """Swap every parameter of `model` for a zero-byte placeholder; returns the bytes no longer held by
    the modules (freed unless something else still views them). Buffers (RoPE tables) stay."""
    dropped: dict[int, int] = {}  # storage -> bytes (a tied weight is one storage under two modules)
    for module in model.modules():
        for name, p in list(module._parameters.items()):
            if p is None or p.untyped_storage().nbytes() <= p.element_size():
                continue
            dropped[p.untyped_storage().data_ptr()] = p.untyped_storage().nbytes()
            module._parameters[name] = torch.nn.Parameter(torch.zeros((), dtype=p.dtype).expand(p.shape),
                                                          requires_grad=False)
    return sum(dropped.values())
