"""The loss: a linear + cross-entropy that never holds all the logits, and the training loss (the validation loss over
the fixed evaluation windows is batches.evaluate_loss: this file imports only torch, so the model file does too).

`linear_cross_entropy(h, weight, targets)` equals `F.cross_entropy((h @ weight.T).float(), targets, ignore_index=-1)`
but computes the logits a chunk of tokens at a time. At the 60m shape (32 x 1024 tokens, 32,128-token vocabulary) the
plain form holds a 4 GiB fp32 copy of the logits and a 4 GiB log-softmax for backward; this holds one chunk's logits
and the two gradients. Memory and time: `python -m minimal_asymloop.bench loss`.
"""

import torch

IGNORE = -1  # target id that counts for nothing (prompts in fine-tuning and tasks)
CHUNK_ELEMENTS = 2**27  # (ours) logits per chunk: 512 MiB in fp32, e.g. 4,177 tokens x 32,128


class _LinearCrossEntropy(torch.autograd.Function):
    """Mean cross-entropy of h @ weight.T over the tokens whose target is not IGNORE, chunk by chunk.

    The gradient of a summed cross-entropy with respect to its logits is softmax - one_hot, known in forward; so
    forward turns each chunk's logits into that gradient in place and multiplies it out into d h and d weight
    at once (the approach of Liger Kernel's fused linear cross-entropy). Backward only scales them."""

    @staticmethod
    def forward(ctx, h, weight, targets, dtype, chunk):
        # h (T, d) any float dtype, weight (V, d), targets (T,) int64; matmuls in `dtype`, softmax in fp32
        need_grad = ctx.needs_input_grad[0] or ctx.needs_input_grad[1]
        w = weight.to(dtype)
        valid = targets != IGNORE
        n_valid = valid.sum()
        total = torch.zeros((), dtype=torch.float32, device=h.device)
        d_h = torch.empty_like(h) if need_grad else None
        d_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_grad else None
        for i, (h_c, t_c, ok) in enumerate(zip(h.split(chunk), targets.split(chunk), valid.split(chunk))):
            h_c, t_c = h_c.to(dtype), t_c.clamp_min(0)
            logits = (h_c @ w.t()).float()  # (c, V): the only logits alive at any time
            picked = logits.gather(1, t_c.unsqueeze(1)).squeeze(1)  # (c,) the targets' logits
            top = logits.amax(dim=-1, keepdim=True)
            expd = logits.sub_(top).exp_()  # in place: no second (c, V) tensor, as logsumexp would make
            z = expd.sum(dim=-1)
            total = total + torch.where(ok, top.squeeze(1) + z.log() - picked, 0.0).sum()  # logsumexp - target logit
            if need_grad:  # softmax - one_hot, in place; IGNORE rows get no gradient
                grad = expd.div_(z.unsqueeze(1))
                grad.scatter_add_(1, t_c.unsqueeze(1), torch.full_like(picked.unsqueeze(1), -1.0))
                grad = grad.mul_(ok.unsqueeze(1)).to(dtype)
                d_h.split(chunk)[i].copy_(grad @ w)
                d_w += (grad.t() @ h_c).float()
                del grad
            del logits, expd  # free this chunk's logits before the next chunk's exist
        ctx.save_for_backward(d_h, d_w, n_valid)
        return total / n_valid

    @staticmethod
    def backward(ctx, d_loss):
        d_h, d_w, n_valid = ctx.saved_tensors
        scale = d_loss / n_valid
        return ((d_h * scale).to(d_h.dtype) if ctx.needs_input_grad[0] else None,
                (d_w * scale) if ctx.needs_input_grad[1] else None, None, None, None)


def linear_cross_entropy(h, weight, targets, chunk: int | None = None):
    """Mean cross-entropy of the logits h @ weight.T (h (..., d), weight (V, d), targets (...)), ignoring targets -1.

    Under autocast the matmuls run in the autocast dtype (as a Linear would) and the softmax in fp32; otherwise in
    h's dtype. chunk: tokens per chunk, None -> CHUNK_ELEMENTS // V."""
    device_type = h.device.type
    dtype = torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else h.dtype
    chunk = chunk or max(1, CHUNK_ELEMENTS // weight.size(0))
    with torch.autocast(device_type, enabled=False):  # the dtypes above are explicit
        return _LinearCrossEntropy.apply(h.flatten(0, -2), weight, targets.flatten(), dtype, chunk)


def plain_cross_entropy(h, weight, targets):
    """The reference linear_cross_entropy must equal: every logit materialized, then an fp32 cross-entropy."""
    logits = torch.nn.functional.linear(h, weight)
    return torch.nn.functional.cross_entropy(logits.float().flatten(0, -2), targets.flatten(), ignore_index=IGNORE)


# ----------------------------------------------------------------------------- the training loss


def _unwrap(model):
    model = getattr(model, "module", model)  # DDP
    return getattr(model, "_orig_mod", model)  # torch.compile


def compute_loss(model, x, y, **depth):
    """The one place a batch becomes a loss. Returns (loss to backprop, LM cross-entropy, aux dict).

    With MoE FFNs the model's loss already includes its routers' weighted aux losses in training mode
    (LoopedLM.forward); aux holds them by name for the log, and the cross-entropy is the loss without them.
    depth: this step's n_iter and backprop_depth when the trainer samples K (depth.py); none: the model's K.
    """
    _, loss = model(x, y, return_logits=False, **depth)  # linear_cross_entropy: no logits materialized
    raw = _unwrap(model)
    aux = raw.moe_aux_losses() if raw.training else {}
    return loss, (loss - sum(aux.values()) if aux else loss), aux
